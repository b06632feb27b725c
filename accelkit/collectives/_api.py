"""Collectives over trees of tensors: gather, reduce, broadcast, pad, and Python objects.

Each takes a tensor or a nested list/tuple/dict/namedtuple/dataclass of tensors and
returns the same structure. With one process it returns its input object itself; with
several, new tensors (inputs are never modified). Every rank must call each collective,
in the same order. In debug mode the ranks first compare their calls (see ``_debug``).
"""

from __future__ import annotations

import contextlib
import difflib
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, NoReturn, TypeVar, get_args

import torch

from .. import _group, _state, _tree
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _checked, _debug, _exchange

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min", "product"]
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)

__all__ = ["REDUCE_OPS", "ReduceOp", "broadcast", "broadcast_object", "gather", "gather_object",
           "pad_across_processes", "reduce"]  # fmt: skip

Check = Callable[[list[torch.Tensor], _tree.TreeSpec], None]


def gather(data: T) -> T:
    """Every process's ``data``, concatenated along dim 0 in rank order.

    Every rank must call it, with the same structure, dtypes and shapes (pad ragged
    tensors with :func:`pad_across_processes` first). A 0-d tensor becomes 1-d with one
    entry per process. With one process ``data`` itself is returned.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.gather({"loss": torch.tensor(0.5)})  # {'loss': tensor([0.5, 0.7])} on 2 processes
        {'loss': tensor(0.5000)}
    """
    st = _state.get()
    leaves, spec = _inputs(st, "gather", {}, data)
    if not st.distributed:
        return data
    with _collective(st, "gather"):
        out = _checked.gather(st, leaves, spec)
    return _tree.unflatten(spec, out)  # type: ignore[no-any-return]


def reduce(data: T, op: ReduceOp = "sum") -> T:
    """``data`` reduced element-wise across processes with ``op`` (the sum by default, as
    Accelerate's ``reduce`` and ``torch.distributed.all_reduce``).

    Every rank must call it, with the same structure, dtypes and shapes and the same
    ``op``: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``. The result has
    the input's dtype (bool: sum/max is *or*, product/min is *and*); ``"mean"`` needs
    floating-point tensors, so convert integers first (``counts.float()``) or sum them.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.reduce(torch.tensor([1.0, 3.0]), op="sum")  # the sum over processes
        tensor([1., 3.])
    """
    st = _state.get()
    leaves, spec = _inputs(st, "reduce", {"op": op}, data, _reduce_check(op))
    if not st.distributed:
        return data
    with _collective(st, "reduce"):
        out = _checked.reduce(st, leaves, spec, op)
    return _tree.unflatten(spec, out)  # type: ignore[no-any-return]


def broadcast(data: T, src: int = 0) -> T:
    """Process ``src``'s ``data`` on every process.

    Every rank must call it, with the same ``src`` and the same structure, dtypes and
    shapes (the other ranks' values are not used; their inputs are left untouched).

    Example:
        >>> import accelkit as ak, torch
        >>> ak.broadcast(torch.arange(3), src=0)  # rank 0's tensor everywhere
        tensor([0, 1, 2])
    """
    st = _state.get()
    leaves, spec = _inputs(st, "broadcast", {"src": src}, data, lambda _, __: _check_src("broadcast", src, st))
    if not st.distributed:
        return data
    with _collective(st, "broadcast"):
        out = _checked.broadcast(st, leaves, spec, src)
    return _tree.unflatten(spec, out)  # type: ignore[no-any-return]


def pad_across_processes(data: T, dim: int = 0, pad_index: float = 0, pad_first: bool = False) -> T:
    """``data`` padded with ``pad_index`` along ``dim`` to the largest size on any process.

    Every rank must call it, with the same structure, dtypes and ``dim``; the sizes are
    exchanged in one collective, so the results have the same shapes everywhere and
    can be gathered. ``pad_first`` pads at the start instead of the end. Tensors that have
    no dimension ``dim`` (a 0-d tensor, ``dim=2`` of a matrix) come back unchanged, as with
    Accelerate, so that one call pads every tensor of a mixed structure that has it.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.pad_across_processes(torch.ones(2 + ak.rank()))  # [1, 1, 0] on rank 0 of 2
        tensor([1., 1.])
    """
    st = _state.get()
    leaves, spec = _inputs(st, "pad_across_processes", {"dim": dim}, data, _pad_check(dim, pad_index, pad_first), dim)
    if not st.distributed:
        return data
    padded = [i for i, x in enumerate(leaves) if -x.dim() <= dim < x.dim()]
    dims = [dim % leaves[i].dim() for i in padded]
    lengths = [leaves[i].shape[d] for i, d in zip(padded, dims, strict=True)]
    with _collective(st, "pad_across_processes"):
        sizes = _checked.max_sizes(st, leaves, spec, dim, lengths)
    out = [x.clone() for x in leaves]
    for i, x in zip(padded, _exchange.pad([leaves[i] for i in padded], dims, sizes, pad_index, pad_first), strict=True):
        out[i] = x
    return _tree.unflatten(spec, out)  # type: ignore[no-any-return]


