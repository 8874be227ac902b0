"""``chunk_kernels`` on the chunked trainers: with the kernels the model's norms, rotary embedding, attention
input and gated MLPs run on chunkloss's Triton kernels (``chunkloss.models.patch(model, loss=False)``) and
the step is unchanged up to rounding: one batch from one state, with and without them, equal loss and
gradients. ``None`` (the default) turns them on only where they can run, and says so in one log line."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from chunkloss.data import tiny_dataset, tiny_model
from chunkloss.models import SUPPORTED_MODEL_TYPES
from chunkloss.models.layers import PatchedGatedMLP, PatchedRMSNorm
from chunkloss.trainers._arguments import ChunkedArguments
from chunkloss.trainers._common import peft_base
from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.child_process import in_child_process
from tests.models.test_patch import grad_fn_counts
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import assert_same_grads, common_args, model_pair, teacher_model, tokenizer

# fp32: the kernels round in another order than transformers' modules. Measured on CPU under
# TRITON_INTERPRET=1 over these tests: loss differences <= 8.6e-8 relative (SFT's are 0), the DPO
# reference's log-probs <= 1.0e-7, gradient differences <= 6.0e-7 relative to each tensor's largest entry
# (SFT, LoRA, gradient checkpointing, DPO with its reference patched too, ORPO): tests/tolerances.py's fp32
# row leaves a 30x margin; a norm eps 1000x off fails it.


def _args(tmp_path, **kw):
    args = common_args(tmp_path, **kw)
    args["use_cpu"] = not torch.cuda.is_available()  # the kernels need CUDA tensors there (no interpreter)
    return args


def _assert_kernels_ran(loss, n_norms: int, n_layers: int = 1):
    nodes = grad_fn_counts(loss)
    assert nodes.get("RMSNormFunctionBackward") == n_norms, nodes
    assert nodes.get("RoPEFunctionBackward") == n_layers, nodes
    # The fused MLP, or only its gating where a projection is a LoRA layer.
    assert nodes.get("GatedMLPFunctionBackward", 0) + nodes.get("GLUFunctionBackward", 0) == n_layers, nodes


def _assert_no_kernels(loss):
    nodes = grad_fn_counts(loss)
    kernels = {
        "RMSNormFunctionBackward",
        "RoPEFunctionBackward",
        "GLUFunctionBackward",
        "GatedMLPFunctionBackward",
    }
    assert not kernels & set(nodes), nodes


def _is_patched_norm(module) -> bool:
    return isinstance(module, PatchedRMSNorm)


def _untouched(model) -> bool:
    """No module of ``model`` has a class patch gave it."""
    return all("_chunkloss_base" not in vars(type(m)) for m in model.modules())


# Qwen3 (the helpers' default family): input, post-attention, q and k norms per layer, and the final norm.
QWEN3_NORMS = 5


def _step(trainer, batch):
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss


def _compare(plain, build_kernels, batch, n_norms=QWEN3_NORMS):
    """The plain trainer's step runs before the kernels trainer is built: building it patches the rotary
    embedding for the whole process."""
    l_plain = _step(plain, batch)
    _assert_no_kernels(l_plain)
    kernels = build_kernels()
    l_kern = _step(kernels, batch)
    _assert_kernels_ran(l_kern, n_norms)
    assert_close_to_ref(l_kern.detach(), l_plain.detach())
    assert_same_grads(plain.model, kernels.model)
    return l_kern


def _sft(tmp_path, model, kernels: bool, **cfg):
    args = _args(tmp_path, max_length=64, **cfg)
    return ChunkedSFTTrainer(
        model,
        ChunkedSFTConfig(**args, chunk_size=7, chunk_compile=False, chunk_kernels=kernels),
        train_dataset=tiny_dataset("sft", n=4),
        processing_class=tokenizer(),
    )


def _sft_batch(trainer):
    return trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))


def test_sft_chunk_kernels_same_step(tmp_path):
    m_plain, m_kern = model_pair()
    plain = _sft(tmp_path, m_plain, False)
    batch = _sft_batch(plain)
    assert not any(_is_patched_norm(m) for m in m_plain.modules() if type(m).__name__ == "Qwen3RMSNorm")
    l_plain = _step(plain, batch)
    kern = _sft(tmp_path, m_kern, True)
    norms = [m for m in m_kern.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(norms) == QWEN3_NORMS and all(_is_patched_norm(m) for m in norms)
    l_kern = _step(kern, batch)
    _assert_no_kernels(l_plain)
    _assert_kernels_ran(l_kern, QWEN3_NORMS)
    assert_close_to_ref(l_kern.detach(), l_plain.detach())
    assert_same_grads(plain.model, kern.model)
    # The loss is still the trainer's chunked one: patch(loss=False) left the causal-LM forward alone.
    assert "_chunkloss_ce" not in vars(m_kern)


@pytest.mark.parametrize("reentrant", [False, True])
def test_sft_chunk_kernels_gradient_checkpointing(tmp_path, reentrant):
    """Checkpointing recomputes each layer's forward in the backward: the in-place rotary embedding and the
    MLP/norm backwards that overwrite their buffers act on the recomputed tensors, as in a plain step."""
    m_plain, m_kern = model_pair()
    plain = _sft(tmp_path, m_plain, False)
    batch = _sft_batch(plain)
    l_plain = _step(plain, batch)
    kern = _sft(tmp_path, m_kern, True)
    # Trainer.train() turns checkpointing on from the config; this test calls compute_loss directly.
    kwargs = {"use_reentrant": reentrant}
    if hasattr(m_kern, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        m_kern.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        m_kern.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    l_kern = _step(kern, batch)
    nodes = grad_fn_counts(l_kern)
    if reentrant:  # the layer is one CheckpointFunction node; its kernels run inside that node's backward
        assert "CheckpointFunctionBackward" in nodes, nodes
    else:  # the recomputed graph is the same; the nodes are there, their saved tensors recomputed
        _assert_kernels_ran(l_kern, QWEN3_NORMS)
    assert_close_to_ref(l_kern.detach(), l_plain.detach())
    assert_same_grads(plain.model, kern.model)


def _mlp_recompute_flags(model) -> list[bool]:
    """Each patched MLP's ``recompute`` (patch binds its forward as a functools.partial)."""
    mlps = [m for m in model.modules() if type(m).__name__ == "Qwen3MLP"]
    return [m.chunkloss_mlp.recompute for m in mlps]


