"""When the ranks' calls differ: every rank of the group that can tell raises debug mode's table.

A two-way collective's ranks all read the same verdict, so they all come here and describe their
calls to each other in full (:mod:`._debug`'s exchange over the group, fixed sizes) before raising. A
broadcast's receiver saw only the source's header: it raises with what it saw, posts its table to the
job's store and closes the group, so that the source, which went on unaware, fails at its next collective.
"""

from __future__ import annotations

import contextlib

from .. import _group, _state
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _debug
from ._channel import Channel, describe
from ._signature import ERROR, FORMAT, MAGIC, Call, describe_header

__all__ = ["disagree", "refuse_broadcast"]


def disagree(st: ProcessState, ch: Channel, call: Call) -> None:
    """Every rank read that the calls differ: compare them in full and raise (a rank whose input was
    invalid returns; it raises its own error)."""
    _debug.check(st.device, ch.group, ch.ranks, call.op, call.params, call.leaf_shapes(), call.spec, call.free_dim,
                 call.problem, call.seq)  # fmt: skip
    if call.problem is None:  # the calls look alike: only the count of calls before them differs
        raise DistributedOperationError(
            f"Cannot apply accelkit.{call.op}{_where(ch)}: the processes are out of step: they agree on this call "
            f"({call.sig.text}) but not on its number (#{call.seq} here).\nFix: Every process must call the same "
            f"collectives in the same order (a collective that only some processes called puts them out of step)."
        )


def refuse_broadcast(st: ProcessState, ch: Channel, call: Call, src: int, theirs: bytes) -> None:
    """A receiver found that the source's header differs from its own call: raise, and tell the source."""
    source_failed = theirs[:4] == MAGIC and bool(FORMAT.unpack(theirs)[2] & ERROR)
    table = _table(st, ch, call, src, theirs, source_failed)
    if not source_failed:
        # The source went on, unaware: close the group so that its next collective fails at once, quoting this.
        group = _state.group
        if group.store is not None:
            with contextlib.suppress(Exception):  # the store is gone: the others' error says less, nothing worse
                _group.post_report(group.store, group.board, st.rank, table)
        _state.close_group(table.splitlines()[0])
    if call.problem is None:
        raise DistributedOperationError(table)


def _table(st: ProcessState, ch: Channel, call: Call, src: int, theirs: bytes, source_failed: bool) -> str:
    if source_failed:
        head = f"process {src} (the source) could not apply it to its input."
    elif theirs[:4] != MAGIC or theirs[4] != FORMAT.unpack(call.sig.header(call.seq))[1]:
        head = "the processes called different operations."
    elif FORMAT.unpack(theirs)[5] != call.seq:
        head = "the processes are out of step (they made a different number of calls before this one)."
    else:
        head = "the inputs differ across processes."
    lines = [f"Cannot apply accelkit.{call.op}{_where(ch)}: {head}"]
    for rank in ch.ranks:
        if rank == st.rank:
            row = f"{call.sig.text} (#{call.seq})" if call.problem is None else f"{call.sig.text} raised {call.problem}"
        elif rank == src:
            row = describe_header(theirs)
        else:
            row = "(not seen by this process: a broadcast reaches each process from the source only)"
        lines.append(f"  - Process {rank}: {row}")
    lines.append(
        "Fix: Every process must call the same collectives in the same order, with the same structure, dtypes "
        "and shapes (and the same src)."
    )
    return "\n".join(lines)


def _where(ch: Channel) -> str:
    return "" if ch.world else f" over the process group of processes {describe(ch.ranks)}"