def gather_object(obj: Any) -> list[Any]:
    """Every process's ``obj`` (any picklable object), one list entry per rank.

    Every rank must call it. The objects travel pickled; each entry is whole, whatever
    its type (a dict or a string is not split). With one process: ``[obj]``.

    Example:
        >>> import accelkit as ak
        >>> ak.gather_object({"rank": ak.rank()})  # [{'rank': 0}, {'rank': 1}] on 2 processes
        [{'rank': 0}]
    """
    st = _state.get()
    if not st.distributed:
        return [obj]
    payload = _objects(st, "gather_object", {}, lambda: _dumps("gather_object", obj))
    with _collective(st, "gather_object"):
        blobs = _checked.gather_object(st, payload)
    return [_exchange.loads(b) for b in blobs]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Process ``src``'s ``obj`` (any picklable object) on every process.

    Every rank must call it with the same ``src``; the other ranks' ``obj`` is ignored
    (pass ``None``). With one process ``obj`` itself is returned.

    Example:
        >>> import accelkit as ak
        >>> ak.broadcast_object({"seed": 42} if ak.is_main_process() else None)
        {'seed': 42}
    """
    st = _state.get()

    def prepare() -> bytes:
        _check_src("broadcast_object", src, st)
        return _dumps("broadcast_object", obj) if st.distributed and st.rank == src else b""

    payload = _objects(st, "broadcast_object", {"src": src}, prepare, src)
    if not st.distributed:
        return obj
    with _collective(st, "broadcast_object"):
        blob = _checked.broadcast_object(st, payload, src)
    return _exchange.loads(blob)  # type: ignore[no-any-return]


def _inputs(
    st: ProcessState,
    op: str,
    params: dict[str, Any],
    data: Any,
    check: Check | None = None,
    free_dim: int | None = None,
) -> tuple[list[torch.Tensor], _tree.TreeSpec]:
    """Flatten and validate ``data``; in debug mode, compare with the other ranks first."""
    try:
        leaves, spec = _tree.flatten(data, f"accelkit.{op}")
        if check is not None:
            check(leaves, spec)
    except (TypeError, ValueError) as exc:
        _refuse(st, op, params, exc)
        raise
    if st.distributed and st.options.debug:
        compare_calls(st, op, params, leaves, spec, free_dim)
    return leaves, spec


def _objects(
    st: ProcessState, op: str, params: dict[str, Any], prepare: Callable[[], bytes], src: int | None = None
) -> bytes:
    try:
        payload = prepare()
    except (TypeError, ValueError) as exc:
        _refuse(st, op, params, exc)
        raise
    if st.distributed and st.options.debug:
        compare_calls(st, op, params)
    return payload


def _refuse(st: ProcessState, op: str, params: dict[str, Any], problem: BaseException) -> None:
    """This rank's input is invalid: take part all the same, so that every rank raises instead of waiting."""
    if not st.distributed:
        return
    if st.options.debug:
        compare_calls(st, op, params, problem=problem)  # the other ranks raise too
        return
    src = params.get("src")
    if src is not None and not (isinstance(src, int) and not isinstance(src, bool) and 0 <= src < st.world_size):
        return  # no rank can send from there: every rank raises the same error by itself
    with _collective(st, op):
        _checked.refuse(st, op, params, problem, src)


def barrier(st: ProcessState) -> None:
    """``wait_for_everyone``'s exchange: every rank checks that the others are in the same call."""
    if st.options.debug:
        compare_calls(st, "wait_for_everyone", {})
    with _collective(st, "wait_for_everyone"):
        _checked.barrier(st)


