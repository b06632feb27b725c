"""A meeting before a collective step that a script may call on one rank only (``save_state``).

``if ak.is_main_process(): ak.save_state(...)`` is a habit from single-process code. The main rank
then waits in the save's first collective while the others go on to the next step, whose backward
pass waits for it in DDP's own all-reduce: a hang until the collective timeout, or, when the two
backend calls differ in size, an abort inside gloo. So before its first collective a collective
step meets through the job's store: each rank adds itself to a count, and while the others are
missing it waits for the last one's word (in the store, so that it goes on the moment the last rank
arrives) and reads their positions (the heartbeat's); a missing rank that waits in a synchronising
backward pass will never come, and every rank that got here raises, naming it and where it is.
A rank that is merely slow is waited for (up to the collective timeout). A position is as old as
the rank's last beat, so a rank that left such a pass a moment ago may still read as in it: one
counts as stuck only once it has read so, unchanged, for ``_SURE`` seconds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..errors import DistributedOperationError

if TYPE_CHECKING:
    from ._board import Position

__all__ = ["DDP_SYNCING", "MAY_SYNC", "SYNCING", "meet"]

# What a rank publishes while it runs a pass that waits for the other ranks outside the collectives: one that
# cannot end without them (a backward that all-reduces gradients, DDP's own synchronisation), and one that may.
SYNCING = "a backward pass that all-reduces gradients (it waits for every process)"
DDP_SYNCING = "DDP's forward, synchronising buffers or buckets (it waits for every process)"
MAY_SYNC = "a forward pass (it may wait for the other processes)"

_POLL = 0.05  # seconds between two reads of the positions, at first; doubling to 1 s
_SURE = 3.0  # seconds a missing rank must read as stuck, unchanged: a few beats of a loaded machine


def meet(store: Any, board: str, name: str, number: int, rank: int, world: int, timeout: float) -> None:
    """Wait until every rank reached the ``number``-th ``name`` of this group; raise when one never will:
    a missing rank in a pass that cannot end without the others (``Position.blocked``), or gone."""
    key = f"{board}/meet/{name}/{number}"
    store.set(f"{key}/{rank}", "1")
    if store.add(key, 1) >= world:
        store.set(f"{key}/all", "1")  # the others wake up at once
        return
    from ._board import read_positions  # the heartbeat's board, read while a rank is missing

    deadline, pause = time.monotonic() + timeout, _POLL
    seen: dict[int, tuple[Position, float]] = {}  # a missing rank read as stuck: how, and since when
    while time.monotonic() < deadline:
        if _all_came(store, f"{key}/all", pause) or store.add(key, 0) >= world:
            return
        pause = min(1.0, 2 * pause)
        now = time.monotonic()
        missing = [r for r in range(world) if r != rank and not store.check([f"{key}/{r}"])]
        stuck = {r: p for r, p in read_positions(store, board, world).items() if r in missing and (p.blocked or p.gone)}
        seen = {r: seen[r] if r in seen and seen[r][0] == p else (p, now) for r, p in stuck.items()}
        sure = {r: p for r, (p, since) in seen.items() if now - since >= _SURE}
        if sure:
            raise DistributedOperationError(_message(name, rank, sure))
    # Out of time: the step's own collective names who is missing, as any collective does.


def _all_came(store: Any, key: str, seconds: float) -> bool:
    """Whether the last rank's ``key`` appears in the store within ``seconds``.

    Polled, a 32nd of ``seconds`` (1 ms at least) after the first look, then twice as long each time:
    about five reads of the store a call, where a store wait that times out logs two lines of torch's
    C++ (``[c10d] waitForInput ... likely a timeout``) on every try, which a rank waiting for one that
    will never come printed a dozen times.
    """
    end, pause = time.monotonic() + seconds, max(0.001, seconds / 32)
    while not store.check([key]):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause *= 2
    return True


def _message(name: str, rank: int, stuck: dict[int, Position]) -> str:
    now = time.time()
    lines = [
        f"accelkit.{name} on process {rank}: every process must call {name} (it is collective), but "
        f"process{'es' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} went on without it:"
    ]
    lines += [f"  - process {r}: {p.describe(now)}" for r, p in sorted(stuck.items())]
    lines.append(
        f"Fix: call ak.{name}(...) on every process, not under `if ak.is_main_process():` (only the main "
        f"process writes the files that every process shares)."
    )
    return "\n".join(lines)
