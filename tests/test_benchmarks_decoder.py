"""bench_decoder's attention-input block on CPU (kernels in the Triton interpreter): the bytes each
implementation saves for the backward, the norm output that ``norm_recompute`` leaves out, and the errors."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")

from benchmarks import bench_decoder  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402


def test_attn_in_norm_recompute_saves_one_bf16_norm_output_less(tmp_path):
    assert bench_decoder.main(["--smoke", "--blocks", "attn_in", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "decoder.json").exists()  # one block run, one set written
    rows = json.loads((tmp_path / "decoder_attn.json").read_text())["rows"]
    by = {r["impl"]: r for r in rows}
    assert {"eager", "unfused", "norm_recompute"} <= set(by)
    n, hidden = by["unfused"]["N"], by["unfused"]["H"]
    # unfused: x and the norm's fp32 rstd (its backward) and the norm output (one storage for q, k and v);
    # RoPE keeps only the cos/sin tables, which are not counted.
    assert by["unfused"]["saved_bytes"] == 2 * n * hidden + 4 * n + 2 * n * hidden
    assert by["norm_recompute"]["saved_bytes"] == by["unfused"]["saved_bytes"] - 2 * n * hidden
    tol = TOLERANCES[torch.bfloat16]
    for impl in ("unfused", "norm_recompute"):
        assert set(by[impl]["err"]) == {"q", "k", "v", "x", "norm_w", "w_q", "w_k", "w_v"}
        for key, err in by[impl]["err"].items():
            assert err <= tol.k * by["eager"]["err"][key] + tol.atol, (impl, key)
    assert by["norm_recompute"]["err"] == by["unfused"]["err"]  # the recomputed norm gives the same bits


def test_blocks_takes_only_known_block_names():
    with pytest.raises(SystemExit):
        bench_decoder.main(["--smoke", "--blocks", "mlp,attn"])
