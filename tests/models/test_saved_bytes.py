"""Activation memory of a decoder layer: bytes autograd saves for the backward, transformers vs ``patch``.

What is measured: one bf16 forward with gradients of a two-layer model of each family, the widths in the
proportions of a released checkpoint (I / H, heads x head_dim / H, KV heads), attention through SDPA as in
training. Every tensor autograd saves while a decoder layer runs is recorded by
``torch.autograd.graph.saved_tensors_hooks``; distinct storages are summed once over the whole model
(cos / sin tables shared by the layers count once), parameters excluded, and the sum is divided by layers x
tokens. The patched model's kernels run in the interpreter on CPU: the saved tensors are the ones their
autograd Functions save on a GPU, so the byte counts are those of a GPU run. Attention's own saved tensors
(SDPA's output and log-sum-exp) come from the CPU SDPA kernel, which saves what the CUDA ones save.
"""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from chunkloss.models import patch
from tests.child_process import in_child_process

# CPU-heavy and independent of the rest: in the child process beside the suite (tests/child_process.py).
pytestmark = in_child_process

N_LAYERS, VOCAB, BATCH, SEQ = 2, 64, 2, 32
# Width proportions of Llama-3.2-1B (I = 4H, 32 x 64 heads, 8 KV heads), Qwen3-8B (I = 3H, 32 x 128, 8 KV
# heads, per-head q/k norms) and Gemma-2-2B (I = 4H, 8 x 256 heads = 0.89H, 4 KV heads, four norms a layer),
# at H = 256.
CONFIGS = {
    "llama": (
        "LlamaConfig",
        {"intermediate_size": 1024, "num_attention_heads": 16, "head_dim": 16, "num_key_value_heads": 4},
    ),
    "qwen3": (
        "Qwen3Config",
        {"intermediate_size": 768, "num_attention_heads": 8, "head_dim": 32, "num_key_value_heads": 2},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "intermediate_size": 1024,
            "num_attention_heads": 8,
            "head_dim": 28,
            "num_key_value_heads": 4,
            "attn_logit_softcapping": None,
        },
    ),
}
TARGET = 0.40  # patched / transformers, per token and layer


def bf16_model(model_type: str):
    name, overrides = CONFIGS[model_type]
    config = getattr(transformers, name)(
        hidden_size=256,
        num_hidden_layers=N_LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        **overrides,
    )
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # SDPA, as training runs attention; set after construction because Gemma-2 refuses it at init (for its
    # logit softcapping, switched off above).
    model.config._attn_implementation = "sdpa"
    return model


def saved_bytes_per_token_layer(model) -> float:
    """Bytes of distinct non-parameter storages saved for backward inside the decoder layers, per token and
    layer, during one forward with gradients."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = []
    for layer in model.model.layers:
        handles.append(layer.register_forward_pre_hook(lambda *args: hooks.__enter__()))
        handles.append(layer.register_forward_hook(lambda *args: hooks.__exit__(None, None, None)))
    try:
        model(input_ids=torch.randint(0, VOCAB, (BATCH, SEQ)))
    finally:
        for h in handles:
            h.remove()
    return sum(storages.values()) / (N_LAYERS * BATCH * SEQ)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_patched_layer_saves_at_most_0_4_of_transformers(model_type, monkeypatch):
    model = bf16_model(model_type)
    eager = saved_bytes_per_token_layer(model)
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # undone after
    patch(model, loss=False, mlp_recompute=True)
    patched = saved_bytes_per_token_layer(model)
    hidden = model.config.hidden_size
    ratio = patched / eager
    assert ratio <= TARGET, (
        f"{model_type}: {patched / 2 / hidden:.1f} H-elements saved per token and layer patched, "
        f"{eager / 2 / hidden:.1f} with transformers' modules ({ratio:.2f}x > {TARGET})"
    )


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_norm_recompute_drops_both_pre_norm_outputs(model_type, monkeypatch):
    """``norm_recompute``: the norms before attention and MLP keep no output, H elements each per token."""
    model = bf16_model(model_type)
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # undone after
    patch(model, loss=False)
    keep = saved_bytes_per_token_layer(model)
    patch(model, loss=False, norm_recompute=True)
    dropped = (keep - saved_bytes_per_token_layer(model)) / 2 / model.config.hidden_size  # bf16 elements
    assert dropped == 2, f"{model_type}: {dropped} H-elements fewer per token and layer, not 2"
