"""``chunk_kernels=True`` on the chunked trainers: the model's norms, rotary embedding, attention input and
gated MLPs run on chunkloss's Triton kernels (``chunkloss.models.patch(model, loss=False)``) and the step is
unchanged up to rounding: one batch from one state, with and without the option, equal loss and gradients."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch
from chunkloss.models import SUPPORTED_MODEL_TYPES, unpatch_rotary
from chunkloss.models.patch import _rotary_fn
from chunkloss.trainers._common import ChunkedArguments
from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer

from chunkloss.data import tiny_dataset, tiny_model
from tests.models.test_patch import grad_fn_counts
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import assert_same_grads, common_args, model_pair, teacher_model, tokenizer

# fp32: the kernels round in another order than transformers' modules. Measured on CPU under
# TRITON_INTERPRET=1 over these tests: loss differences <= 8.6e-8 relative (SFT's are 0), the DPO
# reference's log-probs <= 1.0e-7, gradient differences <= 6.0e-7 relative to each tensor's largest entry
# (SFT, LoRA, gradient checkpointing, DPO with its reference patched too, ORPO): tests/tolerances.py's fp32
# row leaves a 30x margin; a norm eps 1000x off fails it.

_MODELING = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in SUPPORTED_MODEL_TYPES]
_ORIGINAL = {m.__name__: m.apply_rotary_pos_emb for m in _MODELING}


@pytest.fixture(autouse=True)
def restore_rope(monkeypatch):
    """chunk_kernels replaces each family's module-level apply_rotary_pos_emb; put every one back after each
    test (by monkeypatch, not by the unpatch_rotary under test), so other test files see transformers' own."""
    for m in _MODELING:
        monkeypatch.setattr(m, "apply_rotary_pos_emb", m.apply_rotary_pos_emb)
    assert all(m.apply_rotary_pos_emb is _ORIGINAL[m.__name__] for m in _MODELING)


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
    kernels = {"RMSNormFunctionBackward", "RoPEFunctionBackward", "GLUFunctionBackward",
               "GatedMLPFunctionBackward"}
    assert not kernels & set(nodes), nodes


def _is_patched_norm(module) -> bool:
    fn = getattr(getattr(module.forward, "__func__", None), "func", None)  # patch binds a functools.partial
    # A layer's input norm whose attention runs it (kernels/patch.py, attention=True) is patched too.
    return getattr(fn, "__name__", None) in ("_norm_forward", "_input_norm_forward")


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
    assert sys.modules[type(m_kern).__module__].apply_rotary_pos_emb is _rotary_fn
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
    return [m.forward.__func__.keywords["recompute"] for m in mlps]


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
    with pytest.raises(ValueError, match=f"chunk_kernels_{option}=True without chunk_kernels=True"):
        _sft(tmp_path, model_pair()[0], False, **{f"chunk_kernels_{option}": True})


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


