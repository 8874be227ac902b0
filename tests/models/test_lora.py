"""PEFT LoRA models under ``chunkloss.models.patch``: plain adapters run inside the fused calls with PEFT's
loss and adapter gradients; what the kernels cannot take keeps PEFT's forward, named in one log line."""

import copy
import logging

import pytest
import torch

from tests.models.test_patch import N_LAYERS, VOCAB, grad_fn_counts, tiny_model
from tests.tolerances import assert_close_to_ref

peft = pytest.importorskip("peft")
from chunkloss.models import patch  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(model_type: str, targets=ALL, seed: int = 0, **config):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=targets, **config)
    model = peft.get_peft_model(tiny_model(model_type), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # zero-initialised B would make the adapters invisible
    return model


def loss_and_grads(model, input_ids):
    model.zero_grad()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def patch_logged(model, caplog, **options) -> str:
    """Patches ``model`` and returns the one line ``patch`` logged."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chunkloss.models"):
        patch(model, loss_options={"compile": False}, **options)
    lines = [r.getMessage() for r in caplog.records if r.name == "chunkloss.models"]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2"])
def test_lora_on_every_projection_runs_fused(model_type, caplog):
    """LoRA on all seven projections: q/k/v in attention_input (not Qwen3, whose q/k norms keep separate
    projections), o_proj in lora_linear, gate/up/down in gated_mlp; PEFT's loss and adapter gradients."""
    model = lora_model(model_type)
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    patched = copy.deepcopy(model)
    line = patch_logged(patched, caplog)
    assert f"{7 * N_LAYERS} LoRA projections" in line and "separate" not in line, line
    loss, grads = loss_and_grads(patched, input_ids)
    counts = grad_fn_counts(loss)
    fused_input = 0 if model_type == "qwen3" else N_LAYERS
    assert counts.get("AttentionInputFunctionBackward", 0) == fused_input, counts
    assert counts.get("GatedMLPFunctionBackward") == N_LAYERS, counts
    expected = N_LAYERS * (4 if model_type == "qwen3" else 1)  # o_proj; Qwen3's q/k/v too
    assert counts.get("LoraLinearFunctionBackward", 0) == expected, counts
    assert_close_to_ref(loss, ref_loss)
    assert set(grads) == set(ref_grads) and all("lora_" in n for n in grads)
    for name, g in grads.items():
        assert_close_to_ref(g, ref_grads[name], name=name)


def test_fp32_adapters_on_a_bf16_model():
    """PEFT keeps adapters in fp32 on a bf16 base (autocast_adapter_dtype): the adapters' products run in
    fp32, as PEFT's do. Compared with an fp32 copy of the whole model.

    k = 8 for the gradients: through this two-layer bf16 model, the first layer's adapter gradients differ
    from the fp32 model's by up to 3.7x the unpatched bf16 model's error with the RMSNorm kernel alone patched
    (PEFT's own LoRA forward, no LoRA kernel), and up to 5.0x with everything fused (measured over 2 seeds and
    3 patch configurations); the loss keeps the table's k."""
    model = lora_model("llama")
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref32_loss, ref32_grads = loss_and_grads(model, input_ids)
    bf16 = copy.deepcopy(model)
    for name, p in bf16.named_parameters():
        if "lora_" not in name:
            p.data = p.data.bfloat16()
    torch_loss, torch_grads = loss_and_grads(bf16, input_ids)
    patched = copy.deepcopy(bf16)
    patch(patched, loss_options={"compile": False})
    loss, grads = loss_and_grads(patched, input_ids)
    assert "AttentionInputFunctionBackward" in grad_fn_counts(loss)
    assert_close_to_ref(loss.float(), ref32_loss, torch_loss.float(), dtype=torch.bfloat16)
    for name, g in grads.items():
        assert g.dtype == torch.float32, name
        assert_close_to_ref(g, ref32_grads[name], torch_grads[name], name=name, k=8.0, dtype=torch.bfloat16)


def test_unsupported_adapters_keep_peft_forward_with_one_log_line(caplog):
    """DoRA on q_proj and LoRA on the embeddings keep PEFT's forward; the rest is fused; the loss and every
    adapter gradient are PEFT's."""
    model = peft.get_peft_model(
        tiny_model("llama"),
        peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "embed_tokens"], use_dora=True),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0.0, 0.1)
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    patched = copy.deepcopy(model)
    line = patch_logged(patched, caplog)
    assert caplog.records[-1].levelno == logging.WARNING
    assert "q_proj (a Dora adapter)" in line and "embed_tokens (lora adapter" in line, line
    assert "gate_proj (a Dora adapter)" in line, line  # DoRA on the MLP too: its projections stay PEFT's
    loss, grads = loss_and_grads(patched, input_ids)
    counts = grad_fn_counts(loss)
    assert "AttentionInputFunctionBackward" not in counts and "GatedMLPFunctionBackward" not in counts, counts
    assert counts.get("RoPEFunctionBackward") == N_LAYERS and counts.get("GLUFunctionBackward") == N_LAYERS
    assert_close_to_ref(loss, ref_loss)
    for name, g in grads.items():
        assert_close_to_ref(g, ref_grads[name], name=name)


