"""Collectives over trees of tensors: gather, reduce, broadcast, pad, and Python objects.

Each takes a tensor or a nested list/tuple/dict/namedtuple/dataclass of tensors and
returns the same structure. With one process it returns its input object itself; with
several, new tensors (inputs are never modified). Every rank of the group (``group=``: every
process by default) must call each collective, in the same order. In debug mode the ranks
first compare their calls (see ``_debug``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args

import torch
from torch.distributed import ProcessGroup

from .. import _state, _tree
from .._options import is_int, suggest
from .._state import ProcessState
from . import _checked, _debug, _exchange, _signature
from ._channel import Channel, channel, check_alone, describe
from ._checked import settle
from ._movers import GATHER, REDUCE, Broadcast, Mover
from ._scope import collective as _collective
from ._scope import communication as _communication
from ._signature import Call

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min", "product"]
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)
# Which processes a collective runs over: None (every process), a torch ProcessGroup, or a mesh dimension's name.
Group = ProcessGroup | str | None

__all__ = ["REDUCE_OPS", "Group", "ReduceOp", "broadcast", "broadcast_object", "gather", "gather_object",
           "pad_across_processes", "reduce"]  # fmt: skip

Check = Callable[[list[torch.Tensor], _tree.TreeSpec], None]


def gather(data: T, *, group: Group = None) -> T:
    """Every process's ``data``, concatenated along dim 0 in rank order.

    Every rank of ``group`` must call it, with the same structure, dtypes and shapes (pad ragged
    tensors with :func:`pad_across_processes` first). A 0-d tensor becomes 1-d with one
    entry per process. With one process ``data`` itself is returned. ``group``: the processes
    to gather from (None: all; a torch ``ProcessGroup``; a mesh dimension's name, such as ``"dp"``).

    Args:
        data: a tensor or a tree of tensors: the same structure, dtypes and shapes on every rank.
        group: the processes it runs over: ``None`` (all), a ``ProcessGroup``, a mesh dimension's name.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.gather({"loss": torch.tensor(0.5)})  # 2 processes: tensor([0.5, 0.7])
        {'loss': tensor(0.5000)}
    """
    st = _state.get()
    if (again := _checked.again(st, "gather", None, data, group)) is not None:
        return again  # type: ignore[return-value]
    found = _tensors(st, "gather", {}, data, group)
    if found is None:
        return data
    ch, call = found
    return _tree.unflatten(call.spec, _run(st, ch, call, GATHER))  # type: ignore[arg-type, no-any-return]


def reduce(data: T, op: ReduceOp = "sum", *, group: Group = None) -> T:
    """``data`` reduced element-wise across processes with ``op`` (the sum by default, as
    Accelerate's ``reduce`` and ``torch.distributed.all_reduce``).

    Every rank of ``group`` must call it, with the same structure, dtypes and shapes and the same
    ``op``: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``. The result has
    the input's dtype (bool: sum/max is *or*, product/min is *and*); ``"mean"`` needs
    floating-point tensors, so convert integers first (``counts.float()``) or sum them.
    ``group``: as for :func:`gather` (a mean divides by the group's size).

    Args:
        data: a tensor or a tree of tensors: the same structure, dtypes and shapes on every rank.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``; the same on every rank.
        group: the processes it runs over: ``None`` (all), a ``ProcessGroup``, a mesh dimension's name.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.reduce(torch.tensor([1.0, 3.0]), op="sum")  # the sum over processes
        tensor([1., 3.])
    """
    st = _state.get()
    if (again := _checked.again(st, "reduce", op, data, group)) is not None:
        return again  # type: ignore[return-value]
    found = _tensors(st, "reduce", {"op": op}, data, group, _REDUCE_CHECKS.get(op) or _reduce_check(op))
    if found is None:
        return data
    ch, call = found
    return _tree.unflatten(call.spec, _run(st, ch, call, REDUCE[op]))  # type: ignore[arg-type, no-any-return]


def broadcast(data: T, src: int = 0, *, group: Group = None) -> T:
    """Process ``src``'s ``data`` on every process.

    Every rank of ``group`` must call it, with the same ``src`` and the same structure, dtypes and
    shapes (the other ranks' values are not used; their inputs are left untouched). ``src`` is a
    global rank (``ak.rank()`` of the sender), in ``group`` (as for :func:`gather`) where one is given.

    Args:
        data: a tensor or a tree of tensors: the same structure, dtypes and shapes on every rank.
        src: the global rank whose ``data`` every rank receives.
        group: the processes it runs over: ``None`` (all), a ``ProcessGroup``, a mesh dimension's name.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.broadcast(torch.arange(3), src=0)  # rank 0's tensor everywhere
        tensor([0, 1, 2])
    """
    st = _state.get()
    if (again := _checked.again(st, "broadcast", src, data, group)) is not None:
        return again  # type: ignore[return-value]
    found = _tensors(st, "broadcast", {"src": src}, data, group, src=src)
    if found is None:
        return data
    ch, call = found
    return _tree.unflatten(call.spec, _run(st, ch, call, Broadcast(src)))  # type: ignore[arg-type, no-any-return]


def pad_across_processes(
    data: T, dim: int = 0, pad_index: float = 0, pad_first: bool = False, *, group: Group = None
) -> T:
    """``data`` padded with ``pad_index`` along ``dim`` to the largest size on any process.

    Every rank of ``group`` must call it, with the same structure, dtypes and ``dim``; the sizes are
    exchanged in one collective, so the results have the same shapes everywhere and
    can be gathered. ``pad_first`` pads at the start instead of the end. Tensors that have
    no dimension ``dim`` (a 0-d tensor, ``dim=2`` of a matrix) come back unchanged, as with
    Accelerate, so that one call pads every tensor of a mixed structure that has it.
    ``group``: as for :func:`gather`.

    Args:
        data: a tensor or a tree of tensors: the same structure and dtypes on every rank.
        dim: the dimension to pad; tensors without it come back unchanged.
        pad_index: the value to pad with.
        pad_first: pad at the start instead of the end.
        group: the processes it runs over: ``None`` (all), a ``ProcessGroup``, a mesh dimension's name.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.pad_across_processes(torch.ones(2 + ak.rank()))  # of 2: [1, 1, 0]
        tensor([1., 1.])
    """
    st = _state.get()
    check = _pad_check(dim, pad_index, pad_first)
    found = _tensors(st, "pad_across_processes", {"dim": dim}, data, group, check, dim)
    if found is None:
        return data
    ch, call = found
    leaves = call.data
    padded = [i for i, x in enumerate(leaves) if -x.dim() <= dim < x.dim()]
    dims = [dim % leaves[i].dim() for i in padded]
    lengths = [leaves[i].shape[d] for i, d in zip(padded, dims, strict=True)]
    call.shapes = [(x.dtype, x.shape) for x in leaves]
    call.data = [torch.tensor(lengths, dtype=torch.int64, device=st.device)]
    everyone = _run(st, ch, call, GATHER)[0].tolist()
    sizes = [max(everyone[i :: len(lengths)]) for i in range(len(lengths))]  # per leaf, over the ranks
    padded_leaves = _exchange.pad([leaves[i] for i in padded], dims, sizes, pad_index, pad_first)
    grown = dict(zip(padded, padded_leaves, strict=True))
    out = [grown[i] if i in grown else _exchange.own(x) for i, x in enumerate(leaves)]
    return _tree.unflatten(call.spec, out)  # type: ignore[arg-type, no-any-return]


def gather_object(obj: Any, *, group: Group = None) -> list[Any]:
    """Every process's ``obj`` (any picklable object), one list entry per rank.

    Every rank of ``group`` (as for :func:`gather`) must call it. The objects travel pickled; each
    entry is whole, whatever its type (a dict or a string is not split). With one process: ``[obj]``.

    Args:
        obj: any picklable object.
        group: the processes it runs over: ``None`` (all), a ``ProcessGroup``, a mesh dimension's name.

    Example:
        >>> import accelkit as ak
        >>> ak.gather_object({"rank": ak.rank()})  # 2 processes: 2 entries
        [{'rank': 0}]
    """
    st = _state.get()
    if not st.distributed:
        check_alone(st, group)
        return [obj]
    ch = channel(st, group)
    payload, call = _object(st, ch, "gather_object", {}, lambda: _dumps("gather_object", obj))
    lengths = _run(st, ch, call, GATHER)[0].tolist()
    with _communication(st, "gather_object"):
        blobs = _exchange.gather_padded(payload, max(lengths), lengths, st.device, ch.size, ch.group)
    return [_exchange.loads(b) for b in blobs]


def broadcast_object(obj: T, src: int = 0, *, group: Group = None) -> T:
    """Process ``src``'s ``obj`` (any picklable object) on every process.

    Every rank of ``group`` (as for :func:`gather`) must call it with the same ``src`` (a global
    rank); the other ranks' ``obj`` is ignored (pass ``None``). With one process ``obj`` itself is returned.

    Args:
        obj: any picklable object on ``src``; ignored on the other ranks (pass ``None``).
        src: the global rank whose ``obj`` every rank receives.
        group: the processes it runs over: ``None`` (all), a ``ProcessGroup``, a mesh dimension's name.

    Example:
        >>> import accelkit as ak
        >>> ak.broadcast_object({"seed": 42} if ak.is_main_process() else None)
        {'seed': 42}
    """
    st = _state.get()
    ch = channel(st, group) if st.distributed else None

    def prepare() -> bytes:
        _check_src("broadcast_object", src, st, ch)
        return _dumps("broadcast_object", obj) if ch is not None and st.rank == src else b""

    if ch is None:
        check_alone(st, group)
        prepare()
        return obj
    payload, call = _object(st, ch, "broadcast_object", {"src": src}, prepare)
    length = int(_run(st, ch, call, Broadcast(src))[0])
    with _communication(st, "broadcast_object"):
        blob = _exchange.broadcast_bytes(payload, length, src, st.rank, st.device, ch.group)
    return _exchange.loads(blob)  # type: ignore[no-any-return]


def barrier(st: ProcessState) -> None:
    """``wait_for_everyone``'s exchange: every rank checks that the others are in the same call."""
    ch = channel(st)
    if st.options.debug:
        compare_calls(st, ch, "wait_for_everyone", {})
    call = Call(_signature.signature("wait_for_everyone", {}), [], {})
    if not st.options.check_collectives:
        with _collective(st, ch, call):
            _exchange.barrier()
        return
    settle(st)
    with _collective(st, ch, call):
        _checked.barrier(st, ch, call)


def any_rank(st: ProcessState, op: str, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (``check_breakpoint``), checked like every collective."""
    ch = channel(st)
    if st.options.debug:
        compare_calls(st, ch, op, {})
    data = [torch.tensor([int(flag)], dtype=torch.int32, device=st.device)]
    call = Call(_signature.signature(op, {}), data, {})
    return bool(_run(st, ch, call, REDUCE["max"])[0].item())


def compare_calls(st: ProcessState, ch: Channel, op: str, params: dict[str, Any], *args: Any, **kwargs: Any) -> None:
    """Debug mode: check with the other ranks of the channel's group that they make this same call (``_debug``)."""
    with _communication(st, op):
        _debug.check(st.device, ch.group, ch.ranks, op, params, *args, **kwargs)


def _tensors(
    st: ProcessState,
    op: str,
    params: dict[str, Any],
    data: Any,
    group: Group,
    check: Check | None = None,
    free_dim: int | None = None,
    src: Any = None,
) -> tuple[Channel, Call] | None:
    """This rank's call and its channel: ``data`` flattened and validated (in debug mode, compared with the other
    ranks' first); None with one process. An invalid input raises, after taking part so that no rank waits."""
    ch = channel(st, group) if st.distributed else None
    if ch is None:
        check_alone(st, group)
    try:
        leaves, spec = _tree.flatten(data, f"accelkit.{op}")
        if check is not None:
            check(leaves, spec)
        if "src" in params:
            _check_src(op, src, st, ch)
    except (TypeError, ValueError) as exc:
        _refuse(st, ch, op, params, exc)
        raise
    if ch is None:
        return None
    if st.options.debug:
        compare_calls(st, ch, op, params, [(x.dtype, x.shape) for x in leaves], spec, free_dim)
    return ch, Call(_signature.signature(op, params, leaves, spec, free_dim), leaves, params, spec, free_dim)


def _object(
    st: ProcessState, ch: Channel, op: str, params: dict[str, Any], prepare: Callable[[], bytes]
) -> tuple[bytes, Call]:
    """This rank's pickled object, and its call: the payload's length travels first, checked."""
    try:
        payload = prepare()
    except (TypeError, ValueError) as exc:
        _refuse(st, ch, op, params, exc)
        raise
    if st.options.debug:
        compare_calls(st, ch, op, params)
    data = [torch.tensor([len(payload)], dtype=torch.int64, device=st.device)]
    return payload, Call(_signature.signature(op, params), data, params)


def _refuse(st: ProcessState, ch: Channel | None, op: str, params: dict[str, Any], problem: BaseException) -> None:
    """This rank's input is invalid: take part all the same, so that every rank raises instead of waiting."""
    if ch is None:
        return
    if st.options.debug:
        compare_calls(st, ch, op, params, problem=problem)  # the other ranks raise too
        return
    src = params.get("src")
    if src is not None and not (is_int(src) and src in ch.ranks):
        return  # no rank can send from there: every rank raises the same error by itself
    if not st.options.check_collectives:
        return  # nothing tells the others: they wait (the price of unchecked collectives)
    call = Call(_signature.signature(op, params, problem=problem), [], params, problem=problem)
    _run(st, ch, call, Broadcast(src) if src is not None else GATHER)


def _run(st: ProcessState, ch: Channel, call: Call, mover: Mover) -> Any:
    """``call``'s results through the checked path (or the backend alone, with ``check_collectives=False``)."""
    if not st.options.check_collectives:
        with _collective(st, ch, call):
            return mover.data(ch, call.data)
    settle(st)
    with _collective(st, ch, call):
        return _checked.run(st, ch, call, mover)


def _reduce_check(op: str) -> Check:
    def check(leaves: list[torch.Tensor], spec: _tree.TreeSpec) -> None:
        if op == "sum":  # any dtype
            return
        if op not in REDUCE_OPS:
            raise ValueError(
                f"accelkit.reduce(op={op!r}): expected one of {', '.join(map(repr, REDUCE_OPS))}"
                + suggest(op, REDUCE_OPS)
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


_REDUCE_CHECKS = {op: _reduce_check(op) for op in REDUCE_OPS}


def _pad_check(dim: int, pad_index: Any, pad_first: bool) -> Check:
    def check(leaves: list[torch.Tensor], spec: _tree.TreeSpec) -> None:
        if not is_int(dim):
            raise TypeError(f"accelkit.pad_across_processes(dim={dim!r}): expected an integer dimension")
        if not isinstance(pad_index, (int, float)):
            raise TypeError(f"accelkit.pad_across_processes(pad_index={pad_index!r}): expected a number to pad with")
        if not isinstance(pad_first, bool):
            raise TypeError(f"accelkit.pad_across_processes(pad_first={pad_first!r}): expected True or False")

    return check


def _check_src(op: str, src: Any, st: ProcessState, ch: Channel | None) -> None:
    if not is_int(src):
        raise TypeError(f"accelkit.{op}(src={src!r}): expected the integer rank to send from, e.g. src=0")
    if ch is not None and not ch.world:
        if src not in ch.ranks:
            raise ValueError(
                f"accelkit.{op}(src={src}): src is a global rank (ak.rank() of the sender), and the group passed "
                f"has the processes {describe(ch.ranks)}: pass one of them"
            )
    elif not 0 <= src < st.world_size:
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