@pytest.mark.parametrize("recompute", [False, True])
def test_sft_chunk_kernels_mlp_recompute_option(tmp_path, recompute):
    """chunk_kernels_mlp_recompute reaches every patched MLP; either way the step is the plain one."""
    m_plain, m_kern = model_pair()
    plain = _sft(tmp_path, m_plain, False)
    build = lambda: _sft(tmp_path, m_kern, True, chunk_kernels_mlp_recompute=recompute)  # noqa: E731
    _compare(plain, build, _sft_batch(plain))
    assert _mlp_recompute_flags(m_kern) == [recompute]


def test_sft_chunk_kernels_norm_recompute_option(tmp_path, monkeypatch):
    """chunk_kernels_norm_recompute: the backward runs each layer's two pre-norms again instead of keeping
    their outputs; the step is the plain one."""
    from chunkloss.models import saved_norms

    runs = []
    get = saved_norms._Recipe.get
    monkeypatch.setattr(saved_norms._Recipe, "get", lambda r: runs.append(r.value is None) or get(r))
    m_plain, m_kern = model_pair()
    plain = _sft(tmp_path, m_plain, False, gradient_checkpointing=False)
    build = lambda: _sft(  # noqa: E731
        tmp_path, m_kern, True, chunk_kernels_norm_recompute=True, gradient_checkpointing=False
    )
    _compare(plain, build, _sft_batch(plain))
    layers = [m for m in m_kern.modules() if type(m).__name__ == "Qwen3DecoderLayer"]
    assert sum(runs) == 2 * len(layers)  # the input and post-attention norms ran again, once each


