"""Each collective, checked: its first message through :mod:`._wire`, then its data.

When every rank's data came in its slot, the result is computed from the slots (a reduction too:
the ranks add the gathered rows, in rank order); otherwise the data moves in a second message,
through :mod:`._exchange`, now that the ranks are known to agree on its size.
"""

from __future__ import annotations

import struct

import torch

from .. import _state, _tree
from .._state import ProcessState
from . import _bytes, _exchange, _plan, _wire
from ._header import HEADER, Arrival, Call

__all__ = ["barrier", "broadcast", "broadcast_object", "either", "gather", "gather_object", "max_sizes", "reduce",
           "refuse"]  # fmt: skip


def exchange(st: ProcessState, call: Call) -> Arrival:
    """A two-way collective's first message: the planned all-reduce first, when this point of the program has one."""
    plan = _state.group.plans.get(_state.group.last_key)
    if plan is not None:
        _plan.run(st, call, plan)  # another call than planned, the same on every rank (or it raised)
    return _wire.exchange(st, call)


def gather(st: ProcessState, leaves: list[torch.Tensor], spec: _tree.TreeSpec) -> list[torch.Tensor]:
    parts, length = _bytes.parts(leaves)
    arrival = exchange(st, Call("gather", {}, leaves, spec, payload=parts, length=length))
    if arrival.fits:
        return _bytes.gather_rows(arrival.buffer, arrival.stride, HEADER, leaves)
    return _exchange.gather(leaves, st.world_size)


def reduce(st: ProcessState, leaves: list[torch.Tensor], spec: _tree.TreeSpec, op: str) -> list[torch.Tensor]:
    group = _state.group
    key, plan = group.last_key, group.plans.get(group.last_key)
    parts, length = _bytes.parts(leaves)
    call = Call("reduce", {"op": op}, leaves, spec, payload=parts, length=length)
    if plan is not None:
        planned = _plan.run(st, call, plan)
        if planned is not None:
            return planned
    arrival = _wire.exchange(st, call)
    _plan.learn(group, key, leaves, op, st.world_size)  # every rank checked this call: plan the next one here
    if arrival.fits:
        return _bytes.reduce_rows(arrival.buffer, arrival.stride, HEADER, leaves, op)
    return _exchange.reduce(leaves, op, st.world_size)


def broadcast(st: ProcessState, leaves: list[torch.Tensor], spec: _tree.TreeSpec, src: int) -> list[torch.Tensor]:
    parts, length = _bytes.parts(leaves)
    arrival = _wire.broadcast(st, Call("broadcast", {"src": src}, leaves, spec, payload=parts, length=length), src)
    if not arrival.fits:
        return _exchange.broadcast(leaves, src, st.rank)
    # The source's results are views of the slot it sent (its copy of the input); a receiver's inbox is reused.
    return _bytes.unpack(arrival.buffer[HEADER : HEADER + length], leaves, copy=st.rank != src)


def max_sizes(
    st: ProcessState, leaves: list[torch.Tensor], spec: _tree.TreeSpec, dim: int, lengths: list[int]
) -> list[int]:
    """``pad_across_processes``: the largest length of each leaf along ``dim`` over the ranks."""
    payload = struct.pack(f"<{len(lengths)}q", *lengths)
    call = Call("pad_across_processes", {"dim": dim}, leaves, spec, free_dim=dim, payload=payload)
    arrival = exchange(st, call)
    if not arrival.fits:
        return _exchange.max_sizes(lengths, st.device, st.world_size)
    if not lengths:
        return []
    values = arrival.rows[:, HEADER : HEADER + len(payload)].view(torch.int64)
    return [int(n) for n in values.amax(0).tolist()]


def gather_object(st: ProcessState, payload: bytes) -> list[bytes]:
    arrival = exchange(st, Call("gather_object", {}, payload=payload))
    if arrival.fits:
        return _row_bytes(arrival.rows, arrival.lengths)
    return _exchange.gather_padded(payload, max(arrival.lengths), arrival.lengths, st.device, st.world_size)


def broadcast_object(st: ProcessState, payload: bytes, src: int) -> bytes:
    arrival = _wire.broadcast(st, Call("broadcast_object", {"src": src}, payload=payload), src)
    if st.rank == src:
        if not arrival.fits:
            _exchange.broadcast_tensor(_exchange.to_tensor(payload, st.device), src)
        return payload
    if arrival.fits:
        return _row_bytes(arrival.rows, arrival.lengths)[0]
    rest = torch.empty(arrival.lengths[0], dtype=torch.uint8, device=st.device)
    _exchange.broadcast_tensor(rest, src)
    return _bytes.read(rest, rest.numel(), 1, rest.numel())[0]


def barrier(st: ProcessState) -> None:
    """``wait_for_everyone``: every rank's header, nothing else."""
    exchange(st, Call("wait_for_everyone", {}))


def either(st: ProcessState, op: str, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (``check_breakpoint``)."""
    arrival = exchange(st, Call(op, {}, payload=bytes([flag])))
    return any(row[0] for row in _row_bytes(arrival.rows, arrival.lengths))


def refuse(st: ProcessState, op: str, params: dict[str, object], problem: BaseException, src: int | None) -> None:
    """Take part in ``op`` with an invalid input, so that the others raise instead of waiting; the caller raises."""
    call = Call(op, dict(params), problem=problem)
    if src is None:
        exchange(st, call)
    else:
        _wire.broadcast(st, call, src)


def _row_bytes(rows: torch.Tensor, lengths: list[int]) -> list[bytes]:
    count, stride = rows.shape
    return [
        row[HEADER : HEADER + n]
        for row, n in zip(_bytes.read(rows, stride, count, HEADER + max(lengths)), lengths, strict=True)
    ]
