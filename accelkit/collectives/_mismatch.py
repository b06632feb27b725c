"""When the ranks' headers disagree: every rank that can tell raises debug mode's table.

A two-way collective's ranks all saw every header, so they all come here, and describe their
calls to each other in full (:mod:`._debug`'s exchange) before raising. A broadcast's receiver
saw only the source's header: it raises with what it saw, posts its table to the job's store and
closes the group, so that the source, which went on unaware, fails at its next collective.
"""

from __future__ import annotations

import contextlib

import torch

from .. import _group, _state
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _bytes, _debug
from ._header import CODES, DTYPES, ERROR, FORMAT, HEADER, MAGIC, ONE_WAY, OPS, TREE, Arrival, Call

__all__ = ["disagree", "refuse_broadcast"]


def disagree(st: ProcessState, call: Call, headers: list[bytes], arrival: Arrival) -> None:
    """The ranks sent different headers; every rank saw all of them, so every rank is here."""
    codes = {h[4] for h in headers}
    if any(CODES[op] in codes for op in ONE_WAY):
        # A rank broadcast while this one gathered: it takes part in no further exchange, and does
        # not know: close the group, so that its next collective fails at once.
        table = _table(st, call, dict(enumerate(headers)), arrival)
        _post(st, table)
        _state.close_group(table.splitlines()[0])
        raise DistributedOperationError(table)
    # The others came here too: the same exchange as debug mode describes every rank's call in full.
    _debug.check(st, call.op, call.params, call.leaves, call.spec, call.free_dim, call.problem)
    if call.problem is not None:
        return  # this rank raises its own error; the others quote it
    raise DistributedOperationError(_out_of_step(call.op, headers))


def refuse_broadcast(st: ProcessState, call: Call, src: int, headers: dict[int, bytes], arrival: Arrival) -> None:
    source_failed = bool(FORMAT.unpack(headers[src])[2] & ERROR) and headers[src][:4] == MAGIC
    table = _table(st, call, headers, arrival)
    if not source_failed:
        # The source went on, unaware: close the group so that its next collective fails at once, quoting this.
        _post(st, table)
        _state.close_group(table.splitlines()[0])
    if call.problem is None:
        raise DistributedOperationError(table)


def _post(st: ProcessState, table: str) -> None:
    group = _state.group
    if group.store is not None:
        with contextlib.suppress(Exception):  # the store is gone: the others' error says less, nothing worse
            _group.post_report(group.store, group.board, st.rank, table)


def _table(st: ProcessState, call: Call, headers: dict[int, bytes], arrival: Arrival) -> str:
    """Debug mode's table, from the headers this rank saw (a broadcast: the source's and its own)."""
    unpacked = {r: FORMAT.unpack(h) for r, h in headers.items() if h[:4] == MAGIC}
    if len({u[1] for u in unpacked.values()}) > 1 or len(unpacked) < len(headers):
        head = "the processes called different operations."
    elif any(u[2] & ERROR for u in unpacked.values()):
        head = "a process could not apply it to its input."
    elif len({u[7] for u in unpacked.values()}) > 1:
        head = "the inputs differ across processes."
    else:
        head = "the processes are out of step (they made different calls before this one)."
    lines = [f"Cannot apply accelkit.{call.op}: {head}"]
    for rank in range(st.world_size):
        if rank == st.rank:
            row = f"{call.describe()} (#{_state.group.seq})"
        elif rank in headers:
            row = _seen(headers[rank], arrival.rows[rank if len(arrival.lengths) > 1 else 0])
        else:
            row = "(not seen by this process: a broadcast reaches each process from the source only)"
        lines.append(f"  - Process {rank}: {row}")
    lines.append(
        "Fix: Every process must call the same collectives in the same order, with the same structure, dtypes "
        "and shapes (and the same src)."
    )
    return "\n".join(lines)


def _seen(header: bytes, row: torch.Tensor) -> str:
    """Another process's call, as its header shows it."""
    if header[:4] != MAGIC:
        return "a message that is no accelkit collective's (a torch.distributed call made directly?)"
    _, code, flags, dtype, ndim, _, seq, _, length, *dims = FORMAT.unpack(header)
    op = OPS[code - 1] if 0 < code <= len(OPS) else "?"
    if flags & ERROR:
        text = _bytes.read(row, row.numel(), 1, HEADER + length)[0][HEADER:]
        return f"accelkit.{op} #{seq} raised {text.decode(errors='replace')}"
    if dtype == TREE:
        what = f"{dims[0]} tensors ({length} bytes)" if ndim else f"{length} bytes"
    else:
        name = str(DTYPES[dtype]).removeprefix("torch.") if dtype < len(DTYPES) else "tensor"
        what = f"{name} {list(dims[:ndim])}" if ndim <= 7 else f"{name} of {ndim} dimensions"
    return f"accelkit.{op} #{seq} {what}"


def _out_of_step(op: str, headers: list[bytes]) -> str:
    lines = [f"Cannot apply accelkit.{op}: the processes are out of step: they agree on this call but made "
             f"different collective calls before it."]  # fmt: skip
    for rank, header in enumerate(headers):
        _, code, _, _, _, chain, seq, *_ = FORMAT.unpack(header)
        lines.append(f"  - Process {rank}: accelkit.{OPS[code - 1]} #{seq}, after calls with digest {chain:08x}")
    lines.append(
        "Fix: Every process must call the same collectives in the same order (a broadcast given another src on "
        "some processes, or a collective that only some processes called, puts them out of step)."
    )
    return "\n".join(lines)
