"""``benchmarks.gemm_share`` sorts a step's kernels into GEMMs, chunkloss's row kernels and the rest: the
README's account of where the one-pass time goes rests on that split. Most names below are kernels the H100
run profiled (``benchmarks/results/dev/s13/gemm_share_run1.log``); the xmma and inductor names are the other
forms cuBLAS's and torch.compile's kernels take."""

import json
from pathlib import Path

import pytest

from benchmarks import gemm_share

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize(
    "name, cls",
    [
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NTT", "gemm"),  # cuBLAS, beta = 0
        ("nvjet_sm90_tss_320x128_64x3_1x2_h_badd_coopB_NTT", "gemm"),  # cuBLAS, fp32 accumulate
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("_finish_kernel", "gemm"),  # kernels/weight_grad.py: (s·acc + gᵀx) in one pass
        ("_cross_entropy_step_kernel", "row"),
        ("_row_stats_kernel", "row"),
        ("_row_grad_kernel", "row"),
        ("_jsd_step_kernel", "row"),
        ("_scale_kernel", "row"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda", "other"),
        ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl", "other"),
        ("triton_poi_fused_add_mul_0", "other"),  # inductor's graphs are neither
        ("Memset (Device)", "other"),
    ],
)
def test_kernel_class(name, cls):
    assert gemm_share.kernel_class(name) == cls


def test_committed_result_adds_up():
    """The committed run's classes sum to its busy time; its ratios are its milliseconds over the floor."""
    doc = json.loads((RESULTS / "gemm_share.json").read_text())
    assert doc["rows"]
    for r in doc["rows"]:
        assert r["gemm_ms"] + r["row_ms"] + r["other_ms"] == pytest.approx(r["busy_ms"], rel=1e-9)
        assert r["gemm_x_floor"] == pytest.approx(r["gemm_ms"] / r["floor_ms"], rel=1e-9)
        assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"], rel=1e-9)
        assert r["busy_ms"] <= r["ms"] * 1.05  # kernels cannot take much longer than the timed step
