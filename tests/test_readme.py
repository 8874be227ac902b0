"""The README's code: the custom loss it shows is the tested one in ``tests/test_custom_losses.py``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from chunkloss.engine import Batch, FusedLinearBase, FusedOptions
from tests.test_custom_losses import focal_ref, inputs, run
from tests.tolerances import assert_close_to_ref

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"the README has {len(found)} python blocks with {marker!r}"
    return found[0]


def test_readme_token_loss_runs_and_matches_the_reference():
    scope = {"dataclass": dataclass, "torch": torch, "Batch": Batch, "FusedLinearBase": FusedLinearBase,
             "FusedOptions": FusedOptions}  # fmt: skip
    exec(_block("class FusedLinearFocalLoss"), scope)
    hidden, weight, labels = inputs(3)
    loss = scope["FusedLinearFocalLoss"](gamma=2.0, chunk_size=4, compile=False)
    ours = run(lambda x, w: loss(x, w, labels), hidden, weight)
    ref = run(lambda x, w: focal_ref(x @ w.T, labels), hidden.double(), weight.double())
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), ours, ref):
        assert_close_to_ref(a, b, name=name)
