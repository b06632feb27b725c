"""A daemon thread per rank: it publishes where the rank is, and says whom a long wait is for.

The collectives themselves only replace ``_state.group.now``, an immutable snapshot (operation,
number, entry time, the call's fingerprint and text): nothing on their hot path touches the store,
and this thread never reads a live call or tensor. Every ``period`` seconds (1, longer beyond 256
ranks: :func:`heartbeat_period`) it reads the snapshot and, when it changed, publishes it with the
user's line the rank is running now. While the rank has been waiting in one collective for
``interval`` seconds (30 by default, ``ACCELKIT_WAIT_LOG_INTERVAL``; 0 turns it off), it prints one
line every ``interval`` seconds naming the ranks that have not arrived and where they are. A
collective timeout shorter than twice that brings the first line forward to half the timeout, so
that a wait the timeout ends still says, first, whom it waited for.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, NamedTuple

from .. import _env, _frames, _rundir
from ._board import Position, describe_missing, find_conflict, find_deadlock, post_report, publish, read_positions

__all__ = ["NOT_WAITING", "PASSES_THAT_WAIT", "Heartbeat", "Waiting", "first_line_after", "heartbeat_period",
           "wait_log_interval"]  # fmt: skip

DEFAULT_INTERVAL = 30.0
_TORCH = f"{os.sep}torch{os.sep}"  # the user's line is the one below torch's own frames
# The positions the heartbeats of a whole job may write to its store each second: beyond 256 ranks
# each one publishes less often (1024 ranks: every 4 s), so the store's load stays bounded.
STORE_WRITES_PER_S = 256.0
# Seconds a rank must have waited before a wait no rank can end fails the job (seen on two reads, the second
# CONFIRM seconds after the first, with no rank's position changed in between).
SETTLED = 8.0
CONFIRM = 4.0


def heartbeat_period(world: int, interval: float) -> float:
    """Seconds between two beats of each rank: 1 (less when ``interval`` is shorter), more in a large job.

    Example:
        >>> heartbeat_period(8, 30.0), heartbeat_period(1024, 30.0)
        (1.0, 4.0)
    """
    fresh = min(1.0, interval / 2) if interval > 0 else 1.0  # fresh enough that a timeout names the right ranks
    return max(fresh, world / STORE_WRITES_PER_S)


def wait_log_interval() -> float:
    """Seconds between two "still waiting" lines (``ACCELKIT_WAIT_LOG_INTERVAL``; 0: none)."""
    return _env.read_seconds(_env.WAIT_LOG_INTERVAL, DEFAULT_INTERVAL)


def first_line_after(interval: float, timeout: float | None) -> float:
    """Seconds into a wait of the first "still waiting" line: ``interval``, or half of a shorter ``timeout``.

    Example:
        >>> first_line_after(30.0, 600.0), first_line_after(30.0, 3.0), first_line_after(0.0, 3.0)
        (30.0, 1.5, 0.0)
    """
    return min(interval, timeout / 2) if interval > 0 and timeout else interval


class Heartbeat(threading.Thread):
    """Publishes this rank's position through ``store`` until :meth:`stop`.

    ``group`` is the state's ``GroupState`` (its ``now`` snapshot is read, nothing is written);
    ``store`` a client with a short timeout, used by this thread only; ``timeout`` the collectives'
    timeout in seconds (None: not known), which a wait's first line comes before.
    """

    def __init__(
        self, store: Any, prefix: str, rank: int, world: int, group: Any, interval: float, timeout: float | None = None
    ) -> None:
        super().__init__(name=f"accelkit-heartbeat-rank{rank}", daemon=True)
        self.store, self.prefix, self.rank, self.world, self.group = store, prefix, rank, world, group
        self.interval = interval
        self.first = first_line_after(interval, timeout)
        self.period = heartbeat_period(world, self.first)
        self._stopped = threading.Event()
        self._last: tuple[Any, ...] = ()
        self._reported = 0  # "still waiting" lines printed for the current wait
        self._next_read = 0.0  # seconds into the current wait when the positions are read next
        self._conflict = ""  # the last table of ranks waiting in different calls, printed once
        self._stuck: tuple[Any, ...] = ()  # the positions of the last read that found no rank could go on

    def start(self) -> None:
        self.beat()  # the rank's key exists before anyone can read it
        super().start()

    def stop(self, gone: str = "", where: str = "") -> None:
        """Stop publishing. ``gone``: the rank leaves the group (how: its code returned, or what it raised), said
        in a last position, at ``where``, so that a rank still waiting for it knows it will never come."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=10)
        if gone:
            now = self.group.now
            with contextlib.suppress(Exception):  # the store may be gone with the rank that hosted it
                publish(self.store, self.prefix, Position(self.rank, now.op, now.seq, False, time.time(), where,
                                                          time.time(), gone=gone))  # fmt: skip

    def run(self) -> None:
        while not self._stopped.wait(self.period):
            try:
                self.beat()
            except Exception:  # the store went away: the collectives say so themselves
                if self._stopped.wait(5 * self.period):
                    return

    def beat(self) -> None:
        """Publish the position if it changed; look for a conflict, or say whom a long wait is for."""
        g = self.group
        now = g.now  # an immutable snapshot the collectives replace whole: read once
        op, seq, inside = now.op, now.seq, now.inside
        signature = f"{now.fingerprint:016x}" if inside else ""
        where, (doing, blocked) = self._where(now.thread or threading.main_thread().ident or 0)
        doing = doing or now.doing
        wall, mono = time.time(), time.monotonic()
        state = (op, seq, inside, where, signature, doing, blocked)
        if state != self._last:
            since = wall - (mono - now.since) if now.since else wall
            publish(self.store, self.prefix, Position(self.rank, op, seq, inside, since, where, wall, signature,
                                                      now.text if inside else "", doing, blocked))  # fmt: skip
            self._last = state
            self._reported = 0
            self._next_read = 2 * self.period
        waited = mono - now.since
        line_due = self.interval > 0 and waited >= self.first + self.interval * self._reported
        if not inside or (waited < self._next_read and not line_due):
            return
        # Every waiting rank reads every rank's position: the longer the wait, the rarer the reads
        # (after 2, 4, 8, ... s), so that a long wait for one rank (a checkpoint) spares the store.
        self._next_read = 2 * waited
        positions = read_positions(self.store, self.prefix, self.world)
        conflict = find_conflict(self.rank, seq, signature, positions)
        if conflict and conflict != self._conflict:  # a wait that cannot end: say so once (the timeout ends it)
            self._conflict = conflict
            print("\n".join(f"accelkit: rank {self.rank}: {line}" for line in conflict.splitlines()),
                  file=sys.stderr, flush=True)  # fmt: skip
        stuck = find_deadlock(self.rank, seq, signature, positions, self.world, SETTLED)
        seen = tuple(sorted(positions.items())) if stuck else ()
        if stuck and seen == self._stuck:  # two reads apart, nothing moved: no wait of any rank can end
            self._give_up(stuck, where)
        if stuck:
            self._next_read = min(self._next_read, waited + CONFIRM)
        self._stuck = seen
        if line_due:
            self._reported += 1
            self._say_waiting(op, seq, waited, positions)

    def _give_up(self, table: str, where: str) -> None:
        """End this process: no rank can make progress (see ``find_deadlock``). Its main thread waits in the
        backend, where nothing reaches it, so the error is said here (stderr, the launcher's failure record, the
        store for the other ranks) and the process exits with code 1; the launcher then stops the others."""
        from ..errors import DistributedOperationError

        error = DistributedOperationError(table)
        print("\n".join(f"accelkit: rank {self.rank}: {line}" for line in table.splitlines()), file=sys.stderr)
        with contextlib.suppress(Exception):
            post_report(self.store, self.prefix, self.rank, table)
        _rundir.record_failure(error, f"rank {self.rank} waits in it, running {where}")
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(1)

    def _say_waiting(self, op: str, seq: int, waited: float, positions: dict[int, Position]) -> None:
        missing = describe_missing(self.rank, op, seq, positions, list(range(self.world)))
        head, _, details = missing.partition("\n")
        ranks = head.removeprefix("processes ").removeprefix("process ").removesuffix(" never reached it")
        whom = f"rank {ranks}" if head != "every other process reached it" else "the others"
        lines = [f"accelkit: rank {self.rank}: still waiting for {whom} at {op} #{seq} ({waited:.0f} s)"]
        lines += [f"accelkit: rank {self.rank}: {line.strip()}" for line in details.splitlines()]
        print("\n".join(lines), file=sys.stderr, flush=True)

    @staticmethod
    def _where(thread: int) -> tuple[str, Waiting]:
        """The user's line ``thread`` runs, and how a pass that waits it is inside waits (``PASSES_THAT_WAIT``)."""
        frame = sys._current_frames().get(thread) if thread else None
        inner = frame
        while frame is not None and (_frames.is_ours(frame.f_code.co_filename) or _TORCH in frame.f_code.co_filename):
            frame = frame.f_back
        user = frame or inner  # all of it torch's (a script run by torch itself): the innermost line
        if user is None:
            return "<not in Python code>", NOT_WAITING
        return f"{user.f_code.co_filename}:{user.f_lineno} in {user.f_code.co_name}", _in_pass(inner)


class Waiting(NamedTuple):
    """How a rank waits for the others outside the collectives: what it does ("": nothing that waits), and
    whether that cannot end without every other rank (``blocked``: proof, where a forward only may wait)."""

    doing: str
    blocked: bool


NOT_WAITING = Waiting("", False)
# The code of the passes that may wait for the other ranks outside accelkit's collectives (DDP's forward,
# ak.backward's all-reduce), each with what says how it waits now, given the frames it runs (innermost
# first). The heartbeat finds them on the rank's stack, so that the step path itself marks nothing.
PASSES_THAT_WAIT: dict[CodeType, Callable[[list[FrameType]], Waiting]] = {}


def _in_pass(frame: FrameType | None) -> Waiting:
    found, inside = NOT_WAITING, list[FrameType]()
    while frame is not None:
        waits = PASSES_THAT_WAIT.get(frame.f_code)
        how = waits(inside) if waits is not None else NOT_WAITING
        if how.blocked:
            return how
        found = found if found.doing else how
        inside.append(frame)
        frame = frame.f_back
    return found
