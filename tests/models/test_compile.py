"""``torch.compile`` of a patched model: no graph break in the forwards ``chunkloss.models`` installs, and the
kernels compiled with the model.

On CPU the kernels run in the Triton interpreter, which dynamo reaches only through the kernels' custom ops.
One test swaps every kernel for its pure-PyTorch reference (the same arguments), so what is traced is the
integration itself (the per-family forwards, the per-call choice of the fused path, the LoRA read-out), and
compiles it with ``fullgraph=True``. Another compiles the model with the kernels themselves as the first
compilation of a fresh process (``tests/kernels/compiled.py``'s ``in_fresh_process``), full and LoRA, against
the unpatched model, and counts the graphs over four sequence lengths. That crashed torch 2.13's CPU build
(a segfault in a custom op's fake-tensor dispatch), and on CUDA raised ``vector::reserve`` (torch 2.11), while
an op could be defined twice; since every op is defined once (``chunkloss/kernels/_utils.py``,
``tests/kernels/test_custom_ops.py``) both pass. On a GPU the CUDA kernels are compiled, the first compilation
of the test process when it runs first.
"""

import copy

import pytest
import torch

from chunkloss.kernels import glu, lora, rope
from chunkloss.kernels.attention_input import attention_input_ref
from chunkloss.kernels.mlp import gated_mlp_ref
from chunkloss.kernels.rms_norm import rms_norm_ref
from chunkloss.models import layers, patch
from tests.child_process import in_child_process
from tests.kernels.compiled import in_fresh_process
from tests.models.test_lora import lora_model, loss_and_grads
from tests.models.test_patch import VOCAB, tiny_model
from tests.tolerances import assert_close_to_ref


def _references(monkeypatch):
    def rms(x, w, eps, offset, casting, in_place=False):
        return rms_norm_ref(x, w, eps, offset, casting)

    def attention_input(*args, norm_recompute=False, **kwargs):
        return attention_input_ref(*args, **kwargs)

    def gated_mlp(*args, recompute=True, tile=None, **kwargs):  # how much is kept, and in what pieces
        return gated_mlp_ref(*args, **kwargs)

    def rotary(q, k, cos, sin, in_place=False):
        return rope.apply_rotary_pos_emb_ref(q, k, cos, sin)

    monkeypatch.setattr(layers, "rms_norm", rms)
    monkeypatch.setattr(layers, "attention_input", attention_input)
    monkeypatch.setattr(layers, "gated_mlp", gated_mlp)
    monkeypatch.setattr(layers, "apply_rotary_pos_emb", rotary)
    monkeypatch.setattr(layers, "lora_linear", lora.lora_linear_ref)
    monkeypatch.setattr(layers._glu, "_glu", lambda a, b, activation, in_place: glu.glu_ref(a, b, activation))


def _explain(model, input_ids):
    torch._dynamo.reset()
    return torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids).loss)(input_ids)


@pytest.mark.slow  # an inductor compile of each model, about 30 s each on CPU
@pytest.mark.parametrize("model_type,lora_targets", [("qwen3", None), ("gemma2", None), ("llama", "all")])
@in_child_process
def test_patched_forward_has_no_graph_break(model_type, lora_targets, monkeypatch):
    _references(monkeypatch)
    model = lora_model(model_type) if lora_targets else tiny_model(model_type)
    input_ids = torch.randint(0, VOCAB, (2, 7))
    ref = model(input_ids=input_ids, labels=input_ids).loss
    patched = copy.deepcopy(model)
    patch(patched, loss=False)
    torch._dynamo.reset()
    # fullgraph=True: a graph break raises, naming its reason
    compiled = torch.compile(lambda ids: patched(input_ids=ids, labels=ids).loss, fullgraph=True)
    assert_close_to_ref(compiled(input_ids), ref)


def _model(kind: str, checkpointing: bool, device="cpu"):
    """A tiny Llama on ``device``: full, with r=4 LoRA adapters on every projection, those over a 4-bit
    (nf4) base, or full with its projections in torchao's float8 training."""
    if kind == "float8":
        pytest.importorskip("torchao")
        from chunkloss.models import float8_training

        model = tiny_model("llama").to(device)
        float8_training(model)
    elif kind == "qlora":
        from tests.models.test_qlora import qlora_model

        with torch.device(device):  # where bitsandbytes loads it
            model = qlora_model("llama")
    else:
        model = (lora_model("llama") if kind == "lora" else tiny_model("llama")).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model.train()


# an inductor compile of the model with its kernels: 15-45 s each on CPU (QLoRA, checkpointing the longest)
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the test below compiles the CUDA kernels")
@pytest.mark.parametrize(
    "kind,checkpointing",
    [("full", False), ("lora", False), ("lora", True), ("qlora", True), ("float8", False)],
)
@in_fresh_process
def test_patched_model_compiles_with_its_kernels_first_in_a_process(kind, checkpointing):
    """The kernels (the Triton interpreter, through their custom ops) compiled with the model, the first
    compilation of the process: the loss and every gradient of the unpatched eager model, full, LoRA,
    QLoRA and float8 (torchao's layers traced with the kernels around them), with and without
    checkpointing. Then three more sequence lengths: one recompilation, the one that makes the length
    dynamic, and no more. Checkpointing splits the model into several graphs (transformers' output capture
    mutates a context variable inside the checkpoint: a graph break on the unpatched model too), each
    compiled once for the first length and once more with the length dynamic."""
    from torch._dynamo.utils import counters

    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
    model = _model(kind, checkpointing)
    input_ids = torch.randint(0, VOCAB, (2, 16))
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    patch(model, loss=False)
    counters.clear()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss)
    model.zero_grad()
    loss = compiled(input_ids)
    loss.backward()
    first = counters["stats"]["unique_graphs"]
    assert first == 1 or checkpointing, dict(counters["stats"])
    assert_close_to_ref(loss, ref_loss, name="compiled loss")
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close_to_ref(p.grad, ref_grads[n], name=f"compiled {n}")
    for length in (23, 31, 40):
        compiled(torch.randint(0, VOCAB, (2, length))).backward()
    assert counters["stats"]["unique_graphs"] == 2 * first, dict(counters["stats"])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind,checkpointing", [("full", False), ("lora", False), ("lora", True), ("qlora", True)]
)
def test_patched_forward_and_backward_compile_on_gpu(kind, checkpointing):
    """The kernels themselves under torch.compile: no graph break without checkpointing; the loss and
    gradients of the unpatched model, eager and compiled alike."""
    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
    model = _model(kind, checkpointing, "cuda")
    input_ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    ref_loss, ref_grads = loss_and_grads(model, input_ids)
    patch(model, loss=False)
    explained = _explain(model, input_ids)
    assert checkpointing or explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss)
    for mode, run in (("eager", lambda ids: model(input_ids=ids, labels=ids).loss), ("compiled", compiled)):
        model.zero_grad()
        loss = run(input_ids)
        loss.backward()
        assert_close_to_ref(loss, ref_loss, name=f"{mode} loss")
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert_close_to_ref(p.grad, ref_grads[n], name=f"{mode} {n}")
