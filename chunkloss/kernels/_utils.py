"""Launch plans shared by the row kernels, and the one place the kernels' custom ops are defined.

Everything here runs on the host once per call, so it is plain integer arithmetic (``triton.cdiv`` and
``triton.next_power_of_2`` are constexpr functions that cost ~4 us each on the host) and the norms' plans
are cached per shape.
"""

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Generic, NamedTuple, TypeVar

import torch

OP_NAMESPACE = "chunkloss"

_log = logging.getLogger("chunkloss.kernels")
# Every chunkloss op defined in this process: qualname -> "module (file)" of the function that defined it.
_DEFINED: dict[str, str] = {}


def custom_op(name: str, *, mutates_args: Iterable[str] | str = (), **kwargs) -> Callable:
    """``torch.library.custom_op(f"chunkloss::{name}", mutates_args=mutates_args, **kwargs)`` as a decorator,
    refused with a ``RuntimeError`` when the process has defined that op before.

    ``torch.library.custom_op`` replaces an op defined again under the same name and frees the first
    definition's schema under every ``OpOverload`` already handed out (a graph traced earlier, dynamo's
    caches): later calls fail far from the cause (``vector::reserve``, ``schema_.has_value()``, a segfault).
    A module's body runs once per process, however often it is imported, so a second definition always means
    a second module object (a module imported under two names, reloaded, or found in a second copy of
    chunkloss on ``sys.path``) or a factory of ops, which must give each op a name of its own. Each definition
    is logged at DEBUG on the ``chunkloss.kernels`` logger.
    """
    qualname = f"{OP_NAMESPACE}::{name}"

    def define(fn: Callable) -> Callable:
        where = f"{fn.__module__} ({fn.__code__.co_filename})"
        first = _DEFINED.get(qualname)
        if first is None and hasattr(getattr(torch.ops, OP_NAMESPACE), name):
            first = "a definition outside this copy of chunkloss.kernels (a second copy on sys.path?)"
        if first is not None:
            raise RuntimeError(
                f"{qualname} is defined twice: by {first}, then by {where}; redefining it would free the "
                "first definition under every graph that holds it. Import each chunkloss.kernels module "
                "once, by one name (no reload, no second copy of chunkloss on sys.path)"
            )
        op = torch.library.custom_op(qualname, fn, mutates_args=mutates_args, **kwargs)
        _DEFINED[qualname] = where
        _log.debug("defined custom op %s in %s", qualname, where)
        return op

    return define


def defined_ops() -> dict[str, str]:
    """The chunkloss custom ops this process has defined: qualname -> the module (and file) defining it."""
    return dict(_DEFINED)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def arguments_of(fn, *args, **kwargs) -> dict:
    """The arguments of the call ``fn(*args, **kwargs)`` by name, defaults filled in (a ``*_ref`` takes the
    arguments of its kernel); a ``TypeError`` for a name ``fn`` does not take."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cheap lru_cache key
class NormLaunchOptions:
    """Launch parameters of RMSNorm and LayerNorm (swept on an H100; docs/design.md, "Triton kernels").

    Rows up to ``max_fused_cols`` wide are normalised from one register tile per program ("fused"); wider rows
    loop over column blocks of ``loop_block_n`` in two passes ("looped"), so no thread holds a whole fp32 row
    (a 16384-wide tile spills registers).
    """

    max_fused_cols: int = 8192
    # RMSNorm's one-tile path still wins at 16384 though it spills; LayerNorm's spills more and loses.
    rms_max_fused_cols: int = 16384
    tile_elems: int = 4096  # fused: rows per program = tile_elems // BLOCK_N (1..64), for short rows
    warp_scale: float = 1.0  # fused: multiplies row_warps()
    # Fused backward programs per SM, each looping over its rows, and the software-pipeline stages of that
    # loop on a GPU (the interpreter runs a plain loop); one program per SM also keeps the fp32 dW partials
    # at Liger's size. 16384-wide tiles (RMSNorm only) run without stages.
    bwd_programs_per_sm: int = 1  # BLOCK_N <= 4096
    bwd_programs_per_sm_wide: int = 1  # BLOCK_N > 4096
    bwd_stages: int = 4  # BLOCK_N <= 4096
    bwd_stages_wide: int = 3  # BLOCK_N == 8192; none for 16384
    # Looped path: the best of 144 configurations for both norms at 16384 x 16384.
    loop_block_n: int = 4096  # columns per step
    loop_block_m: int = 4  # backward rows per step (each step adds into the dW partial row once)
    loop_warps: int = 16
    loop_bwd_programs_per_sm: int = 1


@functools.lru_cache
def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability ``(major, minor)`` of ``device``; None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)


LaunchOptionsT = TypeVar("LaunchOptionsT")


class LaunchTable(Generic[LaunchOptionsT]):
    """One kernel family's launch options per GPU architecture, with an explicit override.

    Launchers call :meth:`get` with their input's device: the setting of that device's compute capability
    if the table has one, else ``default``. :meth:`use` selects other settings for the code inside a
    ``with`` block (tests force paths the defaults do not take at small shapes); it is thread- and
    task-local (a ``ContextVar``), and restored on the way out of an error too.
    """

    def __init__(
        self,
        name: str,
        default: LaunchOptionsT,
        by_capability: dict[tuple[int, int], LaunchOptionsT] | None = None,
    ):
        self.default = default
        self.by_capability = dict(by_capability or {})
        self._forced: contextvars.ContextVar[LaunchOptionsT | None] = contextvars.ContextVar(
            name, default=None
        )

    def for_capability(self, cap: tuple[int, int] | None) -> LaunchOptionsT:
        """The table's setting for compute capability ``cap`` (``default`` when it has none)."""
        return self.by_capability.get(cap, self.default)

    def get(self, device: torch.device) -> LaunchOptionsT:
        """The setting a launch on ``device`` uses: the one :meth:`use` selected, else the table's."""
        forced = self._forced.get()
        return forced if forced is not None else self.for_capability(capability(device))

    @contextlib.contextmanager
    def use(self, device: torch.device | None = None, **changes):
        """Launch with fields of the current setting (``device``'s, else ``default``, or the one an outer
        :meth:`use` selected) replaced by ``changes``; yields the setting in force."""
        base = self._forced.get() or (self.get(device) if device is not None else self.default)
        token = self._forced.set(dataclasses.replace(base, **changes))
        try:
            yield self._forced.get()
        finally:
            self._forced.reset(token)


