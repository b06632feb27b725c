"""The host wire: messages in host memory, the verdict read at once, as Python bytes.

Small messages go through this thread's reused buffer (:mod:`._scratch`): the leaves are copied into
views of it, and the call's header or its token's bits are written and read in its bytearray, without a
tensor operation; the results are copied out (a gather's: one concatenation of every rank's values of a
leaf; a reduction's or a broadcast's: a copy of each leaf's values), so that none shares the buffer. A
reduction or a broadcast beyond :data:`SMALL` bytes moves in a fresh message whose first result is the
message itself (:class:`~._wire.Wire`'s way: the one copy raw code makes), and the bits are copied into
the thread's small buffer to be read. Each rank compares what it received with what it expects of its
own call (see :mod:`._check`), and every rank reads the same verdict.

A planned call of one bare tensor, repeated (most collectives of a loop), runs through :meth:`HostWire.again`:
the same message, prepared once per thread (its layout, its token's tables, its header's constant bytes), so
that a call does only what its message needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _check, _exchange, _scratch
from ._signature import AGREE, HEADER, Signature
from ._wire import Again, Bare, Group, Verdict, Wire

__all__ = ["SMALL", "HostWire", "LoopbackWire"]

Framing = tuple[bytes, bytes, bytes]  # a header's bytes around the call's number (Signature.framing)

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

    # -- a planned bare call, prepared ----------------------------------------------------------------------
    def again(self, bare: Bare, sig: Signature, group: Any, size: int, me: int) -> Again | None:
        """The planned call ``bare`` of kind ``sig`` over ``group`` prepared in this thread's buffer: what
        :meth:`gather`, :meth:`reduce_group` or :meth:`broadcast` do for it, nothing looked up or described
        anew; None where the general path must run (a dtype reduced in another, a message beyond the buffer's
        share, an empty tensor). Only this thread may run it, while its buffer is :func:`_scratch.mine`."""
        op, param, dtype, shape = bare
        if not shape.numel() or dtype.is_complex:
            return None
        if op == "reduce":
            return self._again_reduce(param, dtype, shape, group, size)
        if op == "broadcast":
            return self._again_broadcast(param, param == me, dtype, shape, sig.framing(), group)
        return self._again_gather(dtype, shape, sig.framing(), group, size)

    def _again_reduce(self, op: str, dtype: torch.dtype, shape: torch.Size, group: Any, size: int) -> Again | None:
        if dtype in _exchange.WIDER or dtype == torch.bool:
            return None
        wire = "sum" if op == "mean" else op
        logic = _check.logic(wire)
        nbits = (128 if logic else 64) * dtype.itemsize
        found, layout = _scratch.message(((dtype, shape),), dtype, nbits, SMALL)
        tables = _check.tables(dtype, logic, 1 if logic else self.count(size))
        if layout is None:
            return self._again_reduce_fresh(op, wire, dtype, shape, nbits, tables, group, size)
        into, message, raw, at, end = layout.inputs[0], layout.message, found.raw, layout.tail, layout.tail + nbits
        how, mean, call, token_bytes = _exchange.reduce_op(wire), op == "mean", _exchange.held, _check.token_bytes

        def run(x: torch.Tensor, seq: int, token: int) -> tuple[torch.Tensor, bool, bytes | None]:
            into.copy_(x.detach() if x.requires_grad else x)
            raw[at:end], expected = token_bytes(token, tables)
            call(dist.all_reduce, message, how, group)
            out = into.clone()
            if mean:
                out.div_(size)
            return out, raw[at:end] == expected, None

        return run

    def _again_reduce_fresh(
        self, op: str, wire: str, dtype: torch.dtype, shape: torch.Size, nbits: int, tables: _check.Tables,
        group: Any, size: int,
    ) -> Again:  # fmt: skip
        """A reduction beyond the buffer's share, in a fresh message (as :meth:`Wire.reduce_group`): the data, then
        the token's bits written in the thread's small buffer; the result the message itself."""
        found = _scratch.head()
        small_raw, bits, n = found.small_raw, found.small(dtype, nbits // dtype.itemsize), shape.numel()
        how, mean, flat, call, token_bytes = (_exchange.reduce_op(wire), op == "mean", len(shape) == 1,
                                              _exchange.call, _check.token_bytes)  # fmt: skip

        def run(x: torch.Tensor, seq: int, token: int) -> tuple[torch.Tensor, bool, bytes | None]:
            small_raw[:nbits], expected = token_bytes(token, tables)
            message = torch.cat([_exchange.flat(x), bits])
            out, tail = message[:n] if flat else message[:n].view(shape), message[n:]  # (made before the wait)
            call(dist.all_reduce, message, how, group)
            if mean:
                out.div_(size)
            bits.copy_(tail)
            return out, small_raw[:nbits] == expected, None

        return run

    def _again_broadcast(
        self, src: int, source: bool, dtype: torch.dtype, shape: torch.Size, framing: Framing, group: Any
    ) -> Again | None:
        found, layout = _scratch.message(((dtype, shape),), torch.uint8, HEADER, SMALL)
        if layout is None:
            return self._again_broadcast_fresh(src, source, dtype, shape, framing, group)
        into, message, raw, at, end = layout.inputs[0], layout.message, found.raw, layout.tail, layout.tail + HEADER
        (pre, post, agree), call = framing, _exchange.held

        def run(x: torch.Tensor, seq: int, token: int) -> tuple[torch.Tensor, bool, bytes | None]:
            number = seq.to_bytes(8, "little")
            if source:  # its result made before it waits, nothing after: the first tensor operation after a wait
                into.copy_(x.detach() if x.requires_grad else x)  # costs a wake-up, which raw code leaves to its caller
                raw[at:end] = b"".join((pre, number, post))
                out = into.clone()
                call(dist.broadcast, message, src, group)
                return out, True, None
            call(dist.broadcast, message, src, group)
            out = into.clone()
            theirs = bytes(raw[at:end])
            return out, theirs[:AGREE] == b"".join((pre, number, agree)), theirs

        return run

    def _again_broadcast_fresh(
        self, src: int, source: bool, dtype: torch.dtype, shape: torch.Size, framing: Framing, group: Any
    ) -> Again | None:
        """A broadcast beyond the buffer's share, in a fresh message of the leaf's dtype (as :meth:`Wire.broadcast`)."""
        if dtype not in _exchange.NATIVE or dtype == torch.bool:
            return None
        found = _scratch.head()
        head_raw, head, n, flat = found.head_raw, found.head(dtype), shape.numel(), len(shape) == 1
        size, device, (pre, post, agree), call = n + HEADER // dtype.itemsize, self.device, framing, _exchange.call

        def run(x: torch.Tensor, seq: int, token: int) -> tuple[torch.Tensor, bool, bytes | None]:
            number = seq.to_bytes(8, "little")
            if source:
                head_raw[:] = b"".join((pre, number, post))
                message = torch.cat([_exchange.flat(x), head])
            else:
                message = torch.empty(size, dtype=dtype, device=device)
            out = message[:n] if flat else message[:n].view(shape)  # (views made before the wait, as above)
            if source:
                call(dist.broadcast, message, src, group)
                return out, True, None
            tail = message[n:]
            call(dist.broadcast, message, src, group)
            head.copy_(tail)
            theirs = bytes(head_raw)
            return out, theirs[:AGREE] == b"".join((pre, number, agree)), theirs

        return run

    def _again_gather(
        self, dtype: torch.dtype, shape: torch.Size, framing: Framing, group: Any, size: int
    ) -> Again | None:
        shapes = ((dtype, shape),)
        if not self.holds(size, shapes):
            return None
        found, layout = _scratch.gather(size, shapes, HEADER)
        into, rows, raw, headers = layout.inputs[0], layout.rows[0], found.raw, layout.headers
        at, end, (pre, post, agree), move = layout.header, layout.header + HEADER, framing, self.move
        if into is None or rows is None:
            return None

        def run(x: torch.Tensor, seq: int, token: int) -> tuple[torch.Tensor, bool, bytes | None]:
            number = seq.to_bytes(8, "little")
            into.copy_(x.detach() if x.requires_grad else x)
            raw[at:end] = b"".join((pre, number, post))
            move(layout, raw, group, size)
            agreed = b"".join((pre, number, agree))
            return torch.cat(rows), all(raw[r : r + AGREE] == agreed for r in headers), None

        return run

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
