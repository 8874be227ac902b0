"""Shared pieces of the trainer parity tests: tiny models, one batch through TRL's trainer and ours."""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from chunkloss.data import tiny_dataset, tiny_model, tiny_tokenizer
from tests.tolerances import assert_close_to_ref

# A tiny Qwen3-MoE: every layer sparse, 4 experts, top-2.
MOE = dict(
    family="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = tiny_tokenizer()
    return _TOKENIZER


def model_pair(family: str = "qwen3", seed: int = 0, **overrides):
    """Two identical tiny random models (TRL's trainer gets one, ours the other)."""
    torch.manual_seed(seed)
    tie = overrides.pop("tie_word_embeddings", False)
    m = tiny_model(tokenizer(), family, hidden_size=32, num_layers=1, **overrides)
    if tie:  # chunkloss.data.tiny_model fixes tie_word_embeddings=False; tie by hand
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
    return m, copy.deepcopy(m)


def teacher_model(family: str = "qwen3", hidden_size: int = 48, seed: int = 1, **overrides):
    """A tiny random teacher, wider than the student (only the vocabulary must match)."""
    torch.manual_seed(seed)
    return tiny_model(tokenizer(), family, hidden_size=hidden_size, num_layers=1, **overrides)


def common_args(tmp_path, **kw):
    return dict(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        **kw,
    )


def grads(model) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def assert_same_grads(ref_model, our_model):
    """Every trainable parameter's gradient: ours against TRL's, both fp32 (tests/tolerances.py's fp32 row;
    the chunked loss sums the same terms in another order, measured ≤ 1e-6 relative to the largest entry)."""
    g_ref, g_our = grads(ref_model), grads(our_model)
    names = trainable(ref_model)
    assert names == trainable(our_model)
    missing = [n for n in names if n not in g_ref]
    assert not missing, f"TRL left no gradient on {missing}"
    assert sorted(g_ref) == sorted(g_our), (
        f"gradients on {sorted(set(g_ref) ^ set(g_our))} differ in presence"
    )
    for n in names:
        assert_close_to_ref(g_our[n], g_ref[n], name=f"grad {n}")


def stored_metrics(trainer, store: str = "_metrics") -> dict:
    """The training metrics a trainer stored (TRL's ``_metrics["train"]``, or ORPO's ``_stored_metrics``), as
    its ``log`` reads them: the chunked trainers keep them on the device until then
    (``DeferredMetrics.fetch_deferred_metrics``)."""
    fetch = getattr(trainer, "fetch_deferred_metrics", None)
    if fetch is not None:
        fetch()
    return getattr(trainer, store)["train"]


def logged_metrics(trainer) -> dict:
    """What the trainer logs for its steps so far: ``log`` averages the metrics ``compute_loss`` stored, as a
    logging step in training does, and clears them."""
    trainer.log({})
    return {k: v for k, v in trainer.state.log_history[-1].items() if k not in ("step", "epoch")}


def assert_close_loss(ours, ref):
    """Our loss against TRL's (measured ≤ 2e-7 relative; tests/tolerances.py's fp32 row)."""
    assert_close_to_ref(ours.detach().float(), ref.detach().float(), name="loss")


def check_step(ref, ours, batch, store: str = "_metrics"):
    """TRL's trainer and ours on ``batch``: equal loss, gradients and stored metrics (``store``: TRL's
    ``_metrics``, or ORPO's ``_stored_metrics``); returns TRL's loss, ours and our metrics."""
    losses = []
    for tr in (ref, ours):
        tr.model.train()
        getattr(tr, store)["train"].clear()
        loss = tr.compute_loss(tr.model, dict(batch))
        loss.backward()
        losses.append(loss)
    assert_close_loss(losses[1], losses[0])
    assert_same_grads(ref.model, ours.model)
    m_ref, m_our = stored_metrics(ref, store), stored_metrics(ours, store)
    assert sorted(m_ref) == sorted(m_our)
    for key in m_ref:
        assert m_our[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
    return losses[0], losses[1], m_our


def check_orpo_step(ref, ours):
    """TRL's ORPOTrainer and ours on one batch (:func:`check_step`); returns the batch and the two losses
    (TRL's first)."""
    batch = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))
    l_ref, l_our, _ = check_step(ref, ours, batch, "_stored_metrics")
    return batch, [l_ref, l_our]


def reference_pair(
    kind: str,
    trl_classes: tuple[type, type],
    our_classes: tuple[type, type],
    tmp_path,
    compile_=False,
    with_ref=True,
    models=None,
    peft_config=None,
    ref_models=None,
    **cfg,
):
    """TRL's trainer and ours (``(Config, Trainer)`` each) for a loss with a reference model (DPO, KTO): the
    same tiny policy, reference (seed 1, or none) and ``tiny_dataset(kind)``, chunks of 9 rows."""
    ref_m, our_m = models or model_pair()
    torch.manual_seed(1)
    refs = (ref_models or model_pair(seed=1)) if with_ref else (None, None)
    ds = tiny_dataset(kind, n=8)
    base = common_args(tmp_path, max_length=48, **cfg)
    built = []
    for (config, trainer), model, ref, extra in (
        (trl_classes, ref_m, refs[0], {}),
        (our_classes, our_m, refs[1], dict(chunk_size=9, chunk_compile=compile_)),
    ):
        built.append(
            trainer(
                model,
                ref,
                config(**base, **extra),
                train_dataset=ds,
                processing_class=tokenizer(),
                peft_config=copy.deepcopy(peft_config),
            )
        )
    return tuple(built)


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
