"""Why the ranks of a failed job were out of step, where the backend itself gave up.

A collective that only some ranks reach meets, in the backend, whatever the other ranks call next: the
gradient all-reduce of their backward, or another collective. gloo then aborts a process ("Received data
size doesn't match expected size": SIGABRT), and the others lose their peer. The failures alone say "rank 1
died from SIGABRT"; where each rank was says why. That comes from the stacks each rank left (the one that
aborted, and those the launcher stopped with SIGTERM), the records of those that raised, and the positions
the ranks' heartbeats published.
"""

from __future__ import annotations

from .._group import Position
from .._rundir import Spot
from ..errors import WorkerFailure

__all__ = ["explain"]

_SIGTERM, _SIGKILL = 15, 9
# Every rank must call these, in the same order (ak.save_state and the like meet first: see _group.meet).
_COLLECTIVE_NAMES = ("gather", "gather_object", "gather_for_metrics", "reduce", "broadcast", "broadcast_object",
                     "pad_across_processes", "wait_for_everyone")  # fmt: skip
COLLECTIVES = frozenset(f"ak.{name}" for name in _COLLECTIVE_NAMES)


def explain(failures: list[WorkerFailure], spots: dict[int, Spot], positions: dict[int, Position]) -> str:
    """A headline naming the collective some ranks reached alone and where the others were, when the first
    failure (root cause first) is a death inside the backend or a lost peer; "" when nothing shows it."""
    if not failures or not _in_backend(failures[0]):
        return ""
    ranks = sorted(set(spots) | set(positions) | {f.rank for f in failures})
    places = {r: _place(spots.get(r), positions.get(r)) for r in ranks}
    reached: dict[Spot, list[int]] = {}
    for r, spot in places.items():
        if spot is not None and spot.call in COLLECTIVES:
            reached.setdefault(spot, []).append(r)
    if not reached or (len(reached) == 1 and len(next(iter(reached.values()))) == len(ranks)):
        return ""
    spot, alone = max(reached.items(), key=lambda item: len(item[1]))
    others = [r for r in ranks if r not in alone]
    who = f"rank{'s' if len(alone) > 1 else ''} {', '.join(map(str, alone))}"
    lines = [f"{spot.call} at {spot.line} was reached by {who} alone; the backend met another call there and gave up:"]
    for r in others:
        place = places[r]
        doing = f"in {place}" if place is not None else "at an unknown place (no stack or position left)"
        if place is not None and place.call == "ak.backward":
            doing += " (a backward that all-reduces gradients, in the backend like any collective)"
        lines.append(f"  - rank {r} was {doing}")
    lines.append(
        "Fix: every process must call the same collectives in the same order: a collective under "
        "`if ak.is_main_process():` (or another test of the rank) is reached by that process alone; call it on "
        "every process (each can use the result, or not)."
    )
    return "\n".join(lines)


def _in_backend(first: WorkerFailure) -> bool:
    """The root failure is a death by signal inside the process (an abort, a crash), or a peer lost."""
    died = not first.exc_type and first.exitcode is not None and first.exitcode < 0
    return first.lost_peer or (died and -first.exitcode not in (_SIGTERM, _SIGKILL))  # type: ignore[operator]


def _place(spot: Spot | None, position: Position | None) -> Spot | None:
    """Where a rank was: its stack's spot; else what its heartbeat last published."""
    if spot is not None:
        return spot
    if position is None or position.gone:
        return None
    call = f"ak.{position.op}" if position.inside else ""
    return Spot(call, position.where)
