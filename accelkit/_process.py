"""Process facts and control: who am I, wait for the others, run on some ranks only."""

from __future__ import annotations

import builtins
import contextlib
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec

from . import _state
from ._options import is_int
from ._state import ProcessState

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

P = ParamSpec("P")
R = TypeVar("R")
RunningStrategy = Literal["single", "ddp", "fsdp", "deepspeed"]

__all__ = [
    "check_breakpoint",
    "device",
    "is_local_main_process",
    "is_main_process",
    "local_main_process_first",
    "local_rank",
    "main_process_first",
    "mesh",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "print",
    "rank",
    "set_breakpoint",
    "set_seed",
    "state",
    "strategy",
    "wait_for_everyone",
    "world_size",
]


def state() -> ProcessState:
    """The process state, created on first use.

    Example:
        >>> import accelkit as ak
        >>> ak.state().rank
        0
    """
    return _state.get()


def rank() -> int:
    """This process's global rank (0 on a single process)."""
    return _state.get().rank


def world_size() -> int:
    """The number of processes in the job."""
    return _state.get().world_size


def local_rank() -> int:
    """This process's rank on its node."""
    return _state.get().local_rank


def device() -> torch.device:
    """The device this process computes on (``cuda:<local_rank>``, ``cpu``, ...)."""
    return _state.get().device


def is_main_process() -> bool:
    """Whether this is global rank 0."""
    return _state.get().is_main_process


def is_local_main_process() -> bool:
    """Whether this is rank 0 of its node."""
    return _state.get().is_local_main_process


def strategy() -> RunningStrategy:
    """How this job trains: ``"single"`` (one process), ``"ddp"``, ``"fsdp"`` or ``"deepspeed"``.

    Accelerate's ``accelerator.distributed_type``: ``DistributedType.NO`` is ``"single"``,
    ``MULTI_GPU`` / ``MULTI_CPU`` are ``"ddp"`` (the device says which: ``ak.device().type``).
    ``strategy="fsdp"`` with one process runs unsharded, so it is ``"single"`` here; DeepSpeed
    runs its engine with any number of processes, so it stays ``"deepspeed"``.

    Example:
        >>> import accelkit as ak
        >>> ak.strategy()
        'single'
    """
    chosen = _state.strategy()
    return cast(RunningStrategy, chosen.name)


def mesh() -> DeviceMesh | None:
    """This job's device mesh: torch's ``DeviceMesh``, its dimensions named; None with one process.

    With the mesh's sizes set (``dp_replicate``, ``dp_shard``, ``tp``), its dimensions are those
    larger than 1, outermost first: ``"dp_replicate"``, ``"dp_shard"`` (beside ``dp_replicate``
    always: HSDP's), ``"tp"``. Without: one dimension over every process, ``"dp_shard"`` under
    FSDP, ``"dp_replicate"`` under DDP. ``ak.mesh()["tp"].get_group()`` is torch's process group of
    that dimension. Every rank must call it the first time (it forms the mesh's groups).

    Example:
        >>> import accelkit as ak
        >>> ak.mesh() is None  # one process
        True
    """
    if not _state.get().distributed:
        return None
    found: DeviceMesh | None = _state.strategy().device_mesh()
    return found


def wait_for_everyone() -> None:
    """Block until every process reaches this call (a barrier). Every rank must call it.

    Example:
        >>> import accelkit as ak
        >>> ak.wait_for_everyone()
    """
    st = _state.get()
    if st.distributed:
        from ._collectives import barrier

        barrier(st)


def print(*args: Any, **kwargs: Any) -> None:
    """``print`` on the main process only.

    Args:
        *args: what ``print`` takes.
        **kwargs: ``print``'s keyword arguments (``sep``, ``end``, ``file``, ``flush``).

    Example:
        >>> import accelkit as ak
        >>> ak.print("loss", 0.5)
        loss 0.5
    """
    if _state.get().is_main_process:
        builtins.print(*args, **kwargs)


