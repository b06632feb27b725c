"""The host wire: messages in host memory, the verdict read at once, as Python bytes.

Small messages go through this thread's reused buffer (:mod:`._scratch`): the leaves are copied into
views of it, and the call's header or its token's bits are written and read in its bytearray, without a
tensor operation; the results are copied out (a gather's: one concatenation of every rank's values of a
leaf; a reduction's or a broadcast's: a copy of each leaf's values), so that none shares the buffer. A
reduction or a broadcast beyond :data:`SMALL` bytes moves in a fresh message whose first result is the
message itself (:class:`~._wire.Wire`'s way: the one copy raw code makes), and the bits are copied into
the thread's small buffer to be read. Each rank compares what it received with what it expects of its
own call (see :mod:`._check`), and every rank reads the same verdict.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _check, _exchange, _scratch
from ._signature import AGREE, HEADER
from ._wire import Group, Verdict, Wire

__all__ = ["SMALL", "HostWire", "LoopbackWire"]

SMALL = 64 << 10  # bytes of a reduction's or a broadcast's message up to which it goes through the buffer


class HostWire(Wire):
    def count(self, size: int) -> int:
        """The ranks whose bits a sum adds up (the group's)."""
        return size

    def judge_bits(self, bits: torch.Tensor, token: int, world: int, logic: bool) -> bool:
        found = _scratch.head()
        view = found.small(bits.dtype, bits.numel())
        if bits is not view:
            view.copy_(bits)
        expected = _check.bits_bytes(token, bits.dtype, logic, 1 if logic else self.count(world))[1]
        return found.small_raw[: bits.numel() * bits.dtype.itemsize] == expected

    def check_bits(self, token: int) -> torch.Tensor:
        found = _scratch.head()
        found.small_raw[: 64 * 4] = _check.bits_bytes(token, torch.int32, False, 1)[0]
        return found.small(torch.int32, 64)

    def holds(self, world: int, shapes: tuple[tuple[torch.dtype, torch.Size], ...]) -> bool:
        return (world + 1) * _scratch.gather_width(shapes, HEADER) <= _scratch.LIMIT

    def gather(
        self, leaves: list[torch.Tensor], header: bytes, group: Any, size: int
    ) -> tuple[list[torch.Tensor], bool]:
        world = size
        found, layout = _scratch.gather(world, _shapes(leaves), HEADER)
        for into, x in zip(layout.inputs, leaves, strict=True):
            if into is not None:
                into.copy_(x.detach() if x.requires_grad else x)
        raw = found.raw
        raw[layout.header : layout.header + HEADER] = header
        self.move(layout, raw, group, world)
        agreed = header[:AGREE]
        verdict = all(raw[at : at + AGREE] == agreed for at in layout.headers)
        out = [torch.cat(rows) if rows is not None else _exchange.from_bytes(x, x, world)  # (empty: a new one)
               for x, rows in zip(leaves, layout.rows, strict=True)]  # fmt: skip
        return out, verdict

    def move(self, layout: _scratch.GatherLayout, raw: bytearray, group: Any, world: int) -> None:
        _exchange.all_gather(layout.gathered, layout.message, group)

    def reduce_group(
        self, op: str, way: Group, leaves: list[torch.Tensor], token: int | None, group: Any, size: int,
        out: list[torch.Tensor],
    ) -> Verdict:  # fmt: skip
        dtype, wire, members = way
        logic = _check.logic(wire)
        nbits = 0 if token is None else (128 if logic else 64) * dtype.itemsize
        shapes = tuple([(dtype, leaves[i].shape) for i in members])
        found, layout = _scratch.message(shapes, dtype, nbits, SMALL)
        if layout is None:  # a large message: fresh, its first result the message itself
            return super().reduce_group(op, way, leaves, token, group, size, out)
        for into, i in zip(layout.inputs, members, strict=True):
            x = leaves[i]
            into.copy_(x.detach() if x.requires_grad else x)
        raw, at = found.raw, layout.tail
        if token is not None:
            mine, expected = _check.bits_bytes(token, dtype, logic, 1 if logic else self.count(size))
            raw[at : at + nbits] = mine
        _exchange.all_reduce(layout.message, wire, group)
        for into, i in zip(layout.inputs, members, strict=True):
            like = leaves[i]
            if into.dtype == like.dtype:  # a copy of the leaf's values, the mean divided
                out[i] = into.clone().div_(size) if op == "mean" else into.clone()
            else:  # booleans as bytes (copied), a wider dtype converted back (a copy)
                out[i] = _exchange.reduced(into.clone() if like.dtype == torch.bool else into, op, size, like)
        return raw[at : at + nbits] == expected if token is not None else True

    def broadcast(
        self, leaves: list[torch.Tensor], header: bytes, src: int, source: bool, group: Any
    ) -> tuple[list[torch.Tensor], Verdict, bytes | torch.Tensor | None]:
        found, layout = _scratch.message(_shapes(leaves), torch.uint8, HEADER, SMALL)
        if layout is None:  # a large message: fresh, its first result the message itself
            return super().broadcast(leaves, header, src, source, group)
        raw, at = found.raw, layout.tail
        if source:
            for into, x in zip(layout.inputs, leaves, strict=True):
                into.copy_(x.detach() if x.requires_grad else x)
            raw[at : at + HEADER] = header
        _exchange.broadcast_tensor(layout.message, src, group)
        out = [into.clone() for into in layout.inputs]
        if source:
            return out, True, None
        theirs = bytes(raw[at : at + HEADER])
        return out, theirs[:AGREE] == header[:AGREE], theirs

    def header_out(self, header: bytes, dtype: torch.dtype) -> torch.Tensor:
        found = _scratch.head()
        found.head_raw[:] = header
        return found.head(dtype)

    def header_in(self, tail: torch.Tensor, header: bytes) -> tuple[bool, bytes]:
        found = _scratch.head()
        found.head(tail.dtype).copy_(tail)
        theirs = bytes(found.head_raw)
        return theirs[:AGREE] == header[:AGREE], theirs


class LoopbackWire(HostWire):
    """The host wire over torch's fake process group, which moves nothing (the bench's measure of host time):
    every rank's message is taken to be this rank's own."""

    def count(self, size: int) -> int:
        return 1  # nothing was reduced: one rank's bits

    def move(self, layout: _scratch.GatherLayout, raw: bytearray, group: Any, world: int) -> None:
        super().move(layout, raw, group, world)
        start, width = world * layout.width, layout.width
        for r in range(world):
            raw[r * width : (r + 1) * width] = raw[start : start + width]


def _shapes(leaves: list[torch.Tensor]) -> tuple[tuple[torch.dtype, torch.Size], ...]:
    if len(leaves) == 1:
        return ((leaves[0].dtype, leaves[0].shape),)
    return tuple((x.dtype, x.shape) for x in leaves)
