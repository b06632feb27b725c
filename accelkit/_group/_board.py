"""What the ranks of a job tell each other through its store: where each one is, and what went wrong.

- **Positions.** Each rank's heartbeat publishes where it is: its current or last collective
  (operation and sequence number), whether it is inside it and since when, and the line of user
  code it is running now. A rank that waits in a collective reads the others' to say whom it
  waits for and where they are, while it waits and when it gives up.
- **Reports.** A rank that closes the group (a broadcast found the ranks out of step) posts why,
  so that the other ranks' next collective quotes the cause, not just "connection closed".

Torch-free: the store is any object with torch's ``Store`` methods.
"""

import json
import time
from typing import Any, NamedTuple

__all__ = ["LATEST_BOARD", "Position", "describe_missing", "find_conflict", "find_deadlock", "post_report",
           "publish", "read_positions", "read_reports"]  # fmt: skip

# The key under which the main rank names the board of the group it formed last: a launcher that hosts the
# job's store reads the ranks' last positions there after a failure (each group has a board of its own).
LATEST_BOARD = "accelkit/board"


class Position(NamedTuple):
    """Where one rank was when its heartbeat last published.

    Example:
        >>> p = Position(1, "gather", 41, False, time.time() - 31, "train.py:57 in main", time.time())
        >>> p.describe(time.time())
        'at gather #41 (left it 31 s ago), running train.py:57 in main'
    """

    rank: int
    op: str  # the current or last collective ("" before the first)
    seq: int  # its number: the rank's count of collectives so far
    inside: bool  # waiting in it now
    since: float  # wall-clock time it entered (inside) or left (not inside) that collective
    where: str  # the user's code the rank runs now, ``file:line in function``
    published: float  # wall-clock time of this report
    signature: str = ""  # inside: what two ranks in the same call share (operation, arguments, shapes)
    call: str = ""  # inside: the call as debug mode's tables show it
    doing: str = ""  # a pass that may wait for the other ranks outside the collectives (see _meet)
    blocked: bool = False  # that pass cannot end without every other rank (a backward that all-reduces gradients)
    gone: str = ""  # the rank left the group: how (its code returned, or what it raised); "" while it is in it

    @property
    def label(self) -> str:
        return f"{self.op} #{self.seq}" if self.op else "no collective yet"

    def describe(self, now: float) -> str:
        if self.gone:
            after = f"after {self.label}" if self.op else "before its first collective"
            return f"gone: {self.gone} ({after})" + (f", at {self.where}" if self.where else "")
        if not self.op:
            state = "before its first collective"
        elif self.inside:
            state = f"at {self.label} (waiting in it for {_seconds(now - self.since)})"
        else:
            state = f"at {self.label} (left it {_seconds(now - self.since)} ago)"
        # Published when it changed: a rank that stays on one line (time.sleep, a long step) is there
        # since then, alive or not; "last heard from ... ago" read as dead.
        there = now - self.published
        since = f" (there for {_seconds(there)})" if there > 10 else ""
        doing = f", in {self.doing}" if self.doing else ""
        return f"{state}{doing}, running {self.where}{since}"


def publish(store: Any, prefix: str, position: Position) -> None:
    store.set(f"{prefix}/position/{position.rank}", json.dumps(position._asdict()))


def read_positions(store: Any, prefix: str, world: int) -> dict[int, Position]:
    """Every rank's last published position (each publishes once when its group forms)."""
    keys = [f"{prefix}/position/{rank}" for rank in range(world)]
    found = {}
    for raw in store.multi_get(keys):
        try:
            fields = json.loads(raw)
            found[int(fields["rank"])] = Position(**fields)
        except (ValueError, TypeError, KeyError):
            continue
    return found