def _fused_inputs(model, input_ids) -> int:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    return grad_fn_counts(loss).get("AttentionInputFunctionBackward", 0)


def test_adapter_state_is_read_at_each_call(caplog):
    """Merging, unmerging, disabling and activating several adapters between calls: each call computes what
    PEFT computes then, fused where one plain adapter (or none) is active."""
    model = lora_model("llama", targets=["q_proj", "v_proj"])
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    input_ids = torch.randint(0, VOCAB, (2, 7))
    patched = copy.deepcopy(model)
    patch(patched, loss_options={"compile": False})
    base = patched.get_base_model()
    layers = base.model.layers

    def both(fn):
        fn(model)
        fn(patched)
        with torch.no_grad():
            return model(input_ids=input_ids, labels=input_ids).loss, patched(
                input_ids=input_ids, labels=input_ids
            ).loss

    ref, loss = both(lambda m: None)
    assert_close_to_ref(loss, ref)
    assert _fused_inputs(patched, input_ids) == N_LAYERS

    ref, loss = both(lambda m: m.merge_adapter())
    assert_close_to_ref(loss, ref)
    assert _fused_inputs(patched, input_ids) == 0  # merged: PEFT's forward (the base layer)
    ref, loss = both(lambda m: m.unmerge_adapter())
    assert_close_to_ref(loss, ref)
    assert _fused_inputs(patched, input_ids) == N_LAYERS

    with model.disable_adapter(), patched.disable_adapter():  # how TRL's DPO gets the reference's log-probs
        ref, loss = both(lambda m: None)
        handle = base.model.embed_tokens.register_forward_hook(lambda m, i, out: out.requires_grad_())
        assert _fused_inputs(patched, input_ids) == N_LAYERS  # the base weights alone, fused (a graph to see)
        handle.remove()
    assert_close_to_ref(loss, ref)

    for m in (model, patched):
        for layer in m.get_base_model().model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj):
                proj.set_adapter(["default", "second"])
    ref, loss = both(lambda m: None)
    assert_close_to_ref(loss, ref)
    assert _fused_inputs(patched, input_ids) == 0
    assert layers[0].self_attn.q_proj.active_adapters == ["default", "second"]


def test_save_and_unmerge_after_training_steps(tmp_path):
    """Adapters trained through the fused calls save with PEFT's save_pretrained and load into an unpatched
    model that computes the same loss; merge_and_unload gives the same model without adapters."""
    model = lora_model("qwen2")
    input_ids = torch.randint(0, VOCAB, (2, 7))
    patch(model, loss_options={"compile": False})
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        opt.step()
    with torch.no_grad():
        trained = model(input_ids=input_ids, labels=input_ids).loss
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    base = tiny_model("qwen2")  # lora_model's frozen weights: the same seed
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    with torch.no_grad():
        assert_close_to_ref(loaded(input_ids=input_ids, labels=input_ids).loss, trained)
        merged = model.merge_and_unload()
        assert_close_to_ref(merged(input_ids=input_ids, labels=input_ids).loss, trained)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_through_the_fused_calls(reentrant):
    model = lora_model("llama")
    input_ids = torch.randint(0, VOCAB, (2, 7))
    model.train()
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    patched = copy.deepcopy(model)
    patch(patched, loss_options={"compile": False})
    patched.get_base_model().gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    patched.enable_input_require_grads()  # what PEFT/TRL do for reentrant checkpointing of a frozen base
    loss, grads = loss_and_grads(patched, input_ids)
    counts = grad_fn_counts(loss)
    if reentrant:
        assert "CheckpointFunctionBackward" in counts, counts
    else:
        assert counts.get("AttentionInputFunctionBackward") == N_LAYERS, counts
    assert_close_to_ref(loss, ref_loss)
    for name, g in grads.items():
        assert_close_to_ref(g, ref_grads[name], name=name)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_adapter_dropout_draws_pefts_masks(model_type):
    """lora_dropout > 0 in training: the fused calls draw the masks PEFT draws, in its order (q, k, v, o,
    gate, up, down), so from one seed the loss and every adapter gradient are PEFT's; the masks are in effect
    (the loss differs from evaluation's, which has none)."""
    model = lora_model(model_type, lora_dropout=0.3)
    input_ids = torch.randint(0, VOCAB, (2, 7))
    patched = copy.deepcopy(model)
    patch(patched, loss_options={"compile": False})
    torch.manual_seed(5)
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    torch.manual_seed(5)
    loss, grads = loss_and_grads(patched, input_ids)
    fused = "AttentionInputFunctionBackward" if model_type == "llama" else "LoraLinearFunctionBackward"
    assert fused in grad_fn_counts(loss) and "GatedMLPFunctionBackward" in grad_fn_counts(loss)
    assert_close_to_ref(loss, ref_loss)
    for name, g in grads.items():
        assert_close_to_ref(g, ref_grads[name], name=name)
    patched.eval()
    with torch.no_grad():
        assert abs(patched(input_ids=input_ids, labels=input_ids).loss.item() - loss.item()) > 1e-4