@pytest.mark.parametrize("option", ["mlp_recompute", "norm_recompute"])
def test_recompute_without_chunk_kernels_refused(tmp_path, option):
    with pytest.raises(ValueError, match=f"chunk_kernels_{option}=True with chunk_kernels=False"):
        _sft(tmp_path, model_pair()[0], False, **{f"chunk_kernels_{option}": True})


def test_norm_recompute_with_torch_compile_refused(tmp_path):
    with pytest.raises(ValueError, match="chunk_kernels_norm_recompute=True with torch_compile=True"):
        _sft(tmp_path, model_pair()[0], True, chunk_kernels_norm_recompute=True, torch_compile=True)


def test_long_context_with_torch_compile_refused(tmp_path):
    with pytest.raises(ValueError, match="chunk_long_context=True with torch_compile=True"):
        _sft(tmp_path, model_pair()[0], None, chunk_long_context=True, torch_compile=True)


def _trained(tmp_path, model, compiled: str | None, monkeypatch):
    cfg = dict(torch_compile=compiled is not None, chunk_compile_layers=compiled == "layers")
    trainer = _sft(tmp_path, model, True, max_steps=3, optim="sgd", learning_rate=0.5, **cfg)
    # accelerate turns TF32 on for an fp32 run it compiles (on CUDA, process-wide): off, for the comparison
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    trainer.train()
    # accelerate's wrapper of a model it compiled whole, or the layers compiled in place
    assert hasattr(trainer.model_wrapped, "_orig_mod") == (compiled == "whole")
    layers = peft_base(trainer.model).get_decoder().layers
    assert all(layer._compiled_call_impl is not None for layer in layers) == (compiled == "layers")
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=[pytest.mark.slow, in_child_process]),  # about 60 s: three trainings
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_torch_compile_keeps_the_kernels_and_trains_as_eager(tmp_path, device, monkeypatch):
    """``torch_compile=True`` compiles the patched model's decoder layers (the default) or the model whole
    (``chunk_compile_layers=False``), the kernels through their custom ops and the chunked head never traced:
    three SGD steps give the eager run's losses and parameters. The two layers share one graph (nothing in
    the patched forwards guards on a layer's own modules), and two new sequence lengths add one graph, whose
    length is dynamic, and no more."""
    from torch._dynamo.utils import counters

    if device == "cpu" and torch.cuda.is_available():  # (the cuda case is skipped without CUDA by its mark)
        # tests/conftest.py sets TRITON_INTERPRET only without CUDA: here the kernels compile for the GPU.
        pytest.skip(
            "on a CUDA host the kernels take CUDA tensors only (no Triton interpreter); the cuda case runs"
        )
    torch.manual_seed(0)
    model = tiny_model(tokenizer(), "qwen3", hidden_size=32, num_layers=2)
    models = (model, copy.deepcopy(model), copy.deepcopy(model))
    eager = _trained(tmp_path / "eager", models[0], None, monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    layers = _trained(tmp_path / "layers", models[1], "layers", monkeypatch)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for length in (23, 31):
        ids = torch.randint(0, model.config.vocab_size, (2, length), device=models[1].device)
        models[1](input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    models[1].zero_grad()
    whole = _trained(tmp_path / "whole", models[2], "whole", monkeypatch)
    for name, (losses, model) in {"layers": (layers, models[1]), "whole": (whole, models[2])}.items():
        assert any(_is_patched_norm(m) for m in model.modules())
        assert_close_to_ref(torch.tensor(losses), torch.tensor(eager), name=f"{name} losses")
        for (n, a), b in zip(model.named_parameters(), models[0].parameters(), strict=True):
            assert_close_to_ref(a, b, name=f"{name} {n}")


def test_sft_chunk_kernels_peft(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj"])
    m_plain = peft.get_peft_model(model_pair()[0], config)
    with torch.no_grad():
        for name, p in m_plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # zero-initialised B would make the adapters invisible
    m_kern = copy.deepcopy(m_plain)
    plain = _sft(tmp_path, m_plain, False)
    batch = _sft_batch(plain)
    _compare(plain, lambda: _sft(tmp_path, m_kern, True), batch)


# family -> the fused Functions a LoRA step on all seven projections runs once per layer: Llama's q/k/v in
# attention_input, o_proj in lora_linear; Qwen3's q/k/v (their q/k norms between projection and RoPE) and
# o_proj in lora_linear.
LORA_NODES = {
    "llama": {"AttentionInputFunctionBackward": 1, "LoraLinearFunctionBackward": 1,
              "GatedMLPFunctionBackward": 1},
    "qwen3": {"LoraLinearFunctionBackward": 4, "GatedMLPFunctionBackward": 1},
}  # fmt: skip


@pytest.mark.parametrize("family", list(LORA_NODES))
def test_sft_chunk_kernels_peft_rank_above_the_smaller_side(tmp_path, family):
    """PEFT accepts a LoRA rank above a projection's smaller side: r = 16 on k/v (8 x 32), gate/up (12 x 32)
    and down (32 x 12), beside q and o (32 x 32) below it. The kernels take every projection; the step is the
    one without them."""
    peft = pytest.importorskip("peft")
    model = model_pair(family, num_key_value_heads=1, intermediate_size=12)[0]
    m_plain = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in m_plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # zero-initialised B would make the adapters invisible
    sides = [
        min(m.base_layer.weight.shape)
        for m in m_plain.modules()
        if type(m).__name__ == "Linear" and hasattr(m, "lora_A")
    ]
    assert len(sides) == 7 and sorted(sides) == [8, 8, 12, 12, 12, 32, 32], sides
    m_kern = copy.deepcopy(m_plain)
    plain = _sft(tmp_path, m_plain, False)
    batch = _sft_batch(plain)
    l_plain = _step(plain, batch)
    _assert_no_kernels(l_plain)
    l_kern = _step(_sft(tmp_path, m_kern, True), batch)
    nodes = grad_fn_counts(l_kern)
    assert {k: nodes.get(k, 0) for k in LORA_NODES[family]} == LORA_NODES[family], nodes
    assert_close_to_ref(l_kern.detach(), l_plain.detach())
    assert_same_grads(m_plain, m_kern)


def _dpo(tmp_path, model, ref, kernels: bool):
    return ChunkedDPOTrainer(
        model,
        ref,
        ChunkedDPOConfig(
            **_args(tmp_path, max_length=48), chunk_size=9, chunk_compile=False, chunk_kernels=kernels
        ),
        train_dataset=tiny_dataset("dpo", n=4),
        processing_class=tokenizer(),
    )


def test_dpo_chunk_kernels_same_step(tmp_path):
    """The reference model is patched too; its log-probs enter the loss, so a wrong reference shows there."""
    (m_plain, m_kern), (r_plain, r_kern) = model_pair(), model_pair(seed=1)
    plain = _dpo(tmp_path, m_plain, r_plain, False)
    batch = plain._prepare_inputs(plain.data_collator([plain.train_dataset[i] for i in range(4)]))
    l_plain = _step(plain, batch)
    _assert_no_kernels(l_plain)
    kern = _dpo(tmp_path, m_kern, r_kern, True)
    assert all(_is_patched_norm(m) for m in kern.ref_model.modules() if type(m).__name__ == "Qwen3RMSNorm")
    with torch.enable_grad():  # the reference's log-probs through the patched modules, seen in its graph
        ref_logps = kern.compute_ref_log_probs(kern.ref_model, dict(batch))
    l_kern = _step(kern, batch)
    _assert_kernels_ran(l_kern, QWEN3_NORMS)
    plain_ref_logps = plain.compute_ref_log_probs(plain.ref_model, dict(batch))
    for ours, theirs in zip(ref_logps, plain_ref_logps, strict=True):
        assert_close_to_ref(ours, theirs)
    assert_close_to_ref(l_kern.detach(), l_plain.detach())
    assert_same_grads(plain.model, kern.model)


def test_orpo_chunk_kernels_same_step(tmp_path):
    def orpo(model, kernels):
        return ChunkedORPOTrainer(
            model,
            ChunkedORPOConfig(
                **_args(tmp_path, max_length=48), chunk_size=11, chunk_compile=False, chunk_kernels=kernels
            ),
            train_dataset=tiny_dataset("orpo", n=4),
            processing_class=tokenizer(),
        )

    m_plain, m_kern = model_pair()
    plain = orpo(m_plain, False)
    batch = plain._prepare_inputs(plain.data_collator([plain.train_dataset[i] for i in range(4)]))
    _compare(plain, lambda: orpo(m_kern, True), batch)


def _teacher_trainer(kind, tmp_path, model, teacher):
    if kind == "gkd":
        from chunkloss.trainers.gkd import ChunkedGKDConfig as Config
        from chunkloss.trainers.gkd import ChunkedGKDTrainer as Trainer
    else:
        from chunkloss.trainers.distillation import ChunkedDistillationConfig as Config
        from chunkloss.trainers.distillation import ChunkedDistillationTrainer as Trainer
    length = {"max_new_tokens": 6} if kind == "gkd" else {"max_completion_length": 6}
    args = Config(**_args(tmp_path, **length), chunk_compile=False, chunk_kernels=True)
    return Trainer(model, teacher, args, train_dataset=tiny_dataset(kind, n=4), processing_class=tokenizer())


@pytest.mark.parametrize("kind", ["gkd", "distillation"])
def test_teacher_patched_when_supported(tmp_path, kind, caplog):
    """A teacher of a supported type gets the kernels too; one of another type keeps its modules (warned)."""
    student, _ = model_pair()
    teacher = teacher_model("llama")
    trainer = _teacher_trainer(kind, tmp_path, student, teacher)
    norms = [m for m in student.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(norms) == QWEN3_NORMS and all(_is_patched_norm(m) for m in norms)
    t_norms = [m for m in trainer.teacher_model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert t_norms and all(_is_patched_norm(m) for m in t_norms)

    student, _ = model_pair()
    gpt2 = tiny_model(tokenizer(), "gpt2", hidden_size=48, num_layers=1)
    with caplog.at_level(logging.INFO, logger="chunkloss.trainers"):
        _teacher_trainer(kind, tmp_path, student, gpt2)
    lines = [r.getMessage() for r in caplog.records if r.name == "chunkloss.trainers"]
    expected = "teacher_model (type 'gpt2') on model type 'gpt2' keeps transformers' modules"
    assert len(lines) == 1 and expected in lines[0], lines
    assert all(_is_patched_norm(m) for m in student.modules() if type(m).__name__ == "Qwen3RMSNorm")
    assert _untouched(gpt2)


def test_grpo_chunk_kernels_patches_policy(tmp_path):
    from chunkloss.data import count_reward
    from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer

    model, _ = model_pair()
    ChunkedGRPOTrainer(
        model,
        count_reward,
        ChunkedGRPOConfig(
            **_args(tmp_path, num_generations=2, max_completion_length=4),
            chunk_compile=False,
            chunk_kernels=True,
        ),
        train_dataset=tiny_dataset("grpo", n=4),
        processing_class=tokenizer(),
    )
    assert all(_is_patched_norm(m) for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm")
    assert isinstance(model.model.layers[0].mlp, PatchedGatedMLP)


def test_unsupported_model_type_refused(tmp_path):
    model = tiny_model(tokenizer(), "gpt2", hidden_size=32, num_layers=1)
    with pytest.raises(ValueError, match="chunk_kernels=True on model type 'gpt2'") as err:
        _sft(tmp_path, model, True)
    assert all(t in str(err.value) for t in SUPPORTED_MODEL_TYPES)
    _sft(tmp_path, tiny_model(tokenizer(), "gpt2", hidden_size=32, num_layers=1), False)  # off: accepted


def test_cpu_without_interpreter_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, _ = model_pair()
    args = dict(common_args(tmp_path, max_length=64), chunk_size=7, chunk_compile=False, chunk_kernels=True)
    with pytest.raises(ValueError, match=r"chunk_kernels=True with parameters on \['cpu'\]"):
        ChunkedSFTTrainer(
            model,
            ChunkedSFTConfig(**args),
            train_dataset=tiny_dataset("sft", n=4),
            processing_class=tokenizer(),
        )
    assert _untouched(model)  # refused before anything was patched


def test_help_names_every_supported_type():
    help_text = ChunkedArguments.__dataclass_fields__["chunk_kernels"].metadata["help"]
    assert all(t in help_text for t in SUPPORTED_MODEL_TYPES)
    assert ChunkedArguments.__dataclass_fields__["chunk_kernels"].default is None


def test_liger_kernels_with_chunk_kernels_refused(tmp_path):
    """use_liger_kernel patches the same norms, rotary embedding and MLPs: the two together are refused before
    anything is patched."""
    model, _ = model_pair()
    args = dict(common_args(tmp_path, max_length=64), chunk_size=7, chunk_compile=False, chunk_kernels=True)
    with pytest.raises(ValueError, match="chunk_kernels=True with use_liger_kernel=True"):
        ChunkedSFTTrainer(
            model,
            ChunkedSFTConfig(**args, use_liger_kernel=True),
            train_dataset=tiny_dataset("sft", n=4),
            processing_class=tokenizer(),
        )
    assert _untouched(model)


def _auto_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "chunkloss.trainers"]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("interpret", [False, True])
def test_default_on_cpu_is_off_with_one_log_line(tmp_path, monkeypatch, caplog, interpret):
    """chunk_kernels=None on a CPU model: transformers' modules, and one line saying so (the interpreter,
    which chunk_kernels=True accepts for tests, does not turn the default on)."""
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, _ = model_pair()
    args = dict(common_args(tmp_path, max_length=64), chunk_size=7, chunk_compile=False)
    with caplog.at_level(logging.INFO, logger="chunkloss.trainers"):
        ChunkedSFTTrainer(
            model,
            ChunkedSFTConfig(**args),
            train_dataset=tiny_dataset("sft", n=4),
            processing_class=tokenizer(),
        )
    assert "chunk_kernels off" in _auto_line(caplog) and "['cpu']" in _auto_line(caplog)
    assert _untouched(model)


@pytest.mark.parametrize("case", ["gpt2", "liger"])
def test_default_falls_back_where_true_is_refused(tmp_path, caplog, case):
    """Another family, or Liger's kernels: refused with chunk_kernels=True (tests above), off with one log
    line naming why with the default."""
    if case == "gpt2":
        model, extra = tiny_model(tokenizer(), "gpt2", hidden_size=32, num_layers=1), {}
    else:
        model, extra = model_pair()[0], {"use_liger_kernel": True}
    args = dict(_args(tmp_path, max_length=64), chunk_size=7, chunk_compile=False, **extra)
    with caplog.at_level(logging.INFO, logger="chunkloss.trainers"):
        ChunkedSFTTrainer(
            model,
            ChunkedSFTConfig(**args),
            train_dataset=tiny_dataset("sft", n=4),
            processing_class=tokenizer(),
        )
    assert ("model type 'gpt2'" if case == "gpt2" else "use_liger_kernel=True") in _auto_line(caplog)
    assert _untouched(model)


@pytest.mark.gpu
def test_default_on_cuda_runs_the_kernels(tmp_path, caplog):
    m_plain, m_kern = model_pair()
    plain = _sft(tmp_path, m_plain.cuda(), False)
    batch = _sft_batch(plain)
    with caplog.at_level(logging.INFO, logger="chunkloss.trainers"):
        build = lambda: _sft(tmp_path, m_kern.cuda(), None)  # noqa: E731
        _compare(plain, build, batch)
    assert "chunk_kernels on" in _auto_line(caplog)
