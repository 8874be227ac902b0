"""The LM head under every combination of weight dtype (fp32, bf16, fp16) and autocast (off, bf16, fp16),
as ``nn.Linear`` runs it: under autocast the head's matmul runs in the autocast dtype whatever the weight's
dtype; without autocast the hidden states and the weight must share a dtype (the loss refuses a mismatch).

Checked at the loss (one call, against plain PyTorch) and through the SFT and DPO trainers (one batch,
against TRL's own trainer): ours against an fp32 reference is at most ``k`` times as far as PyTorch's (or
TRL's) same-dtype result, plus an ``atol`` (``tests.tolerances``). Autocast runs on the CPU in both dtypes
(accelerate turns on only bf16 there; on a GPU it autocasts fp16 too, which ``torch.autocast`` reproduces).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from chunkloss.data import tiny_dataset
from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.trainers import ChunkedDPOConfig, ChunkedDPOTrainer, ChunkedSFTConfig, ChunkedSFTTrainer
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import common_args, grads, model_pair, tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
COMBOS = [(w, a) for w in DTYPES for a in AUTOCAST]


def _autocast(dtype):
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


@pytest.mark.parametrize("weight_dtype,autocast", COMBOS)
def test_loss_follows_autocast(weight_dtype, autocast):
    """Under autocast the hidden states come in the autocast dtype (a backbone's output) and the weight in
    its own: the logits are the autocast dtype's, as ``F.linear`` gives them."""
    wd, ad = DTYPES[weight_dtype], AUTOCAST[autocast]
    g = torch.Generator().manual_seed(0)
    hidden32 = torch.randn(3, 47, 31, generator=g)
    weight32 = torch.randn(123, 31, generator=g) / 31**0.5
    labels = torch.randint(0, 123, (3, 47), generator=g)
    labels[0, :9] = -100
    hidden_dtype = wd if ad is None else ad

    def run(fn, h_dtype, w_dtype, ctx):
        h = hidden32.to(h_dtype, copy=True).requires_grad_()
        w = weight32.to(w_dtype, copy=True).requires_grad_()
        with ctx:
            loss = fn(h, w)
        loss.backward()
        return loss, h.grad, w.grad

    def torch_loss(h, w):
        return F.cross_entropy(F.linear(h, w).float().flatten(0, 1), labels.flatten())

    ours_fn = FusedLinearCrossEntropyLoss(chunk_size=29, compile=False)
    ours = run(lambda h, w: ours_fn(h, w, labels), hidden_dtype, wd, _autocast(ad))
    same = run(torch_loss, hidden_dtype, wd, _autocast(ad))
    ref = run(torch_loss, torch.float64, torch.float64, contextlib.nullcontext())
    compute = wd if ad is None else ad
    assert ours[0].dtype == torch.float32
    assert (ours[1].dtype, ours[2].dtype) == (hidden_dtype, wd)  # gradients in the inputs' dtypes
    for name, o, s, r in zip(("loss", "grad_hidden", "grad_weight"), ours, same, ref):
        assert_close_to_ref(o, r, s, name=name, dtype=compute)


@pytest.mark.parametrize("hidden_dtype,weight_dtype", [("bf16", "fp16"), ("fp32", "bf16"), ("fp16", "fp32")])
def test_loss_refuses_mixed_dtypes_without_autocast(hidden_dtype, weight_dtype):
    h = torch.randn(2, 5, 8, dtype=DTYPES[hidden_dtype])
    w = torch.randn(11, 8, dtype=DTYPES[weight_dtype])
    with pytest.raises(TypeError, match="differs from weight dtype"):
        FusedLinearCrossEntropyLoss(compile=False)(h, w, torch.zeros(2, 5, dtype=torch.long))


def _sft(tmp_path, model, chunked, **over):
    base = {**common_args(tmp_path, max_length=64), **over}
    if chunked:
        args, cls = ChunkedSFTConfig(**base, chunk_size=7, chunk_compile=False), ChunkedSFTTrainer
    else:
        args, cls = SFTConfig(**base), SFTTrainer
    return cls(model, args, train_dataset=tiny_dataset("sft", n=8), processing_class=tokenizer())


def _dpo(tmp_path, model, chunked, **over):
    base = {**common_args(tmp_path, max_length=48), **over}
    if chunked:
        args, cls = ChunkedDPOConfig(**base, chunk_size=9, chunk_compile=False), ChunkedDPOTrainer
    else:
        args, cls = DPOConfig(**base), DPOTrainer
    reference = copy.deepcopy(model)  # TRL's reference model, in the same dtype
    return cls(model, reference, args, train_dataset=tiny_dataset("dpo", n=8), processing_class=tokenizer())


def _loss_and_grads(trainer, batch, autocast):
    trainer.model.train()
    with _autocast(autocast):
        loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss.detach(), grads(trainer.model)


@pytest.mark.parametrize("build", [_sft, _dpo], ids=["sft", "dpo"])
@pytest.mark.parametrize("weight_dtype,autocast", COMBOS)
def test_trainer_follows_autocast(tmp_path, build, weight_dtype, autocast):
    """One batch through TRL's trainer in fp32 (the reference), TRL's and ours in the weight dtype under
    the autocast (as accelerate runs the forward when training)."""
    wd, ad = DTYPES[weight_dtype], AUTOCAST[autocast]
    m32, _ = model_pair()
    ref = build(tmp_path, copy.deepcopy(m32), chunked=False)
    trl_trainer = build(tmp_path, copy.deepcopy(m32).to(wd), chunked=False)
    ours = build(tmp_path, copy.deepcopy(m32).to(wd), chunked=True)
    batch = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))
    l_ref, g_ref = _loss_and_grads(ref, batch, None)
    l_trl, g_trl = _loss_and_grads(trl_trainer, batch, ad)
    l_our, g_our = _loss_and_grads(ours, batch, ad)
    compute = wd if ad is None else ad
    assert_close_to_ref(l_our, l_ref, l_trl, name="loss", dtype=compute)
    assert sorted(g_our) == sorted(g_trl) == sorted(g_ref)
    for n in g_ref:
        assert g_our[n].dtype == wd
        assert_close_to_ref(g_our[n], g_ref[n], g_trl[n], name=n, dtype=compute)


@pytest.mark.parametrize("build", [_sft, _dpo], ids=["sft", "dpo"])
def test_fp16_model_trains_with_bf16(tmp_path, build):
    """TRL's defaults with an fp16 model and ``bf16=True``: a real training step (accelerate autocasts the
    forward to bf16 and the head's fp16 weight with it), as TRL's trainer takes it."""
    losses = []
    for chunked in (False, True):
        model = model_pair()[0].to(torch.float16)
        trainer = build(tmp_path, model, chunked, bf16=True, max_steps=1)
        assert trainer.accelerator.mixed_precision == "bf16"
        before = model.lm_head.weight.detach().clone()
        losses.append(trainer.train().training_loss)
        assert not torch.equal(before, model.lm_head.weight)
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
