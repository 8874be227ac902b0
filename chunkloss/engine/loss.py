"""FusedLinearBase: the base module of every chunked loss (the contract it implements:
:mod:`chunkloss.engine.contract`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from chunkloss.engine.batch import Batch
from chunkloss.engine.contract import LossContract
from chunkloss.engine.function import FusedLinearFunction
from chunkloss.engine.options import option_parameters, options_doc

__all__ = ["FusedLinearBase"]


def _first_tensor(args, kwargs) -> Tensor | None:
    """The first tensor among the arguments (looking into a sequence of tensors too)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, Tensor):
            return value
    return None


def _cast(value, dtype: torch.dtype):
    """A floating-point tensor, or each of a sequence of them, in ``dtype`` (a no-op where it has it)."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return [_cast(v, dtype) for v in value]
    return value


def _positional(forward: Callable) -> tuple[str, ...]:
    """The names of ``forward``'s positional parameters, ``self`` left out."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(forward).parameters.values() if p.kind in kinds)[1:]


class _LossType(type):
    """The losses' metaclass: ``dir(cls)``, and so ``help(cls)``, lists what the loss defines and inherits
    from the chunkloss classes, without the hundred methods of ``nn.Module`` (every instance keeps them)."""

    def __dir__(cls):
        names = set()
        for klass in cls.__mro__:
            if klass not in (nn.Module, object):
                names.update(vars(klass))
        return sorted(names)


def _options_init(cls: type) -> Callable:
    """``cls.__init__`` taking ``cls.options_cls``'s fields as keywords (``cls.positional_options`` also by
    position), with that signature and the options' documentation, for ``help()`` and
    ``inspect.signature``."""
    positional = cls.positional_options

    def __init__(self, *args, **options):
        if len(args) > len(positional):
            given = len(args)
            raise TypeError(
                f"{cls.__name__} takes its options by keyword{f' (but {positional})' if positional else ''}, "
                f"got {given} positional argument{'s' if given > 1 else ''}"
            )
        for name, value in zip(positional, args):
            if name in options:
                raise TypeError(f"{cls.__name__} got option {name!r} both by position and by keyword")
            options[name] = value
        super(cls, self).__init__(**options)

    params = option_parameters(cls.options_cls, positional)
    __init__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params]
    )
    __init__.__doc__ = options_doc(cls.options_cls, positional)
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    __init__.generated = True
    return __init__


class FusedLinearBase(LossContract, nn.Module, metaclass=_LossType):
    """Base module of every chunked loss.

    A subclass sets ``options_cls`` (a frozen :class:`~chunkloss.engine.FusedOptions` subclass), defines
    either :meth:`chunk_loss` (a token loss) or :meth:`token_stats` and :meth:`sequence_loss` (a sequence
    loss) as static methods, and a ``forward`` that builds a :class:`~chunkloss.engine.Batch` and returns
    :meth:`run`. The per-chunk functions must be pure functions of their tensors and ``opts``: the engine
    differentiates them with ``torch.func`` and compiles them. Their row tensors hold only the rows that take
    part, in chunk order; a row of one call may land in any chunk.

    After each call ``self.metrics`` holds the loss's metrics by name (detached 0-d tensors, each the sum over
    chunks of the chunk metrics).
    """

    #: Options that may also be given by position, in this order (the others are keyword-only).
    positional_options: tuple[str, ...] = ()
    #: The names of ``forward``'s positional parameters, found once when the class is created: ``__call__``
    #: reads a plain attribute, which torch.compile traces without a graph break (``inspect.signature`` broke
    #: the graph there).
    _forward_positional: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        """A subclass that defines no ``__init__`` gets one from its ``options_cls`` (see ``_options_init``);
        one with its own ``__init__`` passes the options on to ``super().__init__(**options)``."""
        super().__init_subclass__(**kwargs)
        cls._forward_positional = _positional(cls.forward)
        inherited = cls.__init__
        if "__init__" not in cls.__dict__ and (
            inherited is FusedLinearBase.__init__ or getattr(inherited, "generated", False)
        ):
            cls.__init__ = _options_init(cls)

    def __init__(self, **options):
        """Takes the fields of ``options_cls`` as keywords (see the subclass's signature)."""
        super().__init__()
        fields = {f.name for f in dataclasses.fields(self.options_cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                f"{', '.join(sorted(fields))}"
            )
        self.options = self.options_cls(**options)
        self.metrics: dict[str, Tensor] = {}
        self.chunk_sums: dict[str, Tensor] = {}

    def __dir__(self):
        """An instance lists everything, ``nn.Module``'s methods included (``help(cls)`` leaves them out)."""
        return sorted(set(type.__dir__(type(self))) | set(super().__dir__()))

    def __call__(self, *args, **kwargs):
        """Calls ``forward``; under ``torch.autocast`` the heads run in the autocast dtype, as ``nn.Linear``.

        The floating-point tensors of the arguments named in ``head_args`` (the heads' hidden states, weights
        and biases) are cast to the autocast dtype before the loss sees them, as autocast casts a matmul's
        operands, and the loss runs with autocast off: inside the chunk loop every GEMM writes into buffers of
        the inputs' dtype. Autograd carries the gradients back through the casts. Other tensors (labels,
        advantages, log-probs) are left as they are.
        """
        cls = type(self)
        positional = cls._forward_positional
        if len(args) > len(positional):
            raise TypeError(
                f"{cls.__name__} takes {len(positional)} positional arguments ({', '.join(positional)}) but "
                f"{len(args)} were given: pass the others by keyword, e.g. bias=lm_head.bias"
            )
        first = _first_tensor(args, kwargs)
        if first is None:
            return super().__call__(*args, **kwargs)
        device = first.device.type
        if device == "meta":
            named = (*zip(positional, args), *kwargs.items())  # every argument: len(args) <= len(positional)
            name = next(name for name, value in named if _first_tensor((value,), {}) is first)
            raise ValueError(
                f"{name} is on the meta device (a shape without data, as in a model built on device 'meta'): "
                "load or materialise the weights before calling the loss"
            )
        if not torch.is_autocast_enabled(device):
            return super().__call__(*args, **kwargs)
        dtype = torch.get_autocast_dtype(device)
        heads = self.head_args
        args = tuple(_cast(value, dtype) if name in heads else value for name, value in zip(positional, args))
        kwargs = {name: _cast(value, dtype) if name in heads else value for name, value in kwargs.items()}
        with torch.autocast(device, enabled=False):
            return super().__call__(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------
    def run(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, batch: Batch) -> Tensor:
        """Run the chunk loop. ``hidden`` (N, H) is the flattened hidden state, ``batch.rows`` the
        rows that take part. Returns the loss (0-d, or (N,) for per-row outputs)."""
        sums: dict[str, Tensor] = {}
        loss = FusedLinearFunction.apply(hidden, weight, bias, self, batch, sums)
        self.chunk_sums = sums
        self.metrics = dict(sums)
        return loss
