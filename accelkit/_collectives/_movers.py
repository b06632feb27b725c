"""What each checked collective's message holds; the channel's wire moves and judges it.

A mover moves a call's data two ways: unchecked (:meth:`data`: one backend call per leaf, as raw code
would, for a call the ranks already agreed on or a message too large to carry the token), and with the
call's token in the message (:meth:`tail`: the wire's). :meth:`rides` says which way a plan takes.

- :class:`Reduce`: the leaves grouped by the dtype they are reduced in (one all-reduce per group), the
  token's bits after the first group's data;
- :class:`Gather`: each rank's leaves' bytes, then its header;
- :class:`Broadcast`: the source's leaves, then its header, judged by each receiver.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _check, _exchange
from ._channel import Channel
from ._plan import Plan
from ._signature import Signature
from ._wire import Group, Verdict

__all__ = ["GATHER", "REDUCE", "TAIL_BYTES", "Broadcast", "Gather", "Mover", "Reduce", "planned"]

TAIL_BYTES = 1 << 20  # a gather's bytes per rank up to which the token rides in its message

Moved = tuple[list[torch.Tensor], Verdict]


class Reduce:
    __slots__ = ("key", "made", "op")

    def __init__(self, op: str) -> None:
        self.op = op
        self.key: tuple[str, Any] = ("reduce", op)
        self.made: dict[Any, list[Group]] = {}  # the groups of the leaves' dtypes (one leaf's: by its dtype)

    def data(self, ch: Channel, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exchange.reduce(leaves, self.op, ch.size, ch.group)

    def tail(self, ch: Channel, leaves: list[torch.Tensor], sig: Signature, seq: int, token: int) -> Moved:
        return ch.wire.reduce(self.op, self.groups(leaves), leaves, token, ch.group, ch.size)

    def rides(self, ch: Channel, leaves: list[torch.Tensor]) -> bool:
        """Unless the first group's dtype cannot count the ranks exactly (bfloat16 beyond 256 ranks, float16
        beyond 2048, 8-bit integers): then the check goes beside the data."""
        dtype, wire, _ = self.groups(leaves)[0]
        return _check.logic(wire) or ch.size <= _check.EXACT.get(dtype, 0)

    def groups(self, leaves: list[torch.Tensor]) -> list[Group]:
        """The leaves by the dtype and operation they are reduced with (the first leaf's first), in order: a dtype
        the backends cannot reduce in a wider one, booleans as bytes (sum and max: their or; product and min:
        their and), a mean as a sum."""
        key: Any = leaves[0].dtype if len(leaves) == 1 else tuple([x.dtype for x in leaves])
        found = self.made.get(key)
        if found is None:
            if len(self.made) >= 256:
                self.made.clear()
            groups: dict[tuple[torch.dtype, str], list[int]] = {}
            for i, x in enumerate(leaves):
                groups.setdefault(self.way(x.dtype), []).append(i)
            found = self.made[key] = [(dtype, wire, members) for (dtype, wire), members in groups.items()]
        return found

    def way(self, dtype: torch.dtype) -> tuple[torch.dtype, str]:
        if dtype == torch.bool:
            return torch.uint8, "max" if self.op in ("sum", "max") else "min"
        return _exchange.WIDER.get(dtype, dtype), "sum" if self.op == "mean" else self.op


class Gather:
    __slots__ = ()
    key: tuple[str, Any] = ("gather", None)

    def data(self, ch: Channel, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exchange.gather(leaves, ch.size, ch.group)

    def tail(self, ch: Channel, leaves: list[torch.Tensor], sig: Signature, seq: int, token: int) -> Moved:
        return ch.wire.gather(leaves, sig.header(seq), ch.group, ch.size)

    def rides(self, ch: Channel, leaves: list[torch.Tensor]) -> bool:
        """Up to :data:`TAIL_BYTES` per rank, where the wire holds the message: the results are copied out of it
        (every rank's header sits between the ranks' data); beyond, the data moves as raw code moves it (into
        the results), the check beside it."""
        nbytes = sum(x.numel() * x.element_size() for x in leaves)
        return nbytes <= TAIL_BYTES and ch.wire.holds(ch.size, tuple((x.dtype, x.shape) for x in leaves))


class Broadcast:
    __slots__ = ("key", "seen", "src")

    def __init__(self, src: int) -> None:
        self.src = src
        self.key: tuple[str, Any] = ("broadcast", src)
        self.seen: bytes | torch.Tensor | None = None  # a receiver's view of the source's header

    def data(self, ch: Channel, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exchange.broadcast(leaves, self.src, ch.me, ch.group)

    def tail(self, ch: Channel, leaves: list[torch.Tensor], sig: Signature, seq: int, token: int) -> Moved:
        out, verdict, self.seen = ch.wire.broadcast(leaves, sig.header(seq), self.src, ch.me == self.src, ch.group)
        return out, verdict

    def rides(self, ch: Channel, leaves: list[torch.Tensor]) -> bool:
        return True  # the header rides at any size: its message is the copy raw code makes anyway

    def theirs(self) -> bytes:
        """The source's header as this receiver saw it (read from the device, where it still is)."""
        seen = self.seen
        return bytes(seen.tolist()) if isinstance(seen, torch.Tensor) else seen or b""

    def source_missed(self, ch: Channel, plan: Plan, fits: bool) -> bool:
        """Whether the source's call was another than the plan's (then every rank knows it: a receiver from the
        source's header, where it has it on the host, or where it waits for the verdict anyway)."""
        if ch.me == self.src:
            return not fits
        if isinstance(self.seen, torch.Tensor) and fits:
            return False  # on the device: the verdict, read later, tells
        theirs = self.theirs()
        return bool(theirs) and int.from_bytes(theirs[16:24], "little") != plan.fingerprint


Mover = Reduce | Gather | Broadcast
GATHER = Gather()  # (a gather's and a reduction's movers keep nothing of a call: one each is enough)
REDUCE = {op: Reduce(op) for op in ("sum", "mean", "max", "min", "product")}


def planned(key: tuple[str, Any]) -> Mover:
    """The mover a plan names (a rank whose call differs from the plan still moves the planned message)."""
    kind, arg = key
    return REDUCE[arg] if kind == "reduce" else Broadcast(arg) if kind == "broadcast" else GATHER
