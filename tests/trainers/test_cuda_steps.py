"""Each chunked trainer on its loss's CUDA steps against TRL's own trainer on the same batch.

The ``cuda_steps`` fixture makes every loss build the steps it builds on CUDA (the Triton kernels of
``chunkloss.kernels``), here run on CPU tensors through TRITON_INTERPRET=1. The GPU tests check the kernels
against fp32 references on CUDA; TRL is not on the GPU machine, so this is where the trainers' parity with
TRL covers the kernels: loss, every parameter's gradient and the logged metrics, as in each trainer's
``*_compiled`` test (same tolerances).
"""

from __future__ import annotations

import pytest
import torch

from tests.trainers import test_distillation as distillation_t
from tests.trainers import test_dpo as dpo_t
from tests.trainers import test_gkd as gkd_t
from tests.trainers import test_grpo as grpo_t
from tests.trainers import test_orpo as orpo_t
from tests.trainers import test_sft as sft_t
from tests.trainers.helpers import check_orpo_step

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with a GPU, Triton compiles for it and cannot take these CPU models' tensors (tests/conftest.py "
    "sets TRITON_INTERPRET=1 only without one); TRL is not on the GPU machine, so CI runs this",
)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft(tmp_path, loss_type, cuda_steps):
    sft_t._check(*sft_t._compiled_pair(tmp_path, loss_type=loss_type))


def test_dpo(tmp_path, cuda_steps):
    dpo_t._check(*dpo_t._pair(tmp_path, compile_=True))


def test_orpo(tmp_path, cuda_steps):
    check_orpo_step(*orpo_t._pair(tmp_path, compile_=True))


def test_gkd(tmp_path, cuda_steps):
    gkd_t._check(*gkd_t._pair(tmp_path, compile=True, chunk_size=None))


@pytest.mark.parametrize("cfg", [{"beta": 0.5}, {"beta": 1.0, "temperature": 0.7}], ids=["jsd", "reverse_kl"])
def test_distillation(tmp_path, cfg, cuda_steps):
    distillation_t._check(*distillation_t._pair(tmp_path, compile=True, chunk_size=None, **cfg))


@pytest.mark.parametrize(
    "settings, use",
    [
        ({"loss_type": "dapo"}, ()),
        ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, ("old_per_token_logps",)),
        ({"loss_type": "dapo", "beta": 0.04}, ("old_per_token_logps", "ref_per_token_logps")),
        ({"loss_type": "dapo", "top_entropy_quantile": 0.5}, ("old_per_token_logps",)),
    ],
    ids=["dapo-on-policy", "gspo", "dapo-kl", "entropy-mask"],
)
def test_grpo(tmp_path, settings, use, cuda_steps):
    grpo_t._run(grpo_t._make_pair(tmp_path, compile_=True), settings, use=use)
