"""chunkloss.models.patch on tiny random models of each supported family: same logits, loss and gradients."""

import copy
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from chunkloss.models import SUPPORTED_MODEL_TYPES, patch
from tests.child_process import in_child_process
from tests.tolerances import assert_close_to_ref

# CPU-heavy and independent of the rest: in the child process beside the suite (tests/child_process.py).
pytestmark = in_child_process

# fp32 models; the kernels round in a different order than PyTorch, nothing else differs.
N_LAYERS, VOCAB = 2, 128

CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
}


def tiny_model(model_type: str, **overrides):
    config = getattr(transformers, CONFIGS[model_type])(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        **overrides,
    )
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones (Llama) / zeros (Gemma) at init would hide a wrong weight or offset
                p.normal_(0.0, 0.3)
    return model


def grad_fn_counts(t: torch.Tensor) -> dict[str, int]:
    """How many autograd nodes of each type produced `t`: proves the patched path ran."""
    counts, seen, stack = {}, set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        counts[type(fn).__name__] = counts.get(type(fn).__name__, 0) + 1
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return counts


def expected_norms(model_type: str) -> int:
    per_layer = {"gemma2": 4, "qwen3": 4}.get(model_type, 2)  # Gemma-2 pre/post norms; Qwen3 q/k norms
    return per_layer * N_LAYERS + 1


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_patch_matches_unpatched(model_type):
    model = tiny_model(model_type)
    input_ids = torch.randint(0, VOCAB, (2, 9))
    labels = input_ids.clone()
    labels[0, :3] = -100  # a masked prompt
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    patched = copy.deepcopy(model)
    patched.zero_grad()
    assert patch(patched, loss_options={"compile": False}) is patched

    logits = patched(input_ids=input_ids).logits  # no labels: the original forward, logits returned
    assert_close_to_ref(logits, out.logits)

    out2 = patched(input_ids=input_ids, labels=labels)
    assert out2.logits is None  # documented: with labels the logits are never materialised
    assert_close_to_ref(out2.loss, out.loss)
    counts = grad_fn_counts(out2.loss)
    fused = 0 if model_type == "qwen3" else N_LAYERS  # input norm + q/k/v + RoPE as one attention_input
    assert counts.get("AttentionInputFunctionBackward", 0) == fused, counts
    assert counts.get("RMSNormFunctionBackward") == expected_norms(model_type) - fused, counts
    assert counts.get("RoPEFunctionBackward", 0) == N_LAYERS - fused, counts
    assert counts.get("GatedMLPFunctionBackward") == N_LAYERS and "GLUFunctionBackward" not in counts, counts
    assert not any("LogSoftmax" in k for k in counts), counts  # the loss went through the chunked CE
    out2.loss.backward()
    for name, p in patched.named_parameters():
        assert_close_to_ref(p.grad, ref_grads[name], name=name)


def test_patch_num_items_in_batch_and_tuple_output():
    model = tiny_model("llama")
    input_ids = torch.randint(0, VOCAB, (2, 7))
    labels = input_ids.clone()
    labels[1, 4:] = -100
    n_items = torch.tensor(5)  # a global count under gradient accumulation, not this batch's
    ref = model(input_ids=input_ids, labels=labels, num_items_in_batch=n_items).loss
    patched = copy.deepcopy(model)
    patch(patched, loss_options={"compile": False})
    loss = patched(input_ids=input_ids, labels=labels, num_items_in_batch=n_items).loss
    assert_close_to_ref(loss, ref)
    tup = patched(input_ids=input_ids, labels=labels, num_items_in_batch=n_items, return_dict=False)
    assert_close_to_ref(tup[0], ref)


def test_patch_parts_can_be_left_out():
    model = tiny_model("qwen2")
    patch(model, rope=False, loss=False)
    input_ids = torch.randint(0, VOCAB, (1, 6))
    out = model(input_ids=input_ids, labels=input_ids)
    assert out.logits is not None  # loss=False keeps transformers' loss on logits
    counts = grad_fn_counts(out.loss)
    assert "RoPEFunctionBackward" not in counts and counts.get("GatedMLPFunctionBackward") == N_LAYERS


def test_unsupported_architecture_lists_supported():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3, gemma, gemma2") as err:
        patch(model)
    assert "gpt2" in str(err.value)


def test_patched_generate_matches():
    """Decoding with a KV cache: one-token steps at growing positions through the patched norms and RoPE."""
    model = tiny_model("qwen3").eval()
    prompt = torch.randint(0, VOCAB, (2, 5))
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ref = model.generate(prompt, **kwargs)
        patched = copy.deepcopy(model)
        patch(patched)
        got = patched.generate(prompt, **kwargs)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_patch_peft_model():
    import peft  # a declared test dependency (pyproject [test])

    model = tiny_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # zero-initialised B would make the adapters invisible
    input_ids = torch.randint(0, VOCAB, (2, 6))
    ref = lora(input_ids=input_ids, labels=input_ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in lora.named_parameters() if p.requires_grad}
    patched = copy.deepcopy(lora)
    patched.zero_grad()
    assert patch(patched, loss_options={"compile": False}) is patched
    loss = patched(input_ids=input_ids, labels=input_ids).loss
    assert_close_to_ref(loss, ref)
    counts = grad_fn_counts(loss)  # the LoRA q_proj and gate_proj run inside the fused calls
    assert counts.get("GatedMLPFunctionBackward") == N_LAYERS and "GLUFunctionBackward" not in counts, counts
    assert counts.get("AttentionInputFunctionBackward") == N_LAYERS and "RoPEFunctionBackward" not in counts
    loss.backward()
    for name, p in patched.named_parameters():
        if p.requires_grad:
            assert_close_to_ref(p.grad, ref_grads[name], name=name)


