"""One collective's scope: numbered on its channel, where the rank is published for the heartbeat, a backend failure
named.

Only calls over the world's channel are published (``_state.group.now``): the heartbeat compares every
rank's position by number, and a sub-group's calls are numbered on their own."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

from .. import _group, _state
from .._state import Now, ProcessState
from ..errors import DistributedOperationError
from . import _exchange, _signature
from ._channel import Channel, describe
from ._signature import Call

__all__ = ["begin", "collective", "communication", "end", "failed"]


@contextlib.contextmanager
def communication(st: ProcessState, op: str) -> Iterator[None]:
    """Turn a backend failure in the body into an error naming ``op``."""
    try:
        yield
    except _exchange.CommunicationError as exc:
        failed(op, st, exc)


class collective:
    """One collective over ``ch``: numbered, its start and end published for the heartbeat (the world's), a
    backend failure named (:func:`begin` and :func:`end` around the body)."""

    __slots__ = ("call", "ch", "st")

    def __init__(self, st: ProcessState, ch: Channel, call: Call) -> None:
        self.st, self.ch, self.call = st, ch, call

    def __enter__(self) -> None:
        call = self.call
        call.seq, call.token = begin(self.st, self.ch, call.sig)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        end(self.ch)
        if isinstance(exc, _exchange.CommunicationError):
            failed(self.call.op, self.st, exc, self.ch)


def begin(st: ProcessState, ch: Channel, sig: _signature.Signature) -> tuple[int, int]:
    """A collective of kind ``sig`` begins over ``ch``: its number there and its token. The earlier calls' messages
    are let go; over the world's channel, where the rank is is published (the heartbeat thread reads only
    ``group.now``, an immutable snapshot this thread replaces)."""
    group = _state.group
    if group.closed:
        _refuse_closed(st, group.closed)
    seq = ch.seq = ch.seq + 1
    _exchange.release()
    if ch.world:
        # Every field given, without Now(...)'s Python frame: one each way per call.
        fields = (sig.op, seq, True, time.monotonic(), threading.get_ident(), sig.fingerprint, sig.text, "")
        group.now = tuple.__new__(Now, fields)
    return seq, _signature.token(sig, seq)


def end(ch: Channel) -> None:
    """The collective begun over ``ch`` ended (or failed): the rank is no longer inside it."""
    if ch.world:
        group = _state.group
        now = group.now
        group.now = tuple.__new__(Now, (now.op, now.seq, False, time.monotonic(), now.thread, 0, "", ""))


def _refuse_closed(st: ProcessState, reason: str) -> NoReturn:
    raise DistributedOperationError(
        f"the process group of process {st.rank} was closed: {reason}\nEvery process must call the "
        f"same collectives in the same order; fix the call above and start the job again."
    )


def failed(op: str, st: ProcessState, error: _exchange.CommunicationError, ch: Channel | None = None) -> NoReturn:
    """Name the operation in a backend failure (a timeout, a lost peer), and the ranks it waited for."""
    exc = error.cause
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = f"accelkit.{op}" + (f" #{ch.seq}" if ch is not None else "")
    if ch is None or ch.world:
        where = _whereabouts(st, op, ch.seq if ch is not None else None)
    else:
        name += f" over the process group of processes {describe(ch.ranks)}"
        where = []
    lines = [f"{name} failed on process {st.rank} of {st.world_size}: {first}", *where]
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
        positions = _group.read_positions(group.store, group.board, st.world_size)
        if group.heartbeat is not None and not all(p.gone for r, p in positions.items() if r != st.rank):
            time.sleep(group.heartbeat.period)  # a fresh position from every rank still in the group
            positions = _group.read_positions(group.store, group.board, st.world_size)
        return _group.describe_missing(st.rank, op, seq, positions, list(range(st.world_size))).splitlines()
    except Exception:  # the store went with the rank that hosted it
        return []
