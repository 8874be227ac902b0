"""``chunk_fp8`` on the chunked trainers. ``'base'``: a PEFT LoRA model's frozen projection bases stored in
fp8 once at construction (``chunkloss.models.quantize_base_fp8``) and run in fp8 inside the kernels.
``'train'``: the model's linear layers but the LM head trained in float8 through torchao
(``chunkloss.models.float8_training``), the step equal to TRL's on the same float8 model. Each refused in one
line where it cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from chunkloss.data import tiny_dataset
from chunkloss.kernels import fp8 as fp8_module
from chunkloss.kernels.fp8 import Float8Linear
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.models.test_patch import grad_fn_counts
from tests.trainers.helpers import common_args, model_pair, tokenizer

peft = pytest.importorskip("peft")


def _lora(model):
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # zero-initialised B would make the adapters invisible
    return model


def _sft(tmp_path, model, **cfg):
    args = dict(common_args(tmp_path, max_length=64), chunk_size=7, chunk_compile=False)
    args["use_cpu"] = not torch.cuda.is_available()
    return ChunkedSFTTrainer(
        model,
        ChunkedSFTConfig(**{"chunk_kernels": True, **args, **cfg}),
        train_dataset=tiny_dataset("sft", n=4),
        processing_class=tokenizer(),
    )


def _step(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(trainer._prepare_inputs(batch)))
    loss.backward()
    return loss


def test_sft_chunk_fp8_base_runs_the_lora_step_on_fp8_bases(tmp_path, caplog):
    """Every LoRA base becomes a Float8Linear at construction; the step runs the fused calls on them, its loss
    within fp8's distance of the same step on the fp32 base (measured: 0.0047 relative on this 32-wide
    model; bound 0.01) and finite gradients for every adapter."""
    m_plain, m_fp8 = model_pair()
    plain = _sft(tmp_path, _lora(m_plain))
    with caplog.at_level(logging.INFO, logger="chunkloss.models"):
        fp8 = _sft(tmp_path, _lora(m_fp8), chunk_fp8="base")
    assert "LoRA projections (fp8 base)" in caplog.text, caplog.text
    layers = [m for m in fp8.model.modules() if hasattr(m, "lora_A")]
    assert layers and all(type(m.base_layer) is Float8Linear for m in layers)
    assert all(type(m.base_layer) is torch.nn.Linear for m in plain.model.modules() if hasattr(m, "lora_A"))
    l_plain, l_fp8 = _step(plain), _step(fp8)
    assert grad_fn_counts(l_fp8).get("GatedMLPFunctionBackward") == 1
    assert abs(l_fp8.item() - l_plain.item()) <= 0.01 * abs(l_plain.item())
    grads = [p.grad for n, p in fp8.model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and g.isfinite().all() for g in grads)


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"chunk_fp8": "train"}, r"chunk_fp8='train' with a PEFT model: it trains every projection's"),
        ({"chunk_fp8": "base", "chunk_kernels": False}, r"chunk_fp8='base' with chunk_kernels=False"),
        ({"chunk_fp8": "fp8"}, r"chunk_fp8 must be None, 'base' or 'train', got 'fp8'"),
    ],
)
def test_chunk_fp8_refusals(tmp_path, cfg, message):
    model, _ = model_pair()
    with pytest.raises(ValueError, match=message):
        _sft(tmp_path, _lora(model), **cfg)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_chunk_fp8_base_needs_a_peft_lora_model(tmp_path):
    with pytest.raises(ValueError, match=r"chunk_fp8='base' without a PEFT LoRA model"):
        _sft(tmp_path, model_pair()[0], chunk_fp8="base")


def test_chunk_fp8_base_refused_where_the_device_has_no_fp8(tmp_path, monkeypatch):
    monkeypatch.setattr(
        fp8_module, "fp8_refusal", lambda device: "CUDA compute capability 8.0 has no fp8 GEMM"
    )
    model, _ = model_pair()
    with pytest.raises(
        ValueError, match=r"chunk_fp8='base' with parameters on cpu: CUDA compute capability 8.0"
    ):
        _sft(tmp_path, _lora(model), chunk_fp8="base")


def test_chunk_fp8_base_needs_the_kernels_to_run(tmp_path, monkeypatch):
    """On CPU the kernels run only under the Triton interpreter: without it chunk_fp8='base' is refused."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, _ = model_pair()
    with pytest.raises(ValueError, match=r"chunk_fp8='base' with parameters on \['cpu'\]: its fp8 GEMMs run"):
        _sft(tmp_path, _lora(model), chunk_fp8="base", chunk_kernels=None)