def any_rank(st: ProcessState, op: str, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (``check_breakpoint``), checked like every collective."""
    if st.options.debug:
        compare_calls(st, op, {})
    with _collective(st, op):
        return _checked.either(st, op, flag)


def compare_calls(st: ProcessState, op: str, params: dict[str, Any], *args: Any, **kwargs: Any) -> None:
    """Debug mode: check with the other ranks that they make this same call (see ``_debug``)."""
    with _communication(st, op):
        _debug.check(st, op, params, *args, **kwargs)


def _reduce_check(op: str) -> Check:
    def check(leaves: list[torch.Tensor], spec: _tree.TreeSpec) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(
                f"accelkit.reduce(op={op!r}): expected one of {', '.join(map(repr, REDUCE_OPS))}"
                + _suggest(op, REDUCE_OPS)
            )
        for i, x in enumerate(leaves):
            if op == "mean" and not (x.is_floating_point() or x.is_complex()):
                raise TypeError(
                    f"accelkit.reduce(op='mean'): {_tree.leaf_paths(spec)[i]} is a {x.dtype} tensor, and "
                    f"a mean of integers or booleans is no integer. Convert it first (x.float()), or reduce "
                    f"with op='sum' and divide by accelkit.world_size()."
                )
            if x.is_complex() and op not in ("sum", "mean"):
                raise TypeError(
                    f"accelkit.reduce(op={op!r}): {_tree.leaf_paths(spec)[i]} is a {x.dtype} tensor; "
                    f"complex numbers have no order or element-wise product here: use op='sum' or 'mean'"
                )

    return check


def _pad_check(dim: int, pad_index: Any, pad_first: bool) -> Check:
    def check(leaves: list[torch.Tensor], spec: _tree.TreeSpec) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"accelkit.pad_across_processes(dim={dim!r}): expected an integer dimension")
        if not isinstance(pad_index, (int, float)):
            raise TypeError(f"accelkit.pad_across_processes(pad_index={pad_index!r}): expected a number to pad with")
        if not isinstance(pad_first, bool):
            raise TypeError(f"accelkit.pad_across_processes(pad_first={pad_first!r}): expected True or False")

    return check


def _check_src(op: str, src: Any, st: ProcessState) -> None:
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"accelkit.{op}(src={src!r}): expected the integer rank to send from, e.g. src=0")
    if not 0 <= src < st.world_size:
        raise ValueError(
            f"accelkit.{op}(src={src}): the job has {st.world_size} process{'es' if st.world_size > 1 else ''}, "
            f"so src must be between 0 and {st.world_size - 1}"
        )


def _dumps(op: str, obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"accelkit.{op} cannot send {type(obj).__name__} {obj!r:.80}: it cannot be pickled ({exc}). "
            f"Send plain data (numbers, strings, lists, dicts, tensors) instead."
        ) from exc


@contextlib.contextmanager
def _communication(st: ProcessState, op: str) -> Iterator[None]:
    """Turn a backend failure in the body into an error naming ``op``."""
    try:
        yield
    except _exchange.CommunicationError as exc:
        _failed(op, st, exc)


class _collective:
    """One collective: counted, its start and end noted for the heartbeat, a backend failure named."""

    __slots__ = ("group", "op", "st")

    def __init__(self, st: ProcessState, op: str) -> None:
        self.st, self.op, self.group = st, op, _state.group

    def __enter__(self) -> None:
        group = self.group
        group.seq += 1
        group.op, group.thread, group.entered = self.op, threading.get_ident(), time.monotonic()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        group = self.group
        group.entered, group.finished, group.call = 0.0, time.monotonic(), None
        if isinstance(exc, _exchange.CommunicationError):
            _failed(self.op, self.st, exc, group.seq)
        if isinstance(exc, _exchange.Conflict):
            # The backend call cannot end (the others wait in another one): the group is unusable.
            group.closed = f"the processes called different collectives as #{group.seq}"
            group.abandoned = True
            _group.abandon()
            raise DistributedOperationError(str(exc)) from None


def _failed(op: str, st: ProcessState, error: _exchange.CommunicationError, seq: int | None = None) -> NoReturn:
    """Name the operation in a backend failure (a timeout, a lost peer), and the ranks it waited for."""
    exc = error.cause
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = f"accelkit.{op}" + (f" #{seq}" if seq is not None else "")
    lines = [f"{name} failed on process {st.rank} of {st.world_size}: {first}", *_whereabouts(st, op, seq)]
    raise DistributedOperationError(
        "\n".join(lines) + "\n"
        f"Collectives wait at most {st.options.timeout:g} s (the `timeout` option of ak.init / "
        f"@ak.distributed, or ACCELKIT_TIMEOUT). A timeout or a lost peer usually means that another "
        f"process failed first, is stuck, or called the collectives in another order. Run with debug=True "
        f"(or ACCELKIT_DEBUG=1) to compare every collective's inputs across processes as they are called."
    ) from exc


def _whereabouts(st: ProcessState, op: str, seq: int | None) -> list[str]:
    """What the other ranks posted to the store: why one closed the group, and where each one is."""
    group = _state.group
    if group.store is None or seq is None:
        return []
    try:
        reports = _group.read_reports(group.store, group.board)
        if reports:
            return [f"process {rank} stopped the group first:\n{text}" for rank, text in reports]
        if group.heartbeat is not None:  # a fresh position from every rank that is still alive
            time.sleep(group.heartbeat.period)
        positions = _group.read_positions(group.store, group.board, st.world_size)
        return _group.describe_missing(st.rank, op, seq, positions, list(range(st.world_size))).splitlines()
    except Exception:  # the store went with the rank that hosted it
        return []


def _suggest(value: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, valid, n=1) if isinstance(value, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""
