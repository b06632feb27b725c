"""The host wire: messages in host memory, the verdict read at once.

A gather goes through this thread's reused buffer (:mod:`._scratch`): the leaves copied into views of
it, the call's header written and every rank's header compared as Python bytes (no tensor operation),
each result one concatenation of every rank's values, out of views made once per kind of call. A
broadcast's header is written (the source) and read (a receiver) as bytes through the thread's 64-byte
header buffer; a reduction's bits are read as numbers. Results never share the buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _check, _exchange, _scratch
from ._signature import AGREE, HEADER
from ._wire import Wire

__all__ = ["HostWire", "LoopbackWire"]


class HostWire(Wire):
    def judge_bits(self, bits: torch.Tensor, world: int, logic: bool) -> bool:
        return _check.bits_agree(bits.tolist(), world, logic)

    def holds(self, world: int, shapes: tuple[tuple[torch.dtype, torch.Size], ...]) -> bool:
        return (world + 1) * _scratch.gather_width(shapes, HEADER) <= _scratch.LIMIT

    def gather(
        self, leaves: list[torch.Tensor], header: bytes, group: Any, size: int
    ) -> tuple[list[torch.Tensor], bool]:
        world, x = size, leaves[0]
        shapes = ((x.dtype, x.shape),) if len(leaves) == 1 else tuple((x.dtype, x.shape) for x in leaves)
        found, layout = _scratch.gather(world, shapes, HEADER)
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

    def judge_bits(self, bits: torch.Tensor, world: int, logic: bool) -> bool:
        return super().judge_bits(bits, 1, logic)  # nothing was reduced: one rank's bits

    def move(self, layout: _scratch.GatherLayout, raw: bytearray, group: Any, world: int) -> None:
        super().move(layout, raw, group, world)
        start, width = world * layout.width, layout.width
        for r in range(world):
            raw[r * width : (r + 1) * width] = raw[start : start + width]