def _loss_and_fused_layers(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    return loss, grad_fn_counts(loss).get("AttentionInputFunctionBackward", 0)


def test_attention_fusion_is_undone_and_redone():
    """Patching twice, and patching again with other options, each leave a model that normalises and rotates
    exactly once, with the options of the last call."""
    model = tiny_model("qwen2")  # q/k/v biases
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref = model(input_ids=input_ids, labels=input_ids).loss
    cases = (
        ({}, N_LAYERS, 0),
        ({}, N_LAYERS, 0),
        ({"attention": False}, 0, N_LAYERS),
        ({}, N_LAYERS, 0),
        ({"rope": False}, 0, 0),
    )
    for options, fused, ropes in cases:
        patch(model, loss_options={"compile": False}, **options)
        loss, n = _loss_and_fused_layers(model, input_ids)
        assert n == fused, options
        assert grad_fn_counts(loss).get("RoPEFunctionBackward", 0) == ropes, options
        assert_close_to_ref(loss, ref)


def test_patch_leaves_other_models_of_the_family_alone():
    """patch changes this model's modules only: transformers' apply_rotary_pos_emb and another model of the
    same family run as before."""
    model, other = tiny_model("llama"), tiny_model("llama")
    modeling = sys.modules[type(model).__module__]
    rope = modeling.apply_rotary_pos_emb
    patch(model, loss_options={"compile": False})
    assert modeling.apply_rotary_pos_emb is rope
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # the name class lookups use
    input_ids = torch.randint(0, VOCAB, (1, 5))
    counts = grad_fn_counts(other(input_ids=input_ids, labels=input_ids).loss)
    assert not any(k.endswith("FunctionBackward") for k in counts), counts


def test_attention_fusion_after_deepcopy_and_with_a_hooked_norm():
    """A copy of a patched model reads its own weights; a norm with a hook (ZeRO-3 gathers parameters in
    one) runs as a module and its attention as transformers' does."""
    model = tiny_model("gemma")
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref = model(input_ids=input_ids, labels=input_ids).loss
    patch(model, loss_options={"compile": False})
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # the copy must not see this
    loss, n = _loss_and_fused_layers(twin, input_ids)
    assert n == N_LAYERS
    assert_close_to_ref(loss, ref)
    twin.model.layers[0].input_layernorm.register_forward_pre_hook(lambda module, args: None)
    loss, n = _loss_and_fused_layers(twin, input_ids)
    assert n == N_LAYERS - 1
    assert_close_to_ref(loss, ref)


def test_attention_fusion_under_autocast():
    """fp32 weights under bf16 autocast: the norm runs in fp32 before the projections cast, which the fused
    call cannot reproduce, so those layers run the norm kernel and transformers' attention; a bf16 model
    under bf16 autocast takes the fused call."""
    model = tiny_model("llama")
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref = model(input_ids=input_ids, labels=input_ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_bf16 = model(input_ids=input_ids, labels=input_ids).loss
    fp32, bf16 = copy.deepcopy(model), copy.deepcopy(model).bfloat16()
    for m, fused in ((fp32, 0), (bf16, N_LAYERS)):
        patch(m, loss_options={"compile": False})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, n = _loss_and_fused_layers(m, input_ids)
        assert n == fused
        assert_close_to_ref(loss.float(), ref, torch_bf16.float())


def test_gemma2_final_logit_softcapping_reaches_the_loss():
    # A softcap small enough to change the loss visibly (the default 30 barely touches tiny random logits).
    model = tiny_model("gemma2", final_logit_softcapping=0.5)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # logits of order 1, where the cap bends them
    input_ids = torch.randint(0, VOCAB, (2, 6))
    ref = model(input_ids=input_ids, labels=input_ids).loss
    model.config.final_logit_softcapping = None
    uncapped = model(input_ids=input_ids, labels=input_ids).loss
    model.config.final_logit_softcapping = 0.5
    assert not torch.allclose(ref, uncapped, atol=1e-3)
    patched = copy.deepcopy(model)
    patch(patched, loss_options={"compile": False})
    assert_close_to_ref(patched(input_ids=input_ids, labels=input_ids).loss, ref)


def loss_and_grads(model, input_ids):
    model.zero_grad()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {"mlp_bias": True}),  # biases on the three projections
        ("gemma", {"hidden_activation": "gelu"}),  # exact GELU
    ],
)
def test_fused_mlp_variants_match(model_type, overrides):
    """Both backward modes of the fused MLP give transformers' loss and gradients."""
    model = tiny_model(model_type, **overrides)
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    for recompute in (True, False):
        patched = copy.deepcopy(model)
        patch(patched, loss_options={"compile": False}, mlp_recompute=recompute)
        loss, grads = loss_and_grads(patched, input_ids)
        assert_close_to_ref(loss, ref_loss)
        for name, g in grads.items():
            assert_close_to_ref(g, ref_grads[name], name=f"{name} {recompute}")


