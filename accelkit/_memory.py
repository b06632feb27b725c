"""``@ak.find_executable_batch_size`` and ``ak.free_memory``: retry with half the batch on OOM.

With several processes every attempt ends at an agreement, so that all ranks run every
attempt with the same batch size and retry (or stop) together:

1. A rank whose attempt failed with an out-of-memory error (or with a communication error,
   see 2) first *breaks* its process group: it clears the failed attempt's frames, destroys
   the group and collects garbage. Gloo closes a group's connections when the group is freed,
   so a peer blocked in a collective of the same step (say DDP's gradient all-reduce, waiting
   for this rank) fails at once with "Connection closed by peer" instead of waiting for the
   collective timeout, and instead of matching a later collective of this rank by mistake.
2. A rank whose collective failed that way treats it as "a peer failed" and breaks its own
   group in turn (with three or more ranks the failure travels on).
3. Every rank then reports its outcome in the job's key-value store (the TCPStore under the
   process group, not the group itself, which may be broken or busy) and waits until all ranks
   have reported: a barrier that cannot be confused with a collective of the user's function.
4. All succeeded: done, the group is untouched. Some rank ran out of memory: every rank joins
   a fresh group (``_state.reform_group``, new store prefix) and retries with half the size.
   Only communication errors: the group is re-formed, the failed ranks re-raise their error.
   A rank that raised anything else re-raises it at once; its report makes the other ranks
   raise too, instead of waiting.

Limits. Freeing the group needs its last reference to go: a DDP model or subgroup kept
*outside* the decorated function keeps the old group's connections open, so a peer blocked in
a collective waits for the collective timeout (``timeout`` option) before the retry; that
model is also bound to the destroyed group and fails on its next collective, so prepare the
model inside the function (as below). NCCL does not unblock a peer when a communicator goes
away either: there a blocked peer fails at the timeout (its watchdog may end the process, and
the launcher's ``max_restarts`` restarts the job). The ranks wait for each other at the end of
each attempt for at most the timeout plus a minute.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec

from . import _state
from ._backends import select_backend
from ._options import is_int
from .errors import NoExecutableBatchSizeError

if TYPE_CHECKING:
    from ._oom_agreement import Team

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["find_executable_batch_size", "free_memory"]

# What allocators put in the RuntimeError they raise when memory runs out ("CUDA out of memory.",
# "CPU out of memory.", "XPU ...", "CUDA error: out of memory": all contain " out of memory").
_OOM_MESSAGES = (
    " out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory", "PT_DEVMEM Allocation failed",
)  # fmt: skip


@overload
def find_executable_batch_size(function: Callable[Concatenate[int, P], R], /) -> Callable[P, R]: ...
@overload
def find_executable_batch_size(
    *, starting_batch_size: int = 128
) -> Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]: ...
def find_executable_batch_size(function: Any = None, /, *, starting_batch_size: int = 128) -> Any:
    """Call the function with ``starting_batch_size``, halving it after each out-of-memory error.

    The function takes the batch size as its first argument; callers leave it out. Out of
    memory means ``torch.OutOfMemoryError`` (or ``MemoryError``) or an allocator's message
    (CUDA, XPU, MPS, CPU). Memory is freed and the retry logged each time; each call starts
    again from ``starting_batch_size``; past 1 a :class:`~accelkit.NoExecutableBatchSizeError`
    (a ``RuntimeError``) lists the sizes tried. Other errors propagate at once. With several
    processes every rank always uses the same batch size (see the module's notes); build the
    model and optimizer inside the function.

    Args:
        function: the function to call; it takes the batch size as its first argument.
        starting_batch_size: the batch size tried first.

    Example:
        >>> import accelkit as ak, torch
        >>> @ak.find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size: int, epochs: int = 1) -> int:
        ...     if batch_size > 16:
        ...         raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        ...     return batch_size
        >>> train(epochs=2)
        16
    """
    if function is None:
        start = _check_start(starting_batch_size)
        return lambda f: _wrap(f, start)
    if is_int(function):
        raise TypeError(
            f"@accelkit.find_executable_batch_size({function!r}): the starting size is a keyword argument; "
            f"did you mean @ak.find_executable_batch_size(starting_batch_size={function!r})?"
        )
    return _wrap(function, _check_start(starting_batch_size))


def free_memory(*objects: object) -> list[None]:
    """Collect garbage and empty the device's cache; one ``None`` per object passed.

    Rebind the names to the result, as below: the objects go with their last reference.
    Whatever is unreachable (cycles included) is freed here; call ``ak.free_memory()``
    again to hand the rebound objects' cached device memory back too.

    Args:
        *objects: objects to let go of: rebind their names to the result.

    Example:
        >>> import accelkit as ak, torch
        >>> model, optimizer = torch.nn.Linear(2, 2), None
        >>> model, optimizer = ak.free_memory(model, optimizer)
        >>> model is None
        True
    """
    count = len(objects)
    del objects
    _collect()
    return [None] * count


@functools.cache
def _batch_size_function() -> Any:
    """The class of what ``@find_executable_batch_size`` returns (wrapt is imported where one is made)."""
    import wrapt

    class BoundBatchSizeFunction(wrapt.BoundFunctionWrapper):  # type: ignore[type-arg]
        """A decorated method: ``self`` (when unbound) comes before the batch size."""

        @property
        def __signature__(self) -> inspect.Signature:
            unbound = self._self_instance is None  # Class.method: the signature still has self
            return _without_batch_size(inspect.signature(self.__wrapped__), skip=int(unbound))

        @property
        def __func__(self) -> Callable[..., Any]:
            # inspect.signature sees a method (wrapt proxies __class__): it drops the first
            # parameter of __func__'s signature, which therefore must be self's.
            function = functools.partial(cast("Any", self.__wrapped__).__func__)
            function.__signature__ = _without_batch_size(inspect.signature(function.func), skip=1)  # type: ignore[attr-defined]
            return function

    class BatchSizeFunction(wrapt.FunctionWrapper):  # type: ignore[type-arg]
        """What ``@find_executable_batch_size`` returns: the function, minus ``batch_size``."""

        __bound_function_wrapper__ = BoundBatchSizeFunction

        @property
        def __signature__(self) -> inspect.Signature:
            return _without_batch_size(inspect.signature(self.__wrapped__))

    return BatchSizeFunction


def _wrap(function: Callable[..., R], start: int) -> Callable[..., R]:
    if not callable(function):
        raise TypeError(
            f"@accelkit.find_executable_batch_size must decorate a function, got {function!r}; "
            f"write @ak.find_executable_batch_size or @ak.find_executable_batch_size(starting_batch_size=64)"
        )
    params = _parameters(function)
    if params is not None and (not params or params[0].kind not in (*_POSITIONAL, inspect.Parameter.VAR_POSITIONAL)):
        raise TypeError(
            f"@accelkit.find_executable_batch_size: {_name(function)}{inspect.signature(function)} must take "
            f"the batch size as its first positional parameter, e.g. def {_name(function)}(batch_size: int, ...)"
        )

    def wrapper(wrapped: Callable[..., R], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        _check_call(wrapped, args, kwargs)
        return _run(wrapped, start, args, kwargs)

    return cast("Callable[..., R]", _batch_size_function()(function, wrapper))


def _run(fn: Callable[..., R], start: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
    if start == 0:  # as Accelerate: a zero start is a call that finds nothing, not a decoration error
        raise NoExecutableBatchSizeError(
            f"accelkit.find_executable_batch_size: no executable batch size found for {_name(fn)}: "
            f"starting_batch_size=0; start from a positive size, e.g. starting_batch_size=128"
        )
    from ._oom_agreement import Team, is_lost_peer, summary  # what an out-of-memory retry needs, on its first call

    team = Team.join()
    batch_size, tried = start, []
    while True:
        tried.append(batch_size)
        failure, kind = None, ""
        try:
            result = fn(batch_size, *args, **kwargs)
        except Exception as exc:
            kind = "oom" if _is_out_of_memory(exc) else "comm" if team and is_lost_peer(exc) else "error"
            if kind == "error":
                if team is not None:
                    team.report_error(batch_size, exc)
                raise
            failure = exc
            _release(failure, team)
        if team is None:
            if failure is None:
                return result
            where = f": {summary(failure)}"
        else:
            verdict = team.agree(batch_size, kind, failure)
            if not verdict.failures:
                return result
            team.recover(verdict, f"{_name(fn)}(batch_size={batch_size})", failure)
            where = f" on {verdict.describe('oom')}"
        if batch_size == 1:
            raise NoExecutableBatchSizeError(
                f"accelkit.find_executable_batch_size: no executable batch size found for {_name(fn)}: it ran out "
                f"of memory with every batch size tried ({', '.join(map(str, tried))}). Last error{where}. Make "
                f"the model or the inputs smaller."
            ) from failure
        _warn(
            f"{_name(fn)}(batch_size={batch_size}) ran out of memory{where}; retrying with batch_size={batch_size // 2}"
        )
        batch_size //= 2


def _release(failure: Exception, team: Team | None) -> None:
    """Free the failed attempt's memory; with several processes, break the group first."""
    from ._oom_agreement import break_group, drop_frames

    drop_frames(failure)  # its tensors go now, not with the error that may be chained at the end
    old_group = break_group() if team is not None else None
    _collect()
    if team is not None and old_group is not None and old_group() is not None:
        _warn(
            "the process group is still referenced after this rank's failure (by a DDP model or a subgroup "
            "created outside the decorated function?), so a process blocked in a collective waits up to the "
            f"timeout ({team.st.options.timeout:g} s) before the retry",
            main_process_only=False,
        )


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def _collect() -> None:
    gc.collect()
    hardware = _state.get().hardware if _state.is_initialized() else select_backend()
    if hardware is not None:
        hardware.empty_cache()


