"""The chunked head under FSDP2 on CPU: two gloo processes shard a tiny model with ``fully_shard`` and run
the path the trainers take (``add_chunked_head``: the loss runs as the forward of the ``lm_head`` module, so
FSDP2's hooks on the head's unit unshard its weight and reduce-scatter its gradient); the loss, the gathered
gradients and the parameters after an SGD step equal one process's on the same global batch.

Three layouts:

- ``accelerate``: accelerate 1.15's (``fsdp2_prepare_model``): decoder layers, the input embedding, then
  ``[final_norm, lm_head]`` in one unit that is not resharded after the forward;
- ``accelerate_tied``: the same with tied embeddings: the unit is ``[final_norm, embed_tokens, lm_head]``;
- ``head_alone``: ``lm_head`` in a unit of its own, resharded after the forward (unsharded again before the
  backward by the hook FSDP2 hangs on the head's output). Its loss is the per-token one summed
  (``reduction="none"``, as the log-probs of DPO and GRPO), whose backward reads the weight again.

In every layout the head's weight is a plain tensor inside the loss, and FSDP2 does not complete a unit whose
module did not run (torch 2.13's ``FSDP::force_complete_post_forward``; earlier versions warn that modules
"did not run forward before backward").
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.trainers._head import add_chunked_head
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import free_port

WORLD = 2
LAYOUTS = ("accelerate", "accelerate_tied", "head_alone")
LR = 0.5  # large enough that a wrong gradient moves the parameters visibly
# What FSDP2 logs or warns when a module of a unit did not run its forward before the backward.
UNRUN = ("did not run forward before backward", "force_complete_post_forward")
# fp32 on CPU: FSDP's reduce-scatter sums two halves in another order than one process's backward; the
# measured largest relative difference (to each tensor's largest entry) is ~1e-7 (tests/tolerances.py).


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2 * WORLD, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt, as completion-only SFT masks it
    labels[1, 5:] = -100  # ranks hold different numbers of valid tokens
    return ids, labels


def _model(tied: bool):
    from chunkloss.data import tiny_model, tiny_tokenizer

    torch.manual_seed(0)
    # Odd sizes: vocab 39 does not split evenly over two ranks (FSDP pads the last shard).
    model = tiny_model(tiny_tokenizer(), hidden_size=32, num_layers=2, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def _loss(model, ids, labels, num_items, seen: list, scale=1.0, per_token=False):
    """The step of ``ChunkedSFTTrainer.compute_loss``: the loss inside the forward, normalised by the global
    count of valid tokens and multiplied by the world size (FSDP averages gradients over ranks). ``seen``
    gets the type of the head's weight as the loss reads it. ``per_token``: the same loss as the sum of the
    per-token losses (``reduction="none"``: the backward runs the chunk loop again, reading the weight)."""
    reduction = "none" if per_token else "mean"
    loss_mod = FusedLinearCrossEntropyLoss(chunk_size=5, compile=False, reduction=reduction)

    def head_fn(hidden, head):
        seen.append(type(head.weight).__name__)
        out = loss_mod(
            head.features(hidden[:, :-1]),
            head.weight,
            labels[:, 1:],
            bias=head.bias,
            num_items_in_batch=None if per_token else num_items,
        )
        return out.sum() / num_items if per_token else out

    return model(input_ids=ids, chunked_head=head_fn).result * scale


def _shard(model, layout: str) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if layout == "accelerate":
        fully_shard(model.model.embed_tokens)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    elif layout == "accelerate_tied":
        fully_shard([model.model.norm, model.model.embed_tokens, model.lm_head], reshard_after_forward=False)
    else:
        fully_shard(model.lm_head)
    fully_shard(model)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if type(t).__name__ == "DTensor" else t).detach().clone()


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    fsdp_log = logging.getLogger("torch.distributed.fsdp.fully_shard")
    records = _Records()
    fsdp_log.addHandler(records)
    fsdp_log.setLevel(logging.DEBUG)
    results = {}
    try:
        for layout in LAYOUTS:  # one spawn for all layouts: process start-up and imports dominate the time
            model = _model(tied=layout == "accelerate_tied")
            add_chunked_head(model)
            _shard(model, layout)
            at_rest = type(model.lm_head.weight).__name__
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            ids, labels = _batch(model.config.vocab_size)
            num_items = (labels[:, 1:] != -100).sum()
            local = slice(rank * 2, rank * 2 + 2)
            seen: list[str] = []
            records.messages.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = _loss(
                    model,
                    ids[local],
                    labels[local],
                    num_items,
                    seen,
                    scale=WORLD,
                    per_token=layout == "head_alone",
                )
                loss.backward()
            grads = {name: _full(p.grad) for name, p in model.named_parameters()}
            opt.step()
            params = {name: _full(p) for name, p in model.named_parameters()}
            total = loss.detach() / WORLD
            dist.all_reduce(total)
            said = [*records.messages, *(str(w.message) for w in caught)]
            unrun = [m for m in said if any(u in m for u in UNRUN)]
            results[layout] = dict(
                at_rest=at_rest, seen=seen, unrun=unrun, loss=float(total), grads=grads, params=params
            )
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp") / "rank0.pt")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


def single_process_reference(tied: bool):
    """The model with the chunked head after one backward on the whole batch in this process and an SGD step,
    its loss and its gradients (the loss reduced by the loss module: the reference for both forms)."""
    model = _model(tied)
    add_chunked_head(model)
    ids, labels = _batch(model.config.vocab_size)
    loss = _loss(model, ids, labels, (labels[:, 1:] != -100).sum(), [])
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return model, loss, grads


@pytest.mark.slow  # two spawned processes importing torch and transformers: about 28 s of CPU time
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_gloo_head_in_fsdp_schedule(layout, sharded_results):
    got = sharded_results[layout]
    assert got["at_rest"] == "DTensor"  # sharded outside the forward in every layout
    assert got["seen"] == ["Parameter"]  # unsharded by FSDP2's hooks when the loss reads it
    assert got["unrun"] == []

    model, ref_loss, ref_grads = single_process_reference(tied=layout == "accelerate_tied")
    assert_close_to_ref(got["loss"], float(ref_loss.detach()), name="loss")
    assert sorted(got["grads"]) == sorted(ref_grads)
    for name, p in model.named_parameters():
        assert ref_grads[name].abs().max() > 0, name
        assert_close_to_ref(got["grads"][name], ref_grads[name], name=f"grad {name}")
        assert_close_to_ref(got["params"][name], p.detach(), name=f"{name} after the step")
