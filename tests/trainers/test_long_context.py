"""``chunk_long_context``: checkpointing, TRL's activation offloading and the tiled MLP behind one switch.

On the CPU: what the switch sets (checkpointing on, the MLP recomputed and tiled, no offloading where there is
no accelerator) and its refusals, and one step equal to the same step without it. On CUDA (``gpu``): the
offloaded step gives the same loss and gradients bit for bit as the step without offloading, for SFT (TRL's
own field) and GRPO (the context this builds); and the GPU peak no longer grows with the layer count.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from chunkloss.data import length_reward, tiny_dataset, tiny_model
from chunkloss.models.layers import PatchedGatedMLP
from chunkloss.trainers import _long_context as long_context
from chunkloss.trainers._long_context import MLP_TILE, HostMemoryCheck, pinned_block_bytes
from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import assert_same_grads, common_args, grads, model_pair, tokenizer

CUDA = torch.cuda.is_available()


def _args(tmp_path, **cfg) -> dict:
    return {**common_args(tmp_path, **cfg), "use_cpu": not CUDA}


def _sft(tmp_path, model, **cfg):
    args = _args(tmp_path, **{"max_length": 64, **cfg})
    config = ChunkedSFTConfig(**args, chunk_size=7, chunk_compile=False)
    return ChunkedSFTTrainer(
        model, config, train_dataset=tiny_dataset("sft", n=4), processing_class=tokenizer()
    )


def _checkpoint(model) -> None:
    """Checkpointing on, as ``Trainer.train()`` turns it on from the config (these tests run single steps)."""
    # transformers 5.23 renamed gradient_checkpointing_enable (the old name warns there).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def _step(trainer, batch=None):
    """One ``training_step`` (forward, backward, inside the trainer's offloading context) on ``batch``, or on
    the trainer's whole dataset collated; the loss."""
    if batch is None:  # training_step prepares it (GRPO: generates the completions)
        rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        batch = trainer.data_collator(rows)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() for each optimizer step
    inputs = dict(batch) if isinstance(batch, dict) else batch  # GRPO's collated batch is a list of rows
    return torch.as_tensor(trainer.training_step(trainer.model, inputs, None))


def test_switch_turns_on_checkpointing_the_tiled_mlp_and_the_norm_recompute(tmp_path):
    model = model_pair()[0]
    trainer = _sft(tmp_path, model, chunk_long_context=True, chunk_kernels=True)
    args = trainer.args
    assert args.gradient_checkpointing and getattr(args, "activation_checkpointing", True)
    assert args.activation_offloading is CUDA  # nothing to offload from on the CPU
    mlps = [m for m in model.modules() if isinstance(m, PatchedGatedMLP)]
    assert mlps and all(m.chunkloss_mlp.recompute and m.chunkloss_mlp.tile == MLP_TILE for m in mlps)
    layers = model.model.layers
    assert all(layer.chunkloss_layer.norm_recompute for layer in layers)


def test_explicit_tile_and_refusals(tmp_path):
    model = model_pair()[0]
    _sft(tmp_path, model, chunk_kernels=True, chunk_kernels_mlp_tile=5)
    assert {m.chunkloss_mlp.tile for m in model.modules() if isinstance(m, PatchedGatedMLP)} == {5}
    with pytest.raises(ValueError, match="chunk_kernels_mlp_tile=5 with chunk_kernels=False"):
        _sft(tmp_path, model_pair()[0], chunk_kernels=False, chunk_kernels_mlp_tile=5)
    with pytest.raises(ValueError, match="chunk_kernels_mlp_tile must be a positive int or None, got 0"):
        _sft(tmp_path, model_pair()[0], chunk_kernels=True, chunk_kernels_mlp_tile=0)
    # The switch itself with the kernels off: checkpointing (and offloading) only, nothing refused.
    assert _sft(
        tmp_path, model_pair()[0], chunk_kernels=False, chunk_long_context=True
    ).args.gradient_checkpointing


def test_long_context_step_equals_the_plain_step(tmp_path):
    """Tiles of 5 tokens over sequences of up to 64 (several tiles per sequence): the same loss and
    gradients as the untiled, uncheckpointed step (fp32; tests/tolerances.py's fp32 row)."""
    m_plain, m_long = model_pair()
    plain = _sft(tmp_path, m_plain, chunk_kernels=True)
    long = _sft(tmp_path, m_long, chunk_kernels=True, chunk_long_context=True, chunk_kernels_mlp_tile=5)
    _checkpoint(m_long)
    assert_close_to_ref(_step(long), _step(plain))
    assert_same_grads(plain.model, long.model)


def _grpo(tmp_path, model, **cfg):
    args = _args(tmp_path, num_generations=4, max_completion_length=16, **cfg)
    config = ChunkedGRPOConfig(**args, chunk_compile=False)
    data = tiny_dataset("grpo", 8)
    return ChunkedGRPOTrainer(model, length_reward, config, train_dataset=data, processing_class=tokenizer())


def test_grpo_builds_its_own_offloading_context_only_on_an_accelerator(tmp_path):
    trainer = _grpo(tmp_path, model_pair()[0], chunk_long_context=True)
    assert trainer.args.gradient_checkpointing
    assert (trainer._chunk_offload is not None) is CUDA
    assert _grpo(tmp_path, model_pair()[0])._chunk_offload is None


# ---- CUDA ------------------------------------------------------------------------------------------------


def _same_step(make, tmp_path):
    """``make(path, model, offload)``'s step with checkpointing, with and without offloading: equal bit for
    bit."""
    torch.manual_seed(0)
    base = tiny_model(tokenizer(), "llama", hidden_size=64, num_layers=3).cuda()
    runs = []
    for offload in (False, True):
        trainer = make(tmp_path / str(offload), copy.deepcopy(base), offload)
        _checkpoint(trainer.model)
        torch.manual_seed(1)  # GRPO samples the same completions in both
        runs.append((_step(trainer), grads(trainer.model)))
    (loss_a, g_a), (loss_b, g_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert g_a.keys() == g_b.keys() and all(torch.equal(g_a[k], g_b[k]) for k in g_a)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="offloading copies CUDA tensors to host memory")
def test_offloaded_sft_step_is_bitwise_the_same(tmp_path):
    def make(path, model, offload):
        # The switch with offloading, against the same tiles and checkpointing without it.
        trainer = _sft(path, model, chunk_long_context=True, chunk_kernels_mlp_tile=16)
        assert trainer.args.activation_offloading
        if not offload:
            trainer.maybe_activation_offload_context = contextlib.nullcontext()
        return trainer

    _same_step(make, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="offloading copies CUDA tensors to host memory")
def test_offloaded_grpo_step_is_bitwise_the_same(tmp_path):
    def make(path, model, offload):
        trainer = _grpo(path, model, chunk_long_context=True)
        if not offload:
            trainer._chunk_offload = None
        return trainer

    _same_step(make, tmp_path)


def _peak_growth(tmp_path, layers: int, long_context: bool, tokens=(2048, 4096)) -> int:
    """GPU peak of one SFT step at ``tokens[1]`` minus that at ``tokens[0]`` (bytes), bf16."""
    peaks = []
    for t in tokens:
        torch.manual_seed(0)
        model = tiny_model(tokenizer(), "llama", hidden_size=256, num_layers=layers).cuda().bfloat16()
        trainer = _sft(tmp_path / f"{layers}-{t}", model, max_length=t, chunk_long_context=long_context)
        _checkpoint(model)
        ids = torch.randint(0, model.config.vocab_size, (1, t), device="cuda")
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        _step(trainer, batch)  # warm-up: compiles the kernels, fills the allocator's pools
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(trainer, batch)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        del trainer, model
        torch.cuda.empty_cache()
    return peaks[1] - peaks[0]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="measures CUDA memory")
