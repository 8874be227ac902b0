"""The chunkloss fields of a chunked config are read once, when the config is built: ``chunk_accum_dtype``
takes a name (YAML and the command line give strings) or a ``torch.dtype`` and keeps its canonical name, so
the config still serialises; a bad value is refused there in one line."""

from __future__ import annotations

import json

import pytest
import torch

from chunkloss.trainers._arguments import ACCUM_DTYPES, ChunkedArguments, chunk_options
from chunkloss.trainers.sft import ChunkedSFTConfig
from tests.trainers.helpers import common_args

CANONICAL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", None: "weight"}


@pytest.mark.parametrize("given", [*ACCUM_DTYPES, *CANONICAL], ids=str)
def test_accum_dtype_is_parsed_at_construction(tmp_path, given):
    dtype = ACCUM_DTYPES[given] if isinstance(given, str) else given
    cfg = ChunkedSFTConfig(**common_args(tmp_path), chunk_accum_dtype=given)
    assert cfg.accum_dtype is dtype
    assert chunk_options(cfg)["accum_dtype"] is dtype
    assert cfg.chunk_accum_dtype == CANONICAL[dtype]
    assert json.loads(cfg.to_json_string())["chunk_accum_dtype"] == cfg.chunk_accum_dtype


@pytest.mark.parametrize("bad", ["int8", "Float32", torch.int8, 3])
def test_bad_accum_dtype_is_refused_at_construction(tmp_path, bad):
    with pytest.raises(ValueError, match=r"^chunk_accum_dtype must be one of .* got") as caught:
        ChunkedSFTConfig(**common_args(tmp_path), chunk_accum_dtype=bad)
    assert "\n" not in str(caught.value)


def test_standalone_fields_are_parsed_too():
    assert ChunkedArguments(chunk_accum_dtype="bf16").accum_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ChunkedArguments(chunk_size=0)
