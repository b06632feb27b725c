"""Plans: what every rank sends at a point of the program, fixed by a call they all agreed on.

A point of the program is known by the call before it (its fingerprint, the same on every rank
that is in step). The first call at a point is checked on its own before any data moves (a small
all-reduce of the call's token), since only then may a size chosen from one rank's input be sent.
Once every rank agreed on a call there, its shapes become the point's plan, and the next call at
that point sends the planned message straight away with its token in it: a rank whose call
differs sends the planned sizes all the same (no backend ever sees messages of different sizes)
and every rank learns from the tokens that the plan was missed.

A plan of a small call carries the token in its data message (one backend call): at the end of a
reduction's data, as bits reduced along with it, or as the 64-byte header after a gather's or a
broadcast's bytes. The copies that costs (the data into the message, the results out of it) are
cheaper than a second backend call while the data is small (a call costs a round trip and, on two
cores, a thread's turn). Beyond ``TAIL_BYTES`` per rank the copies cost more: the data then moves
exactly as raw code moves it (into the result, no copy) and the check goes beside it, begun first
and overlapping the data. So does a reduction whose dtype cannot count the ranks exactly (bfloat16
beyond 256 ranks, float16 beyond 2048, 8-bit integers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _check
from ._exchange import WIDER

__all__ = ["Plan", "learn"]

TAIL_BYTES = 1 << 16  # the data's bytes per rank up to which the token rides in the data message
_MAX_PLANS = 1024  # beyond, every rank forgets them all alike


@dataclass(frozen=True)
class Plan:
    """The message every rank sends at one point of the program."""

    fingerprint: int  # the call it was made from
    mover: tuple[str, Any]  # how the data moves: ("reduce", op), ("gather", None) or ("broadcast", src)
    shapes: tuple[tuple[torch.dtype, torch.Size], ...]  # the data's leaves (a rank that differs sends zeros)
    tail: bool  # the token rides in the data message (else: a check beside it)

    def dummies(self, device: torch.device) -> list[torch.Tensor]:
        """Zeros shaped like the planned data: what a rank whose call differs sends."""
        return [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in self.shapes]


def learn(plans: dict[int, Plan], key: int, fingerprint: int, mover: tuple[str, Any], data: list[torch.Tensor],
          world: int) -> None:  # fmt: skip
    """After a call every rank agreed on: plan the next call at ``key`` like it."""
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    shapes = tuple((x.dtype, x.shape) for x in data)
    plans[key] = Plan(fingerprint, mover, shapes, _tail(data, mover, world))


def _tail(data: list[torch.Tensor], mover: tuple[str, Any], world: int) -> bool:
    """Whether the token rides in the data message (else: a check beside it)."""
    if not data or sum(x.numel() * x.element_size() for x in data) > TAIL_BYTES:
        return False
    if mover[0] != "reduce":
        return True
    first = WIDER.get(data[0].dtype, data[0].dtype)
    wire = "sum" if mover[1] == "mean" else mover[1]
    return _check.logic(first, wire) or world <= _check.EXACT.get(first, 0)