def test_chunk_fp8_is_a_yaml_key():
    """The CLI maps the config fields: ``chunk_fp8: base`` in a yaml file reaches the trainer's config."""
    from chunkloss.cli.config import make_parser

    parser = make_parser("sft")
    parser.set_defaults_with_config(chunk_fp8="base", output_dir="out", use_cpu=True, bf16=False)
    config = next(c for c in parser.parse_args_into_dataclasses([]) if isinstance(c, ChunkedSFTConfig))
    assert config.chunk_fp8 == "base"


# ---- chunk_fp8='train': torchao's float8 training --------------------------------------------------------


def _float8_layers(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


@pytest.mark.parametrize("kernels", [False, True], ids=["modules", "kernels"])
def test_chunk_fp8_train_step_equals_trls_on_the_same_float8_model(tmp_path, kernels):
    """Every linear layer but the LM head becomes torchao's Float8Linear at construction; the first step's
    loss and every gradient equal TRL's SFTTrainer on a copy converted by torchao directly (the same float8
    GEMMs; ours with the chunked loss, and with the kernels' norms, RoPE and gating when they are on)."""
    from trl import SFTConfig, SFTTrainer

    from chunkloss.models import float8_training
    from tests.trainers.helpers import assert_close_loss, assert_same_grads

    pytest.importorskip("torchao")
    ref_model, our_model = model_pair()
    assert float8_training(ref_model) == 7
    base = common_args(tmp_path, max_length=64)
    data = tiny_dataset("sft", n=4)
    ref = SFTTrainer(ref_model, SFTConfig(**base), train_dataset=data, processing_class=tokenizer())
    ours = _sft(tmp_path, our_model, chunk_fp8="train", chunk_kernels=kernels)
    assert _float8_layers(ours.model) == _float8_layers(ref.model) and "lm_head" not in _float8_layers(
        ref.model
    )
    assert_close_loss(_step(ours), _step(ref))
    assert_same_grads(ref.model, ours.model)


def test_chunk_fp8_train_refusals(tmp_path, monkeypatch):
    """Without torchao, and on a device without fp8 GEMMs: one line each, the model left as it was."""
    import sys

    model, _ = model_pair()
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torchao.float8", None)  # its import fails, as without torchao
        with pytest.raises(
            ValueError, match=r"chunk_fp8='train' without torchao: pip install 'chunkloss\[fp8\]'"
        ):
            _sft(tmp_path, model, chunk_fp8="train")
    # the device is refused before torchao is imported or anything converted
    monkeypatch.setattr(
        fp8_module, "fp8_refusal", lambda device: "CUDA compute capability 8.0 has no fp8 GEMM"
    )
    with pytest.raises(
        ValueError, match=r"chunk_fp8='train' with parameters on cpu: CUDA compute capability"
    ):
        _sft(tmp_path, model, chunk_fp8="train")
    assert not _float8_layers(model)


def test_float8_training_saves_a_plain_checkpoint_and_refuses_what_it_cannot_convert(tmp_path):
    """torchao's layers keep the weights under their names: the saved model loads into transformers' own
    classes with every tensor equal. A bad recipe and a model with nothing to convert raise one line."""
    from transformers import AutoModelForCausalLM

    from chunkloss.models import float8_training

    pytest.importorskip("torchao")
    model, plain = model_pair()
    assert float8_training(model, recipe="rowwise") == 7
    assert set(model.state_dict()) == set(plain.state_dict())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not _float8_layers(loaded)
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in loaded.state_dict().items())
    with pytest.raises(ValueError, match=r"recipe must be one of \('tensorwise', 'rowwise'"):
        float8_training(plain, recipe="delayed")
    with pytest.raises(ValueError, match="float8 all-gathers need the tensorwise recipe, got 'rowwise'"):
        float8_training(plain, recipe="rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="has no nn.Linear with sides that are multiples of 16"):
        float8_training(torch.nn.Sequential(torch.nn.Linear(8, 8)))


def test_chunk_fp8_train_all_gathers_float8_under_fsdp2():
    """Where the trainer's accelerator runs FSDP2, the converted weights are torchao's float8-castable
    tensors, which FSDP2 all-gathers as float8 (tests/models/test_float8_fsdp_cpu.py); elsewhere plain."""
    from chunkloss.trainers._kernel_policy import _float8_training

    pytest.importorskip("torchao")
    sharded, plain = model_pair()
    _float8_training("T", sharded, fsdp2=True)
    _float8_training("T", plain, fsdp2=False)
    assert type(sharded.model.layers[0].mlp.up_proj.weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert type(plain.model.layers[0].mlp.up_proj.weight) is torch.nn.Parameter