def describe_missing(rank: int, op: str, seq: int, positions: dict[int, Position], among: list[int]) -> str:
    """Which of ``among`` have not reached ``op #seq`` (this rank's), and where each one is.

    Example:
        >>> now = time.time()
        >>> seen = {1: Position(1, "gather", 41, False, now, "t.py:5 in f", now)}
        >>> print(describe_missing(0, "reduce", 42, seen, [1]))
        process 1 never reached it
          - process 1: at gather #41 (left it 0 s ago), running t.py:5 in f
    """
    now = time.time()
    missing = [r for r in among if r != rank and not _reached(positions.get(r), op, seq)]
    if not missing:
        return "every other process reached it"
    names = ", ".join(map(str, missing))
    lines = [f"process{'es' if len(missing) > 1 else ''} {names} never reached it"]
    for r in missing:
        where = positions[r].describe(now) if r in positions else "no position published (it may be gone)"
        lines.append(f"  - process {r}: {where}")
    return "\n".join(lines)


def find_conflict(rank: int, seq: int, signature: str, positions: dict[int, Position]) -> str:
    """A table when some rank waits in call ``#seq`` too, but another call: no such wait can end; else "".

    Two ranks in different collectives of the same number can be stuck in different backend calls
    (a broadcast and an all-gather, or two sources of one broadcast) that will never meet.
    """
    mine = positions.get(rank)
    if mine is None or not signature:
        return ""
    same = {r: p for r, p in positions.items() if p.seq == seq and p.inside and p.signature}
    if rank not in same or all(p.signature == signature for p in same.values()):
        return ""
    now = time.time()
    lines = [f"Cannot apply accelkit.{mine.op}: the processes called different collectives as #{seq}."]
    for r in sorted(positions):
        p = positions[r]
        lines.append(f"  - Process {r}: {p.call if r in same else p.describe(now)}")
    lines.append("Fix: Every process must call the same collectives in the same order, with the same arguments.")
    return "\n".join(lines)


def find_deadlock(
    rank: int, seq: int, signature: str, positions: dict[int, Position], world: int, settled: float
) -> str:
    """A table when no rank can make progress, else "": this rank has waited in call ``#seq`` for ``settled``
    seconds, and every rank not in that call with it waits where it cannot go on without the others: in another
    collective, in a pass that needs every rank (a backward that all-reduces gradients), or gone from the group.

    Only such proof counts. A rank that may still be working (a forward, the user's code, a wait for I/O, busy
    or idle) will come, or fail by itself: it is waited for, and only the collective timeout ends that wait.
    """
    now = time.time()
    mine = positions.get(rank)
    if mine is None or not mine.inside or len(positions) < world or now - mine.since < settled:
        return ""
    with_me = sorted(r for r, p in positions.items() if p.inside and p.seq == seq and p.signature == signature)
    if len(with_me) == len(positions) or not all(
        r in with_me or p.inside or p.blocked or p.gone for r, p in positions.items()
    ):
        return ""
    who = f"process{'es' if len(with_me) > 1 else ''} {', '.join(map(str, with_me))}"
    lines = [
        f"Cannot complete accelkit.{mine.op} #{seq} ({mine.where}): {who} alone reached it, and no process can make "
        f"progress: the others wait where they cannot go on without it, or are gone."
    ]
    for r in sorted(positions):
        p = positions[r]
        lines.append(f"  - Process {r}: {p.call if r in with_me else p.describe(now)}")
    lines.append(
        "Fix: every process must call the same collectives in the same order: a collective under "
        "`if ak.is_main_process():` (or another test of the rank) is reached by that process alone; call it on "
        "every process (each can use the result, or not)."
    )
    return "\n".join(lines)


def post_report(store: Any, prefix: str, rank: int, text: str) -> None:
    store.append(f"{prefix}/reports", json.dumps([rank, text]) + "\n")


def read_reports(store: Any, prefix: str) -> list[tuple[int, str]]:
    """What ranks posted before closing the group, oldest first."""
    key = f"{prefix}/reports"
    if not store.check([key]):
        return []
    reports = []
    for line in store.get(key).decode().splitlines():
        try:
            rank, text = json.loads(line)
            reports.append((int(rank), str(text)))
        except (ValueError, TypeError):
            continue
    return reports


def _reached(position: Position | None, op: str, seq: int) -> bool:
    return position is not None and position.seq >= seq and (position.seq > seq or position.inside)


def _seconds(value: float) -> str:
    return f"{max(0.0, value):.0f} s"