# sm90 (H100, H200): the sweep behind NormLaunchOptions' defaults. Other architectures take the defaults until
# a sweep on them gives a row here.
NORM_LAUNCH: LaunchTable[NormLaunchOptions] = LaunchTable(
    "norm", NormLaunchOptions(), {(9, 0): NormLaunchOptions()}
)


def norm_launch_options(device: torch.device | None = None, **changes):
    """``NORM_LAUNCH.use(device, **changes)``, a forced ``max_fused_cols`` applying to both norms unless
    RMSNorm's own is given (tests force the looped path at small widths with
    ``norm_launch_options(max_fused_cols=16, loop_block_n=16)``)."""
    if "max_fused_cols" in changes:
        changes.setdefault("rms_max_fused_cols", changes["max_fused_cols"])
    return NORM_LAUNCH.use(device, **changes)


@functools.lru_cache(maxsize=16)
def rms_launch_options(launch: NormLaunchOptions) -> NormLaunchOptions:
    """``launch`` with RMSNorm's own fused-row threshold."""
    return dataclasses.replace(launch, max_fused_cols=launch.rms_max_fused_cols)


def row_warps(block: int) -> int:
    """More warps for wider rows so each thread keeps roughly 16-32 elements in registers."""
    if block >= 16384:
        return 16
    if block >= 4096:
        return 8
    if block >= 1024:
        return 4
    return 2 if block >= 256 else 1


class FwdPlan(NamedTuple):
    n_programs: int
    block_m: int  # rows per program (fused); 1 when looped
    block_n: int  # whole row (fused) or one column block (looped)
    num_warps: int
    looped: bool


class BwdPlan(NamedTuple):
    n_programs: int  # persistent programs, one fp32 row of dW (and dB) partial sums each
    rows_per_program: int  # contiguous rows per program, a multiple of block_m
    block_m: int
    block_n: int
    num_warps: int
    looped: bool
    stages: int = 0  # fused: pipeline stages of the row loop (0 on CPU / the interpreter)

    @property
    def switches(self) -> dict:
        """The backward kernel's compile-time switches: the looped path, or the fused path's stages."""
        return {"LOOPED": self.looped, "STAGES": 0 if self.looped else self.stages}


def _fused_tile(n_cols: int, launch: NormLaunchOptions) -> tuple[int, int, int]:
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(64, launch.tile_elems // block_n))
    num_warps = max(1, min(32, int(row_warps(block_m * block_n) * launch.warp_scale)))
    return block_m, block_n, num_warps


@functools.lru_cache(maxsize=512)
def norm_fwd_plan(n_rows: int, n_cols: int, launch: NormLaunchOptions) -> FwdPlan:
    """One program per ``block_m`` rows (fused) or per row (looped)."""
    if n_cols > launch.max_fused_cols:
        block_n = min(launch.loop_block_n, next_power_of_2(n_cols))
        return FwdPlan(n_rows, 1, block_n, launch.loop_warps, True)
    block_m, block_n, num_warps = _fused_tile(n_cols, launch)
    return FwdPlan(cdiv(n_rows, block_m), block_m, block_n, num_warps, False)


@functools.lru_cache(maxsize=512)
def norm_bwd_plan(n_rows: int, n_cols: int, device: torch.device, launch: NormLaunchOptions) -> BwdPlan:
    """Persistent backward: each program takes a contiguous block of rows and writes one row of partial dW
    (and dB) sums, which the launcher adds up."""
    if n_cols > launch.max_fused_cols:
        looped = True
        block_m, block_n = launch.loop_block_m, min(launch.loop_block_n, next_power_of_2(n_cols))
        num_warps, per_sm = launch.loop_warps, launch.loop_bwd_programs_per_sm
    else:
        looped = False
        block_m, block_n, num_warps = _fused_tile(n_cols, launch)
        per_sm = launch.bwd_programs_per_sm if block_n <= 4096 else launch.bwd_programs_per_sm_wide
    n_programs = max(1, min(num_sms(device) * per_sm, cdiv(n_rows, block_m)))
    rows_per_program = max(1, cdiv(cdiv(n_rows, n_programs), block_m)) * block_m  # >= 1 step, even for 0 rows
    stages = launch.bwd_stages if block_n <= 4096 else launch.bwd_stages_wide if block_n <= 8192 else 0
    stages = stages if device.type == "cuda" else 0
    n_programs = cdiv(n_rows, rows_per_program)
    return BwdPlan(n_programs, rows_per_program, block_m, block_n, num_warps, looped, stages)


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (a small stand-in on CPU / the Triton interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index rows through a stride but assume unit stride inside a row."""
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_dx_buffer(dy: torch.Tensor, x: torch.Tensor, needs_dx: bool, in_place: bool) -> torch.Tensor | None:
    """Where the norms' backward writes dx. It may overwrite dy only if the caller promised dy is not
    shared (``in_place``) and the dtypes and layout let the rows line up."""
    if not needs_dx:
        return None
    if in_place and dy.dtype == x.dtype and dy.is_contiguous():
        return dy
    return torch.empty_like(x)
