"""The chunked head under FSDP2 on CPU: two gloo processes shard a tiny model with ``fully_shard`` and run
the path the trainers take (``add_chunked_head``: the loss inside the model's forward, a ``DTensor`` head
weight gathered with ``full_tensor()``); the gathered gradients equal one process's on the same global batch.

Two layouts: accelerate 1.15's (``fsdp2_prepare_model``: decoder layers, the input embedding, then
``[final_norm, lm_head]`` in one unit that the final norm's forward unshards, so the head weight is a plain
tensor inside the forward), and ``lm_head`` in a unit of its own that nothing unshards (its weight reaches the
chunked head as a sharded ``DTensor``: the ``full_tensor()`` path).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from chunkloss.trainers._head import add_chunked_head

from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from tests.tolerances import assert_close_to_ref

WORLD = 2
# accelerate: the head weight is unsharded by the [norm, lm_head] unit; head_alone: the full_tensor() path.
LAYOUTS = ("accelerate", "head_alone")
# fp32 on CPU: FSDP's reduce-scatter sums two halves in another order than one process's backward; the
# measured largest relative difference (to each tensor's largest entry) is ~1e-7 (tests/tolerances.py).


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2 * WORLD, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt, as completion-only SFT masks it
    labels[1, 5:] = -100  # ranks hold different numbers of valid tokens
    return ids, labels


def _model():
    from chunkloss.data import tiny_model, tiny_tokenizer

    torch.manual_seed(0)
    # Odd sizes: vocab 39 does not split evenly over two ranks (FSDP pads the last shard).
    return tiny_model(tiny_tokenizer(), hidden_size=32, num_layers=2)


def _loss(model, ids, labels, num_items, scale=1.0):
    """The step of ``ChunkedSFTTrainer.compute_loss``: the loss inside the forward, normalised by the global
    count of valid tokens and multiplied by the world size (FSDP averages gradients over ranks)."""
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


def _shard(model, layout: str) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if layout == "accelerate":
        fully_shard(model.model.embed_tokens)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    else:
        fully_shard(model.lm_head)
    fully_shard(model)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    try:
        for layout in LAYOUTS:  # one spawn for both layouts: process start-up and imports dominate the time
            model = _model()
            add_chunked_head(model)
            _shard(model, layout)
            head_type = type(model.lm_head.weight).__name__
            ids, labels = _batch(model.config.vocab_size)
            num_items = (labels[:, 1:] != -100).sum()
            local = slice(rank * 2, rank * 2 + 2)
            loss = _loss(model, ids[local], labels[local], num_items, scale=WORLD)
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad
                grads[name] = (g.full_tensor() if type(g).__name__ == "DTensor" else g).detach().clone()
            total = loss.detach() / WORLD
            dist.all_reduce(total)
            results[layout] = (head_type, float(total), grads)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp") / "rank0.pt")
    mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


def single_process_reference():
    """The model with the chunked head after one backward on the whole batch in this process, and its loss."""
    model = _model()
    add_chunked_head(model)
    ids, labels = _batch(model.config.vocab_size)
    loss = _loss(model, ids, labels, (labels[:, 1:] != -100).sum())
    loss.backward()
    return model, loss


@pytest.mark.slow  # two spawned processes importing torch and transformers: about 26 s of CPU time
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_gloo_grads_equal_single_process(layout, sharded_results):
    head_type, loss, grads = sharded_results[layout]
    assert head_type == "DTensor"  # sharded outside the forward in both layouts

    model, ref_loss = single_process_reference()
    assert_close_to_ref(loss, float(ref_loss.detach()), name="loss")
    names = [n for n, _ in model.named_parameters()]
    assert sorted(grads) == sorted(names)
    for name, p in model.named_parameters():
        assert p.grad.abs().max() > 0, name
        assert_close_to_ref(grads[name], p.grad, name=f"grad {name}")
