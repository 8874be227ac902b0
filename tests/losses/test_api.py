"""The public surface of every loss: options in the constructor's signature and ``help()``, tensors first
and biases by keyword in ``forward``, and the metrics each loss documents."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re
import typing

import pytest
import torch

import chunkloss.losses as losses
from chunkloss import (
    FusedLinearBase,
    FusedLinearCPOLoss,
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
    FusedLinearKTOLoss,
    FusedLinearORPOLoss,
    FusedLinearPreferenceLoss,
    FusedLinearSimPOLoss,
)

# Every loss class exported by chunkloss.losses, but the preference losses' abstract base.
PUBLIC = [
    getattr(losses, name)
    for name in losses.__all__
    if isinstance(getattr(losses, name), type)
    and issubclass(getattr(losses, name), FusedLinearBase)
    and getattr(losses, name) is not FusedLinearPreferenceLoss
]
KW = inspect.Parameter.KEYWORD_ONLY


def _option_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls.options_cls)}


def test_every_public_loss_is_checked():
    assert {FusedLinearCrossEntropyLoss, FusedLinearDPOLoss, FusedLinearGRPOLoss, FusedLinearJSDLoss} <= set(
        PUBLIC
    )


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_constructor_signature_lists_every_option_with_its_default(cls):
    params = inspect.signature(cls).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert {name: p.default for name, p in params.items()} == _option_defaults(cls)


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_help_shows_and_documents_every_option(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    init = re.search(r"__init__\(self, (.*)\)", text)
    assert init, "help() shows no constructor signature"
    documented = inspect.getdoc(cls.__init__)
    for name in _option_defaults(cls):
        assert re.search(rf"\b{name}\b", init.group(1)), f"{name} not in help()'s signature"
        assert re.search(rf"\b{name}\b", documented), f"{name} not documented in __init__'s Args"


def test_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="label_smothing"):
        FusedLinearCrossEntropyLoss(label_smothing=0.1)


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_forward_takes_tensors_first_and_biases_by_keyword(cls):
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional[0].name.startswith("hidden") and positional[1].name == "weight"
    assert all(p.default is inspect.Parameter.empty for p in positional), "positional arguments are tensors"
    biases = [p for p in params if p.name.endswith("bias")]
    assert biases and all(p.kind is KW for p in biases)
    assert "forward(self, " in pydoc.render_doc(cls.forward, renderer=pydoc.plaintext)


@pytest.mark.parametrize(
    "cls,args",
    [
        (FusedLinearCrossEntropyLoss, lambda h, w, b: (h, w, torch.zeros(2, 3, dtype=torch.long), b)),
        (
            FusedLinearGRPOLoss,
            lambda h, w, b: (h, w, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.zeros(2), b),
        ),
    ],
    ids=["ce", "grpo"],
)
def test_bias_given_by_position_is_refused(cls, args):
    """The error says which arguments are positional and that ``bias=`` is a keyword (was: Python's "takes 4
    positional arguments but 5 were given")."""
    h, w, b = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    match = r"takes \d positional arguments \(hidden, weight, .*\) but \d were given: pass the others"
    with pytest.raises(TypeError, match=match + r" by keyword, e\.g\. bias="):
        cls(compile=False)(*args(h, w, b))


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_help_is_short_and_about_the_loss(cls):
    """``help()`` shows the loss, its options and its contract, not the hundred methods of ``nn.Module`` (was
    1218 lines for the cross-entropy); an instance keeps them all."""
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert len(text.splitlines()) < 400, len(text.splitlines())
    assert "register_forward_hook" not in text and "forward(self, " in text and "metrics" in text
    assert callable(cls(compile=False).register_forward_hook) and "parameters" in dir(cls(compile=False))


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_options_are_declared_once(cls):
    """The constructor is generated from the options dataclass: every option keyword-only (Medusa's
    ``head_weights`` also positional), its annotation the field's, and no ``__init__`` written in the loss."""
    params = inspect.signature(cls).parameters
    hints = typing.get_type_hints(cls.options_cls)
    for name, p in params.items():
        assert p.kind is (inspect.Parameter.POSITIONAL_OR_KEYWORD if name in cls.positional_options else KW)
        assert p.annotation == hints[name], name
    own = [c for c in cls.__mro__ if c.__module__.startswith("chunkloss.losses") and "__init__" in vars(c)]
    assert own and all(getattr(c.__init__, "generated", False) for c in own)


def test_positional_options():
    from chunkloss import FusedLinearMultiTokenLoss

    assert FusedLinearMultiTokenLoss((1.0, 0.5), chunk_size=8).options.head_weights == (1.0, 0.5)
    with pytest.raises(TypeError, match="both by position and by keyword"):
        FusedLinearMultiTokenLoss((1.0,), head_weights=(1.0,))
    with pytest.raises(TypeError, match="takes its options by keyword"):
        FusedLinearCrossEntropyLoss(-100)


# --------------------------------------------------------------------------------------------------
# Metrics: the names each loss reports with its default options, each named in the class docstring.
PAIR = {
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
}
CLIP = {
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
}
DEFAULT_METRICS = {
    FusedLinearCrossEntropyLoss: {"num_tokens"},
    FusedLinearJSDLoss: {"num_tokens", "soft_loss", "entropy"},
    FusedLinearDPOLoss: PAIR,
    FusedLinearORPOLoss: PAIR | {"nll_loss", "log_odds_ratio", "log_odds_chosen"},
    FusedLinearCPOLoss: PAIR | {"nll_loss"},
    FusedLinearSimPOLoss: PAIR,
    FusedLinearGRPOLoss: {"entropy"} | CLIP,
    FusedLinearKTOLoss: (PAIR - {"rewards/accuracies"}) | {"kl"},
}
B, T, H, V = 2, 3, 8, 11


def _call(cls, mod):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2 * B if issubclass(cls, FusedLinearPreferenceLoss) else B, T, H, generator=g)
    w = torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    if cls is FusedLinearCrossEntropyLoss:
        return mod(h, w, y)
    if cls is FusedLinearJSDLoss:
        return mod(h, w, torch.randn(B, T, 5, generator=g), torch.randn(V, 5, generator=g), y)
    if cls is FusedLinearGRPOLoss:
        return mod(h, w, y, torch.ones(B, T), torch.randn(B, generator=g))
    if cls is FusedLinearKTOLoss:
        logps = dict(ref_logps=torch.randn(B, generator=g), kl_logps=torch.randn(B, generator=g))
        return mod(h, w, y, torch.tensor([True, False]), ref_kl_logps=torch.randn(B, generator=g), **logps)
    return mod(h, w, y, torch.randint(0, V, (B, T), generator=g))


@pytest.mark.parametrize("cls", list(DEFAULT_METRICS), ids=lambda c: c.__name__)
def test_default_metrics_are_documented(cls):
    mod = cls(compile=False)
    _call(cls, mod)
    assert set(mod.metrics) == DEFAULT_METRICS[cls]
    assert all(v.dim() == 0 and not v.requires_grad for v in mod.metrics.values())
    for name in DEFAULT_METRICS[cls]:
        assert f"``{name}``" in cls.__doc__, f"{name} not documented in {cls.__name__}'s docstring"
