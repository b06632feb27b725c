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
from collections.abc import Callable, Iterator
from typing import Any, Literal, NoReturn, TypeVar, get_args

import torch

from .. import _state, _tree
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _debug, _exchange

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
    with _communication(st, "gather"):
        out = _exchange.gather(leaves, st.world_size)
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
    with _communication(st, "reduce"):
        out = _exchange.reduce(leaves, op, st.world_size)
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
    with _communication(st, "broadcast"):
        out = _exchange.broadcast(leaves, src, st.rank)
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
    with _communication(st, "pad_across_processes"):
        sizes = _exchange.max_sizes(lengths, st.device, st.world_size)
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
    with _communication(st, "gather_object"):
        blobs = _exchange.gather_bytes(payload, st.device, st.world_size)
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

    payload = _objects(st, "broadcast_object", {"src": src}, prepare)
    if not st.distributed:
        return obj
    with _communication(st, "broadcast_object"):
        blob = _exchange.broadcast_bytes(payload, src, st.rank, st.device)
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
        if st.distributed and st.options.debug:
            compare_calls(st, op, params, problem=exc)  # the other ranks raise too
        raise
    if st.distributed and st.options.debug:
        compare_calls(st, op, params, leaves, spec, free_dim)
    return leaves, spec


def _objects(st: ProcessState, op: str, params: dict[str, Any], prepare: Callable[[], bytes]) -> bytes:
    try:
        payload = prepare()
    except (TypeError, ValueError) as exc:
        if st.distributed and st.options.debug:
            compare_calls(st, op, params, problem=exc)
        raise
    if st.distributed and st.options.debug:
        compare_calls(st, op, params)
    return payload


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


def _failed(op: str, st: ProcessState, error: _exchange.CommunicationError) -> NoReturn:
    """Name the operation in a backend failure (a timeout, a lost peer)."""
    exc = error.cause
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    raise DistributedOperationError(
        f"accelkit.{op} failed on process {st.rank} of {st.world_size}: {first}\n"
        f"Collectives wait at most {st.options.timeout:g} s (the `timeout` option of ak.init / "
        f"@ak.distributed, or ACCELKIT_TIMEOUT). A timeout or a lost peer usually means that the "
        f"processes called different collectives, or passed inputs of different shapes or dtypes, "
        f"or that another process failed first. Run with debug=True (or ACCELKIT_DEBUG=1) to "
        f"compare every collective's inputs across processes and get a per-process report."
    ) from exc


def _suggest(value: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, valid, n=1) if isinstance(value, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""