def _warn(message: str, main_process_only: bool = True) -> None:
    from .logging import get_logger

    get_logger(__name__).warning(f"find_executable_batch_size: {message}", main_process_only=main_process_only)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a batch size from the caller: by keyword, or as one positional argument too many."""
    params = _parameters(fn)
    if not params or params[0].kind not in _POSITIONAL:
        return
    first, positional = params[0], sum(p.kind in _POSITIONAL for p in params)
    by_keyword = first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and first.name in kwargs
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if not by_keyword and (variadic or len(args) < positional):
        return
    rest = [*map(repr, args if by_keyword else args[1:]), *(f"{k}={v!r}" for k, v in kwargs.items() if k != first.name)]
    raise TypeError(
        f"{_name(fn)}() was called with a batch size, but {first.name} is supplied by "
        f"@accelkit.find_executable_batch_size; call {_name(fn)}({', '.join(rest)}) without it"
    )


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature
        return None


def _without_batch_size(sig: inspect.Signature, skip: int = 0) -> inspect.Signature:
    params = list(sig.parameters.values())
    if len(params) > skip and params[skip].kind in _POSITIONAL:
        del params[skip]
    return sig.replace(parameters=params)


def _check_start(value: object) -> int:
    if not is_int(value):
        raise TypeError(
            f"accelkit.find_executable_batch_size(starting_batch_size={value!r}): expected an integer, "
            f"e.g. starting_batch_size=128"
        )
    if value < 0:
        raise ValueError(
            f"accelkit.find_executable_batch_size(starting_batch_size={value!r}): expected a positive "
            f"batch size to start from, e.g. starting_batch_size=128"
        )
    return value


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
