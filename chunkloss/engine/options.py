"""The options every chunked loss takes, the automatic chunk size (see docs/design.md, "Chunk size"), and a
loss constructor's parameters and documentation read from its options dataclass."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_LOGITS_BUDGET_MB",
    "FusedOptions",
    "check_chunk_size",
    "default_chunk_size",
    "option_parameters",
    "options_doc",
]

#: Memory for one chunk's logits and their gradient when no ``chunk_size`` is given (docs/design.md, "Chunk
#: size").
DEFAULT_LOGITS_BUDGET_MB = 448


@dataclass(frozen=True)
class FusedOptions:
    """Options every chunked loss takes.

    Args:
        chunk_size: rows of logits per chunk; ``None`` picks one from ``logits_budget_mb``.
        logits_budget_mb: memory for one chunk's logits and their gradient, used when ``chunk_size`` is
            ``None``. Token losses without extra heads that accumulate the weight gradient in fp32 use at
            least the weight gradient's own size, and on CUDA all of a call's rows as one chunk where their
            logits fit the fp32 accumulator's bytes (see ``chunkloss.engine.plan.chunk_rows``).
        accum_dtype: dtype of the weight/bias gradient accumulator across chunks; ``None`` uses the
            weight's own dtype (saves 4·V·H bytes at bf16, loses some precision).
        compile: run the per-chunk math under ``torch.compile`` (or a Triton step where the loss registered
            one, on CUDA).
    """

    chunk_size: int | None = None
    logits_budget_mb: int = DEFAULT_LOGITS_BUDGET_MB
    accum_dtype: torch.dtype | None = torch.float32
    compile: bool = True

    def __post_init__(self):
        check_chunk_size(self.chunk_size)
        if self.logits_budget_mb <= 0:
            raise ValueError(f"logits_budget_mb must be positive, got {self.logits_budget_mb!r}")


def check_chunk_size(chunk_size) -> None:
    """Raise ``ValueError`` unless ``chunk_size`` is a positive int or None."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def default_chunk_size(
    vocab: int, itemsize: int, budget_mb: int, extra_vocab: int = 0, grad_in_place: bool = False
) -> int:
    """Rows per chunk so that one chunk's logits, their gradient (in place when compiled) and the logits
    of heads without grad (``extra_vocab``: summed vocabularies of a reference/teacher head) fit in
    ``budget_mb``.

    Rounded down to a multiple of 128 (whole tensor-core tiles) and kept in [128, 16384]: fewer rows leave
    the GEMM's M dimension too thin to keep the GPU busy.
    """
    rows = budget_mb * 2**20 // (((1 if grad_in_place else 2) * vocab + extra_vocab) * max(itemsize, 2))
    return int(min(16384, max(128, rows // 128 * 128)))


def option_parameters(options_cls: type, positional: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """The constructor parameters of a loss whose options are ``options_cls``'s fields: keyword-only, with the
    fields' defaults and types, the loss's own options first and the engine's (:class:`FusedOptions`) last;
    the ``positional`` ones lead, positional-or-keyword."""
    try:
        hints = typing.get_type_hints(options_cls)
    except Exception:  # an annotation that names a type imported only for type checkers: keep its text
        hints = {}
    engine = {f.name for f in dataclasses.fields(FusedOptions)}
    fields = [f for f in dataclasses.fields(options_cls) if f.init]
    fields.sort(key=lambda f: (f.name not in positional, f.name in engine))
    params = []
    for f in fields:
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if f.name in positional
            else inspect.Parameter.KEYWORD_ONLY
        )
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=hints.get(f.name, f.type)))
    return params


_ARG = re.compile(r"^(\s*)([A-Za-z_][\w, ]*):(\s.*|)$")


def _args_entries(doc: str | None) -> list[tuple[tuple[str, ...], str]]:
    """The entries of a Google-style ``Args:`` section: (names, text with its continuation lines)."""
    if not doc:
        return []
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:") + 1
    except StopIteration:
        return []
    entries, indent = [], None
    for line in lines[start:]:
        if not line.strip():
            continue
        m = _ARG.match(line)
        depth = len(line) - len(line.lstrip())
        if m and (indent is None or depth == indent):
            indent = depth
            names = tuple(n.strip() for n in m.group(2).split(","))
            entries.append((names, m.group(3).strip()))
        elif indent is not None and depth > indent and entries:
            names, text = entries[-1]
            entries[-1] = (names, f"{text} {line.strip()}")
        else:
            break
    return entries


def options_doc(options_cls: type, positional: tuple[str, ...] = ()) -> str:
    """A Google-style ``Args:`` section of every option of ``options_cls``, in :func:`option_parameters`'
    order, from the ``Args:`` sections of the docstrings along its bases (a subclass's entry wins)."""
    entries: dict[str, tuple[tuple[str, ...], str]] = {}
    for klass in options_cls.__mro__:
        for names, text in _args_entries(klass.__dict__.get("__doc__")):
            for name in names:
                entries.setdefault(name, (names, text))
    out, seen = [f"The fields of :class:`{options_cls.__name__}`, by keyword.", "", "Args:"], set()
    for p in option_parameters(options_cls, positional):
        names, text = entries.get(p.name, ((p.name,), ""))
        if names in seen:
            continue
        seen.add(names)
        entry = f"{', '.join(names)}: {text}".rstrip()
        out += textwrap.wrap(entry, 106, initial_indent="    ", subsequent_indent="        ")
    return "\n".join(out)
