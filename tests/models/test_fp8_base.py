"""An FP8 base for LoRA at the model level (chunkloss/models/fp8.py): a PEFT LoRA model's frozen projection
weights stored in e4m3 once, the fused calls running their base GEMMs in fp8, PEFT saving adapters only."""

import copy
import gc
import logging
import os
import weakref

import pytest
import torch

from chunkloss.kernels.fp8 import Float8Linear
from chunkloss.models import patch, quantize_base_fp8
from tests.models.test_lora import lora_model, loss_and_grads
from tests.models.test_patch import N_LAYERS, VOCAB, grad_fn_counts, tiny_model
from tests.tolerances import assert_close_to_ref, err

peft = pytest.importorskip("peft")


def _lora_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]


def test_quantize_base_fp8_keeps_only_the_fp8_bytes(tmp_path):
    """Each LoRA base becomes a Float8Linear holding out·in + 4·out bytes; the bf16 weights are released; a
    dtype cast of the model leaves the bytes alone; save_pretrained writes the adapters only; merging is
    refused in one line."""
    model = lora_model("llama").bfloat16()
    bases = [m.base_layer for m in _lora_layers(model)]
    released = [weakref.ref(b.weight) for b in bases]
    shapes = [tuple(b.weight.shape) for b in bases]
    assert quantize_base_fp8(model) == 7 * N_LAYERS
    del bases
    gc.collect()
    assert all(r() is None for r in released)
    for layer, (out_f, in_f) in zip(_lora_layers(model), shapes, strict=True):
        base = layer.base_layer
        assert type(base) is Float8Linear and not list(base.parameters())  # Llama's projections have no bias
        assert sum(t.numel() * t.element_size() for t in base.buffers()) == out_f * in_f + 4 * out_f
    model.to(torch.float32)  # the adapters and norms become fp32; the e4m3 bytes stay bytes
    assert all(layer.base_layer.weight_fp8.dtype == torch.uint8 for layer in _lora_layers(model))
    assert quantize_base_fp8(model) == 7 * N_LAYERS  # already in fp8: left as it is
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)
    with pytest.raises(AttributeError, match="has no dense 'weight'"):
        model.merge_and_unload()


def test_fused_fp8_bases_equal_pefts_forward_on_them(caplog):
    """fp32 model, LoRA on o, gate, up and down over fp8 bases: the fused calls (lora_linear, gated_mlp) give
    the loss and adapter gradients of PEFT's own forward through the Float8Linear bases, which runs the same
    products one module at a time."""
    targets = ["o_proj", "gate_proj", "up_proj", "down_proj"]
    model = lora_model("llama", targets)
    quantize_base_fp8(model)
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    patched = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="chunkloss.models"):
        patch(patched, loss_options={"compile": False})
    assert f"{4 * N_LAYERS} LoRA projections (fp8 base)" in caplog.text and "separate" not in caplog.text
    loss, grads = loss_and_grads(patched, input_ids)
    counts = grad_fn_counts(loss)
    assert counts.get("GatedMLPFunctionBackward") == N_LAYERS, counts
    assert counts.get("LoraLinearFunctionBackward") == N_LAYERS, counts
    assert_close_to_ref(loss, ref_loss, name="loss")
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert_close_to_ref(g, ref_grads[name], name=name)


def test_fp8_model_against_the_unquantised_model():
    """A bf16 model with LoRA on all seven projections, fused, on fp8 bases against the same model on its
    bf16 weights: the loss moves by 7e-5 relative and the adapter gradients by up to 0.060 of their largest
    value (measured, torch 2.13 CPU; the bounds are 0.0002 and 0.12)."""
    model = lora_model("llama").bfloat16()
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    patch(model, loss_options={"compile": False})
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    quantize_base_fp8(model)
    loss, grads = loss_and_grads(model, input_ids)
    counts = grad_fn_counts(loss)
    assert counts.get("AttentionInputFunctionBackward") == N_LAYERS, counts
    assert err(loss, ref_loss) <= 2e-4
    assert max(err(g, ref_grads[n]) for n, g in grads.items()) <= 0.12


def test_quantize_base_fp8_refusals():
    with pytest.raises(ValueError, match="has no PEFT LoRA projection"):
        quantize_base_fp8(tiny_model("llama"))
    model = lora_model("llama")
    model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="up_proj's base weight requires grad"):
        quantize_base_fp8(model)


def test_fp8_base_of_another_dtype_runs_its_own_forward(caplog):
    """Bases quantised from bf16 in a model cast to fp32 afterwards: the fused calls compute in the bf16 the
    weights were quantised from, so each such projection runs PEFT's forward through its Float8Linear (fp8
    products in fp32), named in patch's log line; the loss and adapter gradients come out fp32 and finite."""
    model = lora_model("llama").bfloat16()
    quantize_base_fp8(model)
    model.float()
    with caplog.at_level(logging.INFO, logger="chunkloss.models"):
        patch(model, loss_options={"compile": False})
    assert "fp8 base quantised from torch.bfloat16 on a torch.float32 model" in caplog.text, caplog.text
    loss, grads = loss_and_grads(
        model, torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    )
    assert loss.dtype == torch.float32 and loss.isfinite()
    assert grads and all(g.dtype == torch.float32 and g.isfinite().all() for g in grads.values())
    assert "LoraLinearFunctionBackward" in grad_fn_counts(loss)  # Float8Linear's own fp8_linear call


def test_adapters_trained_on_fp8_bases_merge_into_the_bf16_model(tmp_path):
    """Adapters trained over fp8 bases and saved load into the same model on its bf16 weights (a user's
    16-bit checkpoint) and merge there: the merged bf16 model scores a held-out batch as the fp8 model it
    was trained in, within the fp8 bases' error (measured 2.6e-5 relative, torch 2.13 CPU; the bound is
    2e-4, as for one step's loss above), and keeps what training gained."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    model = lora_model("llama").bfloat16()
    bf16 = copy.deepcopy(model)
    quantize_base_fp8(model)
    patch(model, loss_options={"compile": False})
    gen = torch.Generator().manual_seed(0)
    train_ids, held_out = (torch.randint(0, VOCAB, (2, 9), generator=gen) for _ in range(2))

    def score(m):
        with torch.no_grad():
            return m(input_ids=held_out, labels=held_out).loss.float()

    before = score(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(10):
        opt.zero_grad()
        model(input_ids=train_ids, labels=train_ids).loss.backward()
        opt.step()
    trained = score(model)
    model.save_pretrained(tmp_path)
    set_peft_model_state_dict(bf16, load_file(os.path.join(tmp_path, "adapter_model.safetensors")))
    merged = bf16.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert err(score(merged), trained) <= 2e-4
    assert before - score(merged) > 0.01  # 0.018 gained on the held-out batch