def _dpo(tmp_path, model, ref, kernels: bool):
    return ChunkedDPOTrainer(
        model,
        ref,
        ChunkedDPOConfig(**_args(tmp_path, max_length=48), chunk_size=9, chunk_compile=False,
                         chunk_kernels=kernels),  # fmt: skip
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
            ChunkedORPOConfig(**_args(tmp_path, max_length=48), chunk_size=11, chunk_compile=False,
                              chunk_kernels=kernels),  # fmt: skip
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
def test_teacher_patched_when_supported(tmp_path, kind):
    """A teacher of a supported type gets the kernels too; one of another type keeps its modules (warned)."""
    student, _ = model_pair()
    teacher = teacher_model("llama")
    trainer = _teacher_trainer(kind, tmp_path, student, teacher)
    norms = [m for m in student.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(norms) == QWEN3_NORMS and all(_is_patched_norm(m) for m in norms)
    t_norms = [m for m in trainer.teacher_model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert t_norms and all(_is_patched_norm(m) for m in t_norms)
    assert sys.modules[type(teacher).__module__].apply_rotary_pos_emb is _rotary_fn

    student, _ = model_pair()
    gpt2 = tiny_model(tokenizer(), "gpt2", hidden_size=48, num_layers=1)
    # The root's forward is the chunked head's (GKD), the submodules' are what patch would replace.
    before = {n: m.forward for n, m in gpt2.named_modules() if n and "forward" in vars(m)}
    with pytest.warns(UserWarning, match="teacher_model \\(type 'gpt2'\\) keeps transformers' modules"):
        _teacher_trainer(kind, tmp_path, student, gpt2)
    assert all(_is_patched_norm(m) for m in student.modules() if type(m).__name__ == "Qwen3RMSNorm")
    assert {n: m.forward for n, m in gpt2.named_modules() if n and "forward" in vars(m)} == before


def test_grpo_chunk_kernels_patches_policy(tmp_path):
    from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer

    from chunkloss.data import count_reward

    model, _ = model_pair()
    ChunkedGRPOTrainer(
        model,
        count_reward,
        ChunkedGRPOConfig(**_args(tmp_path, num_generations=2, max_completion_length=4), chunk_compile=False,
                          chunk_kernels=True),  # fmt: skip
        train_dataset=tiny_dataset("grpo", n=4),
        processing_class=tokenizer(),
    )
    assert all(_is_patched_norm(m) for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm")
    mlp = model.model.layers[0].mlp
    assert vars(mlp)["forward"].__func__.func.__name__ == "_mlp_forward"


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
        ChunkedSFTTrainer(model, ChunkedSFTConfig(**args), train_dataset=tiny_dataset("sft", n=4),
                          processing_class=tokenizer())  # fmt: skip
    # Refused before anything was patched.
    assert sys.modules[type(model).__module__].apply_rotary_pos_emb is not _rotary_fn


def test_help_names_every_supported_type():
    help_text = ChunkedArguments.__dataclass_fields__["chunk_kernels"].metadata["help"]
    assert all(t in help_text for t in SUPPORTED_MODEL_TYPES)
    assert ChunkedArguments.__dataclass_fields__["chunk_kernels"].default is False


def test_unpatch_rotary_restores_transformers_function(tmp_path):
    from chunkloss.models import patch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton takes CPU tensors only when interpreted
    llama = tiny_model(tokenizer(), "llama", hidden_size=32, num_layers=1).to(device)
    qwen3, _ = model_pair()
    llama_mod, qwen3_mod = sys.modules[type(llama).__module__], sys.modules[type(qwen3).__module__]
    original = llama_mod.apply_rotary_pos_emb
    assert unpatch_rotary(llama) == []  # nothing patched yet: nothing to restore
    patch(llama, loss=False)
    patch(llama, loss=False)  # twice: the original must not be forgotten
    patch(qwen3, loss=False)
    assert llama_mod.apply_rotary_pos_emb is _rotary_fn and qwen3_mod.apply_rotary_pos_emb is _rotary_fn
    ids = torch.randint(0, len(tokenizer()), (1, 5), device=device)
    counts = grad_fn_counts(llama(input_ids=ids, labels=ids).loss)
    assert "AttentionInputFunctionBackward" in counts  # the layer's norm, q/k/v and Triton rotary in one node
    assert unpatch_rotary(llama) == [llama_mod.__name__]
    assert llama_mod.apply_rotary_pos_emb is original
    assert qwen3_mod.apply_rotary_pos_emb is _rotary_fn  # only the given model's family
    assert unpatch_rotary() == [qwen3_mod.__name__]  # None: every family still patched
    assert qwen3_mod.apply_rotary_pos_emb is _ORIGINAL[qwen3_mod.__name__]
    # The restored function is transformers' own again: the model's forward builds no Triton rotary node.
    counts = grad_fn_counts(llama(input_ids=ids, labels=ids).loss)
    assert "RoPEFunctionBackward" not in counts and "AttentionInputFunctionBackward" not in counts


def test_liger_kernels_with_chunk_kernels_refused(tmp_path):
    """use_liger_kernel patches the same norms, rotary embedding and MLPs: the two together are refused before
    anything is patched."""
    model, _ = model_pair()
    args = dict(common_args(tmp_path, max_length=64), chunk_size=7, chunk_compile=False, chunk_kernels=True)
    with pytest.raises(ValueError, match="chunk_kernels=True with use_liger_kernel=True"):
        ChunkedSFTTrainer(model, ChunkedSFTConfig(**args, use_liger_kernel=True),
                          train_dataset=tiny_dataset("sft", n=4), processing_class=tokenizer())  # fmt: skip
    assert sys.modules[type(model).__module__].apply_rotary_pos_emb is not _rotary_fn
