"""Plans: what every rank sends at a point of the program, fixed by a call they all agreed on.

A point of the program is known by the call before it (its fingerprint, the same on every rank
that is in step). The first call at a point is checked on its own before any data moves (a small
all-reduce of the call's token), since only then may a size chosen from one rank's input be sent.
Once every rank agreed on a call there, its shapes become the point's plan, and the next call at
that point sends the planned message straight away with its token in it: a rank whose call
differs sends the planned sizes all the same (no backend ever sees messages of different sizes)
and every rank learns from the tokens that the plan was missed.

A point may be followed by several calls (a loop's last step, an evaluation every N steps): it
keeps a plan for each call agreed there (up to ``_ALTERNATIVES``) and sends the one agreed most
often, so that a rare successor misses once and the usual one does not miss after it. The counts
change only with calls every rank agreed on, so every rank chooses alike; a disagreement makes
every rank that raises forget the plans (a caught one must not leave the counts apart).

A plan carries the token in its data message (one backend call): at the end of a reduction's data,
as bits reduced along with it, or as the 64-byte header after a gather's or a broadcast's bytes.
The message is a fresh buffer that replaces the copy raw code makes of the input (a reduction's
clone, a broadcast source's), and the first result is that buffer itself (its data at offset 0,
the token after it): a reduction or a broadcast costs raw code's copies at any size. A gather's
results are copied out of its message (every rank's header sits between the ranks' data), so a large
gather moves as raw code moves it (into the result, no copy), the check beside it, begun first. So
does a reduction whose dtype cannot count the ranks exactly. Each mover says which (``rides``).
"""

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ._exchange import full
from ._signature import Signature

if TYPE_CHECKING:
    from ._scratch import Buffer
    from ._wire import Again

__all__ = ["Plan", "Point", "learn"]

_MAX_PLANS = 1024  # points; beyond, every rank forgets them all alike
_ALTERNATIVES = 8  # calls remembered per point; beyond, the one agreed least often goes


class Plan(NamedTuple):
    """The message every rank sends at one point of the program."""

    fingerprint: int  # the call it was made from
    mover: tuple[str, Any]  # how the data moves: ("reduce", op), ("gather", None) or ("broadcast", src)
    shapes: tuple[tuple[torch.dtype, torch.Size], ...]  # the data's leaves (a rank that differs sends zeros)
    tail: bool  # the token rides in the data message (else: a check beside it)
    sig: Signature  # the call it was made from
    # A call of one bare tensor whose token rides: (operation, its argument, dtype, shape), what a call must
    # match to be run again as it is (``_checked.again``), without being described anew; else None.
    bare: tuple[str, Any, torch.dtype, torch.Size] | None

    def dummies(self, device: torch.device) -> list[torch.Tensor]:
        """Zeros shaped like the planned data: what a rank whose call differs sends."""
        return [full(shape, 0, dtype, device) for dtype, shape in self.shapes]


class Point:
    """The calls every rank agreed on at one point of the program, and the plan it sends: the one agreed
    most often (the latest among equals)."""

    __slots__ = ("counts", "plan", "plans", "quick")

    def __init__(self) -> None:
        self.plans: dict[int, Plan] = {}
        self.counts: dict[int, int] = {}
        self.plan: Plan | None = None
        # The plan's bare call as the wire prepared it: (plan, the thread's buffer it was made in, the prepared
        # call or None); made again when the plan or the buffer changes (see ``_checked.again``).
        self.quick: tuple[Plan, Buffer | None, Again | None] | None = None

    def agreed(self, fingerprint: int) -> None:
        """Every rank made the call ``fingerprint`` here (a planned one, or one just learned)."""
        counts = self.counts
        counts[fingerprint] += 1
        plan = self.plan
        if plan is None or (plan.fingerprint != fingerprint and counts[fingerprint] >= counts[plan.fingerprint]):
            self.plan = self.plans[fingerprint]


def learn(points: dict[int, Point], key: int, sig: Signature, mover: tuple[str, Any], data: list[torch.Tensor],
          tail: bool, bare: tuple[str, Any, torch.dtype, torch.Size] | None) -> None:  # fmt: skip
    """After a call every rank agreed on, another than ``key``'s plan: remember it as one to plan there."""
    fingerprint = sig.fingerprint
    if len(points) >= _MAX_PLANS:
        points.clear()
    point = points.get(key)
    if point is None:
        point = points[key] = Point()
    if fingerprint not in point.plans and len(point.plans) >= _ALTERNATIVES:
        rarest = min(point.counts, key=point.counts.__getitem__)
        del point.plans[rarest], point.counts[rarest]
        if point.plan is not None and point.plan.fingerprint == rarest:
            point.plan = None
    shapes = tuple((x.dtype, x.shape) for x in data)
    point.plans[fingerprint] = Plan(fingerprint, mover, shapes, tail, sig, bare if tail else None)
    point.counts.setdefault(fingerprint, 0)
    point.agreed(fingerprint)
