"""How a checked collective's message travels and is judged: one :class:`Wire` per process, chosen from its Backend.

A mover (:mod:`._movers`) says what a message holds; the wire places it in memory, moves it over the
channel's process group and reads the verdict from it. Two wires:

- the **host wire** (:mod:`._host`): messages in host memory, small ones through each thread's reused
  buffer, headers and token bits compared as bytes: the verdict at once;
- the **device wire** (:mod:`._device`): messages on the device, compared there; the verdict is a reader
  from ``Backend.read_later``, called at the rank's next collective, so that the host never waits for it.

What the two share is here: the check on its own, the check beside a message, and a reduction's and a
broadcast's fresh message (the device wire's always, the host wire's beyond its buffer's share): for a
reduction the data, then the token's bits; for a broadcast the data in the leaves' own dtype where they
share a native one, else as bytes, then the header.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _check, _exchange
from ._signature import HEADER, Signature

__all__ = ["Again", "Bare", "Group", "Verdict", "Wire", "read"]

# Whether every rank made the same call: known now, or a reader to call later (it waits for the device).
Verdict = bool | Callable[[], bool]
# A reduction's leaves that travel together: the dtype and operation they are reduced with, and which leaves.
Group = tuple[torch.dtype, str, list[int]]
# A plan's call of one bare tensor (operation, its argument, dtype, shape), and that call prepared by a wire:
# (tensor, call number, token) -> (result, verdict, what a broadcast's receiver saw of the source's header).
Bare = tuple[str, Any, torch.dtype, torch.Size]
Again = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, bool, bytes | None]]


def read(verdict: Verdict) -> bool:
    """The verdict now (a reader waits for the device)."""
    return verdict() if callable(verdict) else verdict


class Wire:
    """What the wires share; :meth:`gather`, :meth:`judge_bits` and the header's way in and out are each wire's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # -- judging -----------------------------------------------------------------------------------------
    def judge_bits(self, bits: torch.Tensor, token: int, world: int, logic: bool) -> Verdict:
        """Whether reduced token bits say that every one of ``world`` ranks sent ``token``."""
        raise NotImplementedError

    def check(self, token: int, group: Any, size: int) -> bool:
        """The check on its own (a small all-reduce of the token's bits over ``group``'s ``size`` ranks), read now."""
        return read(self.end_check(self.start_check(token, group, wait=True), token, size))

    def start_check(self, token: int, group: Any, wait: bool = False) -> tuple[Any, torch.Tensor]:
        """The check begun beside a message that moves as raw code moves it (:meth:`end_check` ends it); ``wait``:
        ended now (nothing to overlap with: on this thread, as small calls run fastest)."""
        bits = self.check_bits(token)
        if wait:
            _exchange.all_reduce(bits, "sum", group)
            return None, bits
        return _exchange.start_sum(bits, group), bits

    def end_check(self, begun: tuple[Any, torch.Tensor], token: int, size: int) -> Verdict:
        _exchange.wait(begun[0])
        return self.judge_bits(begun[1], token, size, False)

    def check_bits(self, token: int) -> torch.Tensor:
        """The check's message: the token's bits as int32 (a count exact at any world size)."""
        return _check.check_tensor(token, self.device)

    # -- moving ------------------------------------------------------------------------------------------
    def again(self, bare: Bare, sig: Signature, group: Any, size: int, me: int) -> Again | None:
        """A planned call of one bare tensor, prepared (the host wire's :meth:`HostWire.again`); None: the
        general path (:meth:`gather`, :meth:`reduce`, :meth:`broadcast`) runs it."""
        return None

    def gather(
        self, leaves: list[torch.Tensor], header: bytes, group: Any, size: int
    ) -> tuple[list[torch.Tensor], Verdict]:
        """Every rank's leaves and header in one all-gather over ``group``; each result every rank's values of a
        leaf, in rank order."""
        raise NotImplementedError

    def holds(self, world: int, shapes: tuple[tuple[torch.dtype, torch.Size], ...]) -> bool:
        """Whether a gather of ``shapes`` over ``world`` ranks travels in one message with its headers here."""
        return True

    def reduce(
        self, op: str, groups: list[Group], leaves: list[torch.Tensor], token: int, group: Any, size: int
    ) -> tuple[list[torch.Tensor], Verdict]:
        """One all-reduce per group of leaves (``groups``: the dtype and operation each group is reduced with,
        and its leaves); the token's bits after the first group's data."""
        out: list[torch.Tensor] = [leaves[0]] * len(leaves)
        verdict = self.reduce_group(op, groups[0], leaves, token, group, size, out)
        for more in groups[1:]:
            self.reduce_group(op, more, leaves, None, group, size, out)
        return out, verdict

    def reduce_group(
        self, op: str, way: Group, leaves: list[torch.Tensor], token: int | None, group: Any, size: int,
        out: list[torch.Tensor],
    ) -> Verdict:  # fmt: skip
        """One group's all-reduce, its results into ``out``; with ``token``, its bits after the data and the verdict.

        The group's first result is its message itself (its data at offset 0 of a fresh storage that holds nothing
        else a user can see: the token's bits, or the next leaves, which are copied out)."""
        dtype, wire, members = way
        values = [_exchange.flat(leaves[i]) for i in members]
        values = [v if v.dtype == dtype else v.to(dtype) for v in values]
        if token is not None:
            logic = _check.logic(wire)
            message = torch.cat([*values, *_check.bits(token, dtype, self.device, logic)])
        else:
            message = torch.cat(values) if len(values) > 1 else values[0].clone()
        _exchange.all_reduce(message, wire, group)
        sizes = [v.numel() for v in values]
        if token is not None:
            sizes.append(message.numel() - sum(sizes))
        parts = message.split_with_sizes(sizes) if len(sizes) > 1 else [message]
        for k, i in enumerate(members):
            out[i] = _exchange.reduced(parts[k] if k == 0 else parts[k].clone(), op, size, leaves[i])
        return self.judge_bits(parts[-1], token, size, logic) if token is not None else True

    def broadcast(
        self, leaves: list[torch.Tensor], header: bytes, src: int, source: bool, group: Any
    ) -> tuple[list[torch.Tensor], Verdict, bytes | torch.Tensor | None]:
        """The source's leaves and header in one broadcast; a receiver judges the header against its own.

        The message is in the leaves' dtype where they share one the backends move natively (not bool: a
        header's bytes are no booleans), else in bytes. The first result is the message itself (at offset 0 of a
        fresh storage whose only other bytes are the header and the later leaves' bytes, which are copied out):
        the copies raw code makes (the source's copy of its input, nothing on a receiver) and one backend call.
        Also what a receiver saw of the source's header (bytes, or still on the device), for the tables."""
        dtype = leaves[0].dtype if leaves else torch.uint8
        as_is = dtype in _exchange.NATIVE and dtype != torch.bool and all(x.dtype == dtype for x in leaves)
        if not as_is:
            dtype = torch.uint8
        counts = [x.numel() if as_is else x.nbytes for x in leaves]
        head = HEADER // dtype.itemsize
        if source:
            parts = [_exchange.flat(x) if as_is else _exchange.as_bytes(x) for x in leaves]
            message = torch.cat([*parts, self.header_out(header, dtype)])
        else:
            message = torch.empty(sum(counts) + head, dtype=dtype, device=self.device)
        _exchange.broadcast_tensor(message, src, group)
        *parts, tail = message.split_with_sizes([*counts, head]) if leaves else [message]
        out = [_exchange.from_bytes(part if k == 0 else part.clone(), x) if not as_is
               else _shaped(part if k == 0 else part.clone(), x)
               for k, (part, x) in enumerate(zip(parts, leaves, strict=True))]  # fmt: skip
        if source:
            return out, True, None
        verdict, seen = self.header_in(tail, header)
        return out, verdict, seen

    def header_out(self, header: bytes, dtype: torch.dtype) -> torch.Tensor:
        """A source's header as a 1-d tensor of ``dtype`` on this wire's device."""
        raise NotImplementedError

    def header_in(self, tail: torch.Tensor, header: bytes) -> tuple[Verdict, bytes | torch.Tensor]:
        """A receiver's verdict from the source's header (``tail``, any dtype), and what it saw of it."""
        raise NotImplementedError


def _shaped(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """1-d ``values`` of ``like``'s dtype, shaped like it (``from_bytes`` without the dtype view)."""
    if not like.numel():
        return like.new_empty(like.shape)
    return values if like.dim() == 1 else values.view(like.shape)
