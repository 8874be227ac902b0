"""The chunked head and the fused kernels under DeepSpeed ZeRO-3 on CPU: two gloo processes partition a tiny
Llama patched with ``chunkloss.models.patch`` (Triton kernels through the interpreter) and run the path the
trainers take (``add_chunked_head``). Every parameter is partitioned (no persistence threshold), so a fused
call that read a weight outside the forward of the module holding it would read an empty partition. The
fused attention input and MLP run inside the forwards of the norm and projections they read, and the loss
inside the head's (``chunkloss.models.hooks``); the loss, the gathered gradients and the parameters after an
SGD step equal one process's on the same global batch. The embeddings are tied, so the head's weight is also
the embedding's, gathered by both modules' hooks (an untied head is the same path with its own weight).

Skipped without the ``deepspeed`` package, and where the Triton kernels compile for a GPU rather than run
through the interpreter (``CUDA_VISIBLE_DEVICES= pytest ...`` runs it on a GPU host too).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import free_port

WORLD = 2
LR = 0.5  # large enough that a wrong gradient moves the parameters visibly
NUM_LAYERS = 2

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET"),
]


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2 * WORLD, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 5:] = -100  # ranks hold different numbers of valid tokens
    return ids, labels


def _model(tied: bool):
    """The tiny Llama, patched for the kernels (attention input and MLP fused) and the chunked head."""
    from chunkloss.data import tiny_model, tiny_tokenizer
    from chunkloss.models import patch
    from chunkloss.trainers._head import add_chunked_head

    torch.manual_seed(0)
    model = tiny_model(
        tiny_tokenizer(), family="llama", hidden_size=32, num_layers=NUM_LAYERS, tie_word_embeddings=tied
    )
    patch(model, loss=False)
    add_chunked_head(model)
    return model


def _count_fused_calls() -> dict:
    """Count the fused calls the patched layers make (a layer that falls back to its modules makes none)."""
    from chunkloss.models import layers

    counts = {"attention_input": 0, "gated_mlp": 0}
    for name in counts:
        kernel = getattr(layers, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            counts[_name] += 1
            return _kernel(*args, **kwargs)

        setattr(layers, name, counted)
    return counts


def _loss(model, ids, labels, num_items, scale=1.0):
    """``ChunkedSFTTrainer.compute_loss``'s step (see test_fsdp_cpu.py)."""
    from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss

    loss_mod = FusedLinearCrossEntropyLoss(chunk_size=5, compile=False)

    def head_fn(hidden, head):
        return loss_mod(
            head.features(hidden[:, :-1]),
            head.weight,
            labels[:, 1:],
            bias=head.bias,
            num_items_in_batch=num_items,
        )

    return model(input_ids=ids, chunked_head=head_fn).result * scale


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed
    import deepspeed.comm.torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    # DeepSpeed's CPU accelerator would compile a shared-memory all-reduce here; gloo's serves.
    deepspeed.comm.torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the reference does not clip
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_model_persistence_threshold": 0,
        },
        "zero_allow_untested_optimizer": True,
    }
    counts = _count_fused_calls()
    try:
        model = _model(tied=True)
        params = dict(model.named_parameters())
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(params.values(), lr=LR), config=config
        )
        up = model.model.layers[0].mlp.up_proj
        partitioned = model.lm_head.weight.numel() == 0 and up.weight.numel() == 0
        ids, labels = _batch(model.config.vocab_size)
        num_items = (labels[:, 1:] != -100).sum()
        local = slice(rank * 2, rank * 2 + 2)
        loss = _loss(engine, ids[local], labels[local], num_items, scale=WORLD)
        fused = dict(counts)
        engine.backward(loss)
        grads = {n: safe_get_full_grad(p).detach().clone() for n, p in params.items()}
        engine.step()
        after = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params.items()}
        total = loss.detach() / WORLD
        dist.all_reduce(total)
        if rank == 0:
            result = dict(partitioned=partitioned, fused=fused, loss=float(total), grads=grads, params=after)
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zero3") / "rank0.pt")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


@pytest.mark.slow  # two spawned processes importing torch, transformers and deepspeed: about 30 s of CPU time
def test_zero3_gloo_kernels_and_tied_head(zero3_results):
    got = zero3_results
    assert got["partitioned"]  # the weights are empty partitions outside the forwards
    assert got["fused"] == {"attention_input": NUM_LAYERS, "gated_mlp": NUM_LAYERS}

    model = _model(tied=True)
    ids, labels = _batch(model.config.vocab_size)
    loss = _loss(model, ids, labels, (labels[:, 1:] != -100).sum())
    loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()

    assert_close_to_ref(got["loss"], float(loss.detach()), name="loss")
    assert sorted(got["grads"]) == sorted(ref_grads)
    for name, p in model.named_parameters():
        assert ref_grads[name].abs().max() > 0, name
        assert_close_to_ref(got["grads"][name], ref_grads[name], name=f"grad {name}")
        assert_close_to_ref(got["params"][name], p.detach(), name=f"{name} after the step")
