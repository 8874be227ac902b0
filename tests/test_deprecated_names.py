"""Names that moved keep working for a release: the old name warns once (DeprecationWarning) and gives the
new object."""

from __future__ import annotations

import importlib
import sys
import warnings

import chunkloss.testing.reference as reference


def test_reference_module_alias_warns_once(monkeypatch):
    monkeypatch.delitem(sys.modules, "chunkloss.reference", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("chunkloss.reference")
        again = importlib.import_module("chunkloss.reference")
        from chunkloss.reference import grpo_ref
    moved = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(moved) == 1 and "chunkloss.testing.reference" in str(moved[0].message)
    assert again is old
    assert grpo_ref is reference.grpo_ref
    assert old.rloo_loss_from_logps_ref is reference.rloo_loss_from_logps_ref
    assert "kto_ref" in dir(old)
