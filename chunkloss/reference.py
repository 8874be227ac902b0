"""Deprecated alias of :mod:`chunkloss.testing.reference`, where the fp32 references moved; importing it
warns once."""

import warnings

from chunkloss.testing import reference as _reference

warnings.warn(
    "chunkloss.reference moved to chunkloss.testing.reference; the old name goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    return getattr(_reference, name)


def __dir__() -> list[str]:
    return dir(_reference)