def _only_when(decide: Callable[[ProcessState], bool]) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    def wrapper(wrapped: Callable[..., R], instance: Any, args: Any, kwargs: Any) -> R | None:
        return wrapped(*args, **kwargs) if decide(_state.get()) else None

    import wrapt  # where a function is decorated: import accelkit stays without it

    return cast("Callable[[Callable[P, R]], Callable[P, R | None]]", wrapt.decorator(wrapper))  # type: ignore[arg-type]


@overload
def on_main_process(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_main_process() -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
def on_main_process(fn: Any = None, /) -> Any:
    """Run the function on the main process only; elsewhere it returns ``None``.

    Decided at each call, so the same decorated function works on every rank.

    Args:
        fn: the function to decorate.

    Example:
        >>> import accelkit as ak
        >>> @ak.on_main_process
        ... def save() -> str:
        ...     return "saved"
        >>> save()
        'saved'
    """
    deco = _only_when(lambda st: st.is_main_process)
    return deco if fn is None else deco(fn)


@overload
def on_local_main_process(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_local_main_process() -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
def on_local_main_process(fn: Any = None, /) -> Any:
    """Run the function on each node's local main process only; elsewhere return ``None``.

    Args:
        fn: the function to decorate.

    Example:
        >>> import accelkit as ak
        >>> @ak.on_local_main_process
        ... def download() -> bool:
        ...     return True
        >>> download()
        True
    """
    deco = _only_when(lambda st: st.is_local_main_process)
    return deco if fn is None else deco(fn)


def on_process(rank: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the function on global rank ``rank`` only; elsewhere it returns ``None``.

    Args:
        rank: the global rank that runs the function.

    Example:
        >>> import accelkit as ak
        >>> @ak.on_process(0)
        ... def report() -> int:
        ...     return 42
        >>> report()
        42
    """
    if callable(rank):
        raise TypeError(
            f"@accelkit.on_process needs the rank to run on; write @ak.on_process(0) "
            f"above {getattr(rank, '__qualname__', rank)!r}"
        )
    if not is_int(rank) or rank < 0:
        raise ValueError(f"accelkit.on_process(rank={rank!r}): expected a global rank, an integer >= 0")
    return _only_when(lambda st: st.rank == rank)


@contextlib.contextmanager
def _first(is_first: Callable[[ProcessState], bool]) -> Iterator[None]:
    st = _state.get()
    if not is_first(st):
        wait_for_everyone()
    try:
        yield
    finally:
        # Reached even when the body raises, so that the other ranks are never stranded.
        if is_first(st):
            wait_for_everyone()


def main_process_first() -> contextlib.AbstractContextManager[None]:
    """The main process runs the body first; the others run it once it is done.

    Every rank must enter it. Typical use: download or preprocess once, then read the cache.

    Example:
        >>> import accelkit as ak
        >>> with ak.main_process_first():
        ...     data = list(range(3))
    """
    return _first(lambda st: st.is_main_process)


def local_main_process_first() -> contextlib.AbstractContextManager[None]:
    """Like :func:`main_process_first`, per node: each local main process goes first."""
    return _first(lambda st: st.is_local_main_process)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's (if installed) and torch's generators on every device.

    Args:
        seed: the seed.
        device_specific: add the rank to the seed, so that ranks draw different numbers.
        deterministic: make torch choose deterministic algorithms.

    Example:
        >>> import accelkit as ak
        >>> ak.set_seed(0)
    """
    if not is_int(seed):
        raise TypeError(f"accelkit.set_seed(seed={seed!r}): expected an integer, e.g. set_seed(42)")
    if device_specific:
        seed += _state.get().rank
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds the CPU and every accelerator's default generator
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def set_breakpoint() -> None:
    """Ask every process to stop at the next :func:`check_breakpoint` (any rank may ask)."""
    _state.this_process.request_breakpoint()


def check_breakpoint() -> bool:
    """Whether any rank called :func:`set_breakpoint` since the last check; clears it.

    Every rank must call it (one small all-reduce), so that all ranks agree.

    Example:
        >>> import accelkit as ak
        >>> ak.set_breakpoint()
        >>> ak.check_breakpoint(), ak.check_breakpoint()
        (True, False)
    """
    st = _state.get()
    flag = _state.this_process.take_breakpoint()
    if not st.distributed:
        return flag
    from ._collectives import any_rank

    return any_rank(st, "check_breakpoint", flag)
