"""Float8 training under FSDP2 on CPU: two gloo processes shard a tiny model converted by
``chunkloss.models.float8_training(..., fsdp_float8_all_gather=True)`` with ``fully_shard`` (a unit per
decoder layer, then the root) and run one backward on their halves of a batch; the loss and the gathered
gradients equal one process's on the whole batch, the weights having crossed the all-gather as float8 bytes
with one scale over each whole weight (torchao's ``WeightWithDynamicFloat8CastTensor``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkloss.data import tiny_model, tiny_tokenizer
from chunkloss.models import float8_training
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import free_port

pytest.importorskip("torchao")

WORLD = 2


def _model(**float8):
    torch.manual_seed(0)
    model = tiny_model(tiny_tokenizer(), hidden_size=32, num_layers=2)
    assert float8_training(model, **float8) == 14
    return model


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2 * WORLD, 9), generator=torch.Generator().manual_seed(1))


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp import fully_shard

        model = _model(fsdp_float8_all_gather=True)
        weight = type(model.model.layers[0].mlp.up_proj.weight).__name__
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        ids = _batch(model.config.vocab_size)[rank * 2 : rank * 2 + 2]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # FSDP2 averages the ranks' gradients
        grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}
        total = loss.detach() / WORLD
        dist.all_reduce(total)
        if rank == 0:
            torch.save(dict(weight=weight, loss=float(total), grads=grads), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch, transformers and torchao
def test_float8_all_gathers_under_fsdp2_give_one_process_gradients(tmp_path):
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD, start_method="spawn")
    got = torch.load(out)
    assert got["weight"] == "WeightWithDynamicFloat8CastTensor"
    model = _model()
    ids = _batch(model.config.vocab_size)
    losses = []
    for half in (ids[:2], ids[2:]):  # each rank's mean loss, averaged as FSDP averages the gradients
        loss = model(input_ids=half, labels=half).loss / WORLD
        loss.backward()
        losses.append(float(loss))
    assert_close_to_ref(got["loss"], sum(losses), name="loss")
    assert sorted(got["grads"]) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        assert_close_to_ref(got["grads"][name], p.grad, name=f"grad {name}")
