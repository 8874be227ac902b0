"""Options a chunked trainer does not cover are refused with a clear error (no silent fallback to TRL's
materialised logits): at construction where the option is known then, else when the input arrives.

Multi-process and DeepSpeed settings cannot run in one CPU process: where the refusal reads them off the
accelerator, the test shows the accelerator a real accelerate object in that state, and nothing else."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator, ParallelismConfig
from transformers import AutoConfig, AutoModelForSeq2SeqLM
from trl import SFTTrainer

from chunkloss.data import count_reward, tiny_dataset
from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
from chunkloss.trainers.gkd import ChunkedGKDConfig, ChunkedGKDTrainer
from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.trainers.helpers import common_args, model_pair, tokenizer


def _deepspeed_sp():
    """DeepSpeed sequence parallelism (Ulysses/ALST) over 2 ranks, as accelerate builds it."""
    pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    assert pc.sp_enabled
    return pc


def _sft(tmp_path, **cfg):
    model, _ = model_pair()
    return ChunkedSFTTrainer(
        model,
        ChunkedSFTConfig(**common_args(tmp_path, max_length=64), chunk_compile=False, **cfg),
        train_dataset=tiny_dataset("sft", 8),
        processing_class=tokenizer(),
    )


def test_sft_refuses_deepspeed_sequence_parallelism(tmp_path):
    """Given in the config: refused before TRL builds anything (accelerate would only fail later, on a
    device mesh of 2 ranks in a 1-process run)."""
    with pytest.raises(ValueError, match="ChunkedSFTTrainer does not support DeepSpeed sequence parallelism"):
        _sft(tmp_path, parallelism_config=_deepspeed_sp())


def test_sft_refuses_deepspeed_sequence_parallelism_from_accelerate_config(tmp_path, monkeypatch):
    """Given in an accelerate config file, it reaches the accelerator's state and not ``args``: the trainer
    reads it there once the accelerator exists."""

    def create_accelerator(self):
        SFTTrainer.create_accelerator_and_postprocess(self)
        assert self.args.parallelism_config is None
        monkeypatch.setattr(self.accelerator.state, "parallelism_config", _deepspeed_sp())

    monkeypatch.setattr(ChunkedSFTTrainer, "create_accelerator_and_postprocess", create_accelerator)
    with pytest.raises(ValueError, match="ChunkedSFTTrainer does not support DeepSpeed sequence parallelism"):
        _sft(tmp_path)


def test_sft_accepts_other_parallelism(tmp_path, monkeypatch):
    """A parallelism config without sequence parallelism is not refused (the refusal reads sp_enabled)."""

    def create_accelerator(self):
        SFTTrainer.create_accelerator_and_postprocess(self)
        monkeypatch.setattr(self.accelerator.state, "parallelism_config", ParallelismConfig())

    monkeypatch.setattr(ChunkedSFTTrainer, "create_accelerator_and_postprocess", create_accelerator)
    assert _sft(tmp_path).accelerator.parallelism_config.sp_enabled is False


# Tiny encoder-decoders of two families, built from their configs.
ENCODER_DECODERS = {
    "t5": dict(d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2),
    "bart": dict(
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    ),
}


@pytest.mark.parametrize("family", sorted(ENCODER_DECODERS))
def test_orpo_refuses_encoder_decoder(tmp_path, family):
    tok = tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    sizes = ENCODER_DECODERS[family]
    config = AutoConfig.for_model(
        family, vocab_size=len(tok), decoder_start_token_id=ids["pad_token_id"], **ids, **sizes
    )
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config)
    assert model.config.is_encoder_decoder
    with pytest.raises(ValueError, match="ChunkedORPOTrainer does not support encoder-decoder models"):
        ChunkedORPOTrainer(
            model,
            ChunkedORPOConfig(**common_args(tmp_path, max_length=48), chunk_compile=False),
            train_dataset=tiny_dataset("orpo", 8),
            processing_class=tokenizer(),
        )


def _orpo(tmp_path, model=None, **cfg):
    return ChunkedORPOTrainer(
        model if model is not None else model_pair()[0],
        ChunkedORPOConfig(**common_args(tmp_path, max_length=48), chunk_compile=False, **cfg),
        train_dataset=tiny_dataset("orpo", 8),
        processing_class=tokenizer(),
    )


@pytest.mark.parametrize(
    "liger_config", [None, {"fused_linear_cross_entropy": True}, {"rms_norm": True}], ids=str
)
def test_orpo_refuses_liger_fused_linear_cross_entropy(tmp_path, liger_config):
    """Liger's fused linear cross-entropy (on unless the config turns it off) replaces the model's forward
    when training starts, dropping the chunked head: refused at construction. Turned off, Liger's layer
    kernels are accepted (Trainer.train applies them to the model, as it does for TRL's ORPO)."""
    message = r"ChunkedORPOTrainer does not support use_liger_kernel=True with liger_kernel_config="
    with pytest.raises(ValueError, match=message):
        _orpo(tmp_path, use_liger_kernel=True, liger_kernel_config=liger_config)
    off = {**(liger_config or {}), "fused_linear_cross_entropy": False}
    assert _orpo(tmp_path, use_liger_kernel=True, liger_kernel_config=off).args.use_liger_kernel


def test_dpo_refuses_weighting_with_sft_term(tmp_path):
    """WPO weighting with an "sft" loss term: TRL 1.16's own DPOTrainer fails in its first step, so there is
    no objective to match and ours refuses it when built (weighting with the other terms stays accepted)."""
    from trl import DPOConfig, DPOTrainer

    def args(cls, loss_type):
        return cls(**common_args(tmp_path, max_length=48), loss_type=loss_type, use_weighting=True)

    trl = DPOTrainer(
        model_pair()[0],
        model_pair(seed=1)[0],
        args=args(DPOConfig, ["sigmoid", "sft"]),
        train_dataset=tiny_dataset("dpo", 8),
        processing_class=tokenizer(),
    )
    batch = trl._prepare_inputs(trl.data_collator([trl.train_dataset[i] for i in range(4)]))
    with pytest.raises(RuntimeError):
        trl.compute_loss(trl.model, batch)
    trl.use_weighting = False  # the same batch and terms without the weighting: TRL computes a loss
    assert torch.isfinite(trl.compute_loss(trl.model, batch))

    def ours(loss_type):
        return ChunkedDPOTrainer(
            model_pair()[0],
            model_pair(seed=1)[0],
            args=args(lambda **kw: ChunkedDPOConfig(**kw, chunk_compile=False), loss_type),
            train_dataset=tiny_dataset("dpo", 8),
            processing_class=tokenizer(),
        )

    message = "ChunkedDPOTrainer does not support use_weighting=True with an 'sft'"
    with pytest.raises(ValueError, match=message):
        ours(["sigmoid", "sft"])
    assert ours(["sigmoid"]).use_weighting


def test_gkd_refuses_preprocess_logits_for_metrics(tmp_path):
    model, teacher = model_pair()
    with pytest.raises(ValueError, match="ChunkedGKDTrainer does not support preprocess_logits_for_metrics"):
        ChunkedGKDTrainer(
            model,
            teacher,
            ChunkedGKDConfig(**common_args(tmp_path)),
            train_dataset=tiny_dataset("gkd", 8),
            processing_class=tokenizer(),
            preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        )


def _grpo(tmp_path, **cfg):
    model, _ = model_pair()
    return ChunkedGRPOTrainer(
        model,
        count_reward,
        ChunkedGRPOConfig(
            **common_args(tmp_path, num_generations=2, max_completion_length=6), chunk_compile=False, **cfg
        ),
        train_dataset=tiny_dataset("grpo", 8),
        processing_class=tokenizer(),
    )


def test_grpo_refuses_top_entropy_quantile_on_several_processes(tmp_path, monkeypatch):
    """TRL takes the entropy quantile over every process's tokens; the accelerator reports 2 processes."""
    assert _grpo(tmp_path, top_entropy_quantile=0.5).top_entropy_quantile == 0.5  # one process: accepted
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    message = "ChunkedGRPOTrainer does not support top_entropy_quantile < 1 with several processes"
    with pytest.raises(ValueError, match=message):
        _grpo(tmp_path, top_entropy_quantile=0.5)
    assert _grpo(tmp_path).accelerator.num_processes == 2  # the default quantile 1.0 is accepted there


@pytest.fixture(scope="module")
def grpo_batch(tmp_path_factory):
    """A GRPO trainer and one batch of its own generated completions (text only)."""
    torch.manual_seed(0)
    trainer = _grpo(tmp_path_factory.mktemp("grpo_refusals"))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which these tests skip
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, batch


@pytest.mark.parametrize("build", [_sft, _grpo], ids=["sft", "grpo"])
def test_max_steps_zero_is_refused_when_the_trainer_is_built(tmp_path, build):
    """transformers reads max_steps=0 as a step count and still trains one step; -1 (the default) means
    num_train_epochs. 0 is refused before TRL builds anything."""
    with pytest.raises(ValueError, match=r"^max_steps=0 would train one step .* or -1 \(the default\)"):
        build(tmp_path, max_steps=0)
    assert build(tmp_path, max_steps=-1).args.max_steps == -1


@pytest.mark.parametrize("value", [2, -1])
def test_grpo_refuses_a_completion_mask_outside_0_1(grpo_batch, value):
    """The chunked loss reads the mask as a bool, so a 2 would count as 1 where TRL's masked sums weigh by
    it: refused in the loss's one host sync, with the value named."""
    trainer, batch = grpo_batch
    mask = batch["completion_mask"].clone()
    mask[0, 0] = value
    with pytest.raises(ValueError, match=rf"^completion_mask holds {value}, outside \{{0, 1\}}"):
        trainer.compute_loss(trainer.model, {**batch, "completion_mask": mask})


@pytest.mark.parametrize("key", ["pixel_values", "image_grid_thw"])
def test_grpo_refuses_multimodal_inputs(grpo_batch, key):
    trainer, batch = grpo_batch
    value = torch.zeros(4, 3, 8, 8) if key == "pixel_values" else torch.tensor([[1, 2, 2]] * 4)
    with pytest.raises(ValueError, match=f"ChunkedGRPOTrainer does not support multimodal input '{key}'"):
        trainer.compute_loss(trainer.model, {**batch, key: value})
    # The same batch without it trains.
    assert torch.isfinite(trainer.compute_loss(trainer.model, dict(batch)))


def test_dpo_refuses_multimodal_inputs(tmp_path):
    model, ref_model = model_pair()
    trainer = ChunkedDPOTrainer(
        model,
        ref_model,
        ChunkedDPOConfig(**common_args(tmp_path, max_length=48), chunk_compile=False),
        train_dataset=tiny_dataset("dpo", 8),
        processing_class=tokenizer(),
    )
    trainer.model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    pixels = torch.zeros(batch["input_ids"].size(0), 3, 8, 8)
    with pytest.raises(ValueError, match=r"ChunkedDPOTrainer does not support inputs \['pixel_values'\]"):
        trainer.compute_loss(trainer.model, {**batch, "pixel_values": pixels})
    assert torch.isfinite(trainer.compute_loss(trainer.model, dict(batch)))