def test_peak_growth_does_not_scale_with_the_layer_count(tmp_path):
    """Without offloading, 2T against T adds each layer's checkpointed input (T·H·2 bytes per layer): the
    growth rises with the layer count. With the switch it does not: 8 layers grow as 2 do, within one
    layer's input."""
    one_input = 2048 * 256 * 2
    plain = {n: _peak_growth(tmp_path, n, False) for n in (2, 8)}
    long = {n: _peak_growth(tmp_path, n, True) for n in (2, 8)}
    assert plain[8] - plain[2] >= 5 * one_input, plain  # 6 more layer inputs kept
    assert abs(long[8] - long[2]) <= one_input, long


def test_pinned_blocks_round_up_to_a_power_of_two_unless_the_config_exempts_them():
    assert pinned_block_bytes(2**30) == 2**30
    assert pinned_block_bytes(2**30 + 1) == 2**31  # 342,733 tokens x 4096 x 2 bytes: 2.6 GiB takes 4
    assert pinned_block_bytes(342_733 * 4096 * 2) == 4 * 2**30
    exempt = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,pinned_max_cached_size_mb:1024"}
    assert pinned_block_bytes(2**30 + 1, exempt) == 2**30 + 1
    assert pinned_block_bytes(2**29 + 1, exempt) == 2**30  # below the limit: still rounded
    assert (
        pinned_block_bytes(2**30 + 1, {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:512"})
        == 2**30 + 1
    )


def test_host_memory_check_refuses_a_batch_whose_pinned_blocks_cannot_fit(tmp_path):
    """The hook on the first decoder layer: a batch whose offloaded layer inputs (each rounded up to a power
    of two) and what the process holds exceed the machine's memory raises one line before the forward;
    within the memory, without grad, in eval mode or at a size already checked it does nothing."""
    model = model_pair()[0]
    layers = model.model.layers
    h = model.config.hidden_size
    per_token = h * 4  # fp32 layer inputs: 4 bytes per element
    # 10 tokens: blocks of next_pow2(10 * per_token) bytes, one per layer.
    block = pinned_block_bytes(10 * per_token)
    fits = HostMemoryCheck(len(layers), held=100, total=len(layers) * block + 100)
    handle = layers[0].register_forward_pre_hook(fits, with_kwargs=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    model.train()
    model(input_ids=ids)
    assert fits.largest == 10 * h
    handle.remove()
    tight = HostMemoryCheck(len(layers), held=101, total=len(layers) * block + 100)
    handle = layers[0].register_forward_pre_hook(tight, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)  # scoring: nothing saved, nothing offloaded
    model.eval()
    model(input_ids=ids)
    model.train()
    refused = r"offloading this batch's 10 tokens needs .* GiB of pinned host memory"
    with pytest.raises(MemoryError, match=refused) as e:
        model(input_ids=ids)
    assert "\n" not in str(e.value)
    tight.largest = 10 * h
    model(input_ids=ids)  # a size already checked is not checked again
    handle.remove()


def test_host_memory_check_is_installed_only_where_offloading_runs(tmp_path, monkeypatch):
    model = model_pair()[0]
    trainer = _sft(tmp_path, model, chunk_long_context=True, chunk_kernels=True)
    assert long_context.check_host_memory(trainer) is None  # on the CPU nothing is offloaded
    monkeypatch.setattr(long_context, "_offloads", lambda args: True)
    handle = long_context.check_host_memory(trainer)
    hooks = trainer.model.model.layers[0]._forward_pre_hooks
    assert handle.id in hooks and isinstance(hooks[handle.id], HostMemoryCheck)
    check = hooks[handle.id]
    assert check.layers == trainer.model.config.num_hidden_layers and 0 < check.held < check.total
    handle.remove()