def test_hooked_projection_keeps_its_forward():
    """A forward hook on a projection must still run, so that MLP is not fused (checked per call)."""
    model = tiny_model("qwen3")
    patch(model, loss=False)
    calls = []
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *args: calls.append(1))
    input_ids = torch.randint(0, VOCAB, (1, 5))
    counts = grad_fn_counts(model(input_ids=input_ids, labels=input_ids).loss)
    assert calls == [1]
    assert counts.get("GatedMLPFunctionBackward") == N_LAYERS - 1 and counts.get("GLUFunctionBackward") == 1


def test_unsupported_activation_warns_and_keeps_transformers_mlp():
    model = tiny_model("llama", hidden_act="relu")
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp uses ReLU"):
        patch(model, loss=False)
    input_ids = torch.randint(0, VOCAB, (1, 5))
    counts = grad_fn_counts(model(input_ids=input_ids, labels=input_ids).loss)
    assert "GatedMLPFunctionBackward" not in counts and "GLUFunctionBackward" not in counts


def test_cpu_model_is_refused_without_the_interpreter(monkeypatch):
    with torch.device("cpu"):
        model = tiny_model("llama")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"on \['cpu'\].*TRITON_INTERPRET=1"):
        patch(model)
    assert all(type(m) is vars(type(m)).get("_chunkloss_base", type(m)) for m in model.modules())  # untouched


def _grads(model, input_ids, labels):
    model.zero_grad()
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_norm_recompute_gives_the_same_bits(model_type):
    """The backward runs the pre-norms again instead of keeping their outputs: the same kernel on the same
    inputs, so the loss and every gradient equal the run that keeps them, bit for bit."""
    model = tiny_model(model_type)
    input_ids = torch.randint(0, VOCAB, (2, 9))
    labels = input_ids.clone()
    labels[0, :3] = -100
    keep = copy.deepcopy(model)
    patch(keep, loss_options={"compile": False}, mlp_recompute=True)
    loss_keep, grads_keep = _grads(keep, input_ids, labels)
    patch(model, loss_options={"compile": False}, mlp_recompute=True, norm_recompute=True)
    loss, grads = _grads(model, input_ids, labels)
    assert torch.equal(loss, loss_keep)
    for name, g in grads.items():
        assert torch.equal(g, grads_keep[name]), name
    model.gradient_checkpointing_enable()  # checkpointed layers keep nothing anyway: the plain forward runs
    model.train()
    loss_gc, grads_gc = _grads(model, input_ids, labels)
    assert torch.equal(loss_gc, loss_keep)
    for name, g in grads_gc.items():
        assert torch.equal(g, grads_keep[name]), name


def test_norm_recompute_needs_the_norm_kernel():
    with pytest.raises(ValueError, match="norm_recompute=True needs rms_norm=True"):
        patch(tiny_model("llama"), rms_norm=False, norm_recompute=True)


def test_norm_recompute_with_lora_gives_the_same_bits(monkeypatch):
    """LoRA adapters inside the fused calls read the recomputed norm output like the base projections."""
    import peft

    from chunkloss.models import saved_norms

    runs = []
    get = saved_norms._Recipe.get
    monkeypatch.setattr(saved_norms._Recipe, "get", lambda r: runs.append(r.value is None) or get(r))

    model = tiny_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    input_ids = torch.randint(0, VOCAB, (2, 6))
    keep = copy.deepcopy(lora)
    patch(keep, loss_options={"compile": False})
    patch(lora, loss_options={"compile": False}, norm_recompute=True)
    out = [_grads(m, input_ids, input_ids) for m in (keep, lora)]
    # The post-attention norms ran again in the backward, once each; the input norms run inside
    # attention_input, whose backward recomputes them itself.
    assert sum(runs) == N_LAYERS
    assert torch.equal(out[0][0], out[1][0])
    for name, g in out[0][1].items():
        assert (g is None and out[1][1][name] is None) or torch.equal(g, out[1][1][name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_patch_bf16_on_gpu(model_type):
    model = tiny_model(model_type).cuda().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 64), device="cuda")
    ref32 = copy.deepcopy(model).float()(input_ids=ids, labels=ids).loss
    ref = model(input_ids=ids, labels=ids).loss
    patched = patch(copy.deepcopy(model))
    loss = patched(input_ids=ids, labels=ids).loss
    assert_close_to_ref(loss, ref32, ref, "loss", dtype=torch.bfloat16)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in patched.parameters())
