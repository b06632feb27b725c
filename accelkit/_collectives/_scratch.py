"""Each thread's reused host buffer, for the host wire's messages, whose bytes no result shares.

The buffer is a ``bytearray`` seen as a uint8 tensor (``torch.frombuffer``): the backend moves the
tensor, and the few bytes that are Python's (a call's header, its token's bits) are written and read in
the bytearray itself, without a tensor operation. The views of the buffer that one kind of message needs
are made once (:class:`GatherLayout`, :class:`MessageLayout`) and reused; results are always copied out
of it, so that no user ever holds a view of it. A new buffer replaces one too small; the host wire sends
only small messages through it (larger ones move as raw code moves them). Each thread has its own
(``threading.local``): it goes with its thread.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

__all__ = ["HEAD", "LIMIT", "Buffer", "GatherLayout", "MessageLayout", "gather", "gather_width", "head", "message",
           "message_width", "mine"]  # fmt: skip

LIMIT = 16 << 20  # bytes
_FIRST = 64 << 10  # a thread's first buffer: grown as needed
_ALIGN = 16  # every view begins at a multiple of it (a dtype view needs its element size)
HEAD = 64  # bytes of a header on its own (_signature.HEADER; every element size divides it)
_SMALL = 2048  # bytes of a token's bits on their own: 128 elements of up to 16 bytes
_LAYOUTS = 64  # kinds of message remembered per buffer; beyond, all are forgotten alike

Shapes = tuple[tuple[torch.dtype, torch.Size], ...]


class GatherLayout(NamedTuple):
    """One kind of gather's message in a buffer: every rank's ``width`` bytes, then this rank's own.

    Each rank's message holds its leaves' bytes (each at a multiple of 16), then the call's header.
    """

    gathered: torch.Tensor  # every rank's message, in rank order
    message: torch.Tensor  # this rank's message (after ``gathered``)
    inputs: list[torch.Tensor | None]  # per leaf: where this rank's values go, shaped like it (None: empty)
    rows: list[list[torch.Tensor] | None]  # per leaf: each rank's values, to concatenate (None: empty)
    header: int  # this rank's header, in bytes from the buffer's start
    headers: list[int]  # each rank's header, received
    width: int


class MessageLayout(NamedTuple):
    """One kind of message in a buffer: the leaves' values (each at a multiple of 16 bytes), then ``tail``'s bytes
    (a header, or a token's bits), the whole seen as one 1-d tensor of the message's dtype."""

    message: torch.Tensor
    inputs: list[torch.Tensor]  # per leaf: its values, shaped like it
    tail: int  # where the tail begins, in bytes from the buffer's start


class Buffer:
    """A thread's buffer, and the layouts made in it."""

    __slots__ = ("head_raw", "heads", "layouts", "raw", "small_raw", "smalls", "tensor")

    def __init__(self, nbytes: int) -> None:
        self.raw = bytearray(nbytes)
        self.tensor = torch.frombuffer(self.raw, dtype=torch.uint8)
        self.layouts: dict[Any, Any] = {}
        self.head_raw = bytearray(HEAD)  # a header on its own: a broadcast's, before or after it travels
        self.heads = {torch.uint8: torch.frombuffer(self.head_raw, dtype=torch.uint8)}
        self.small_raw = bytearray(_SMALL)  # a token's bits on their own: the check's, or read from a message
        self.smalls: dict[Any, torch.Tensor] = {}

    def head(self, dtype: torch.dtype) -> torch.Tensor:
        """The header's bytes as a 1-d tensor of ``dtype`` (its bytes are ``head_raw``'s)."""
        found = self.heads.get(dtype)
        if found is None:
            found = self.heads[dtype] = self.heads[torch.uint8].view(dtype)
        return found

    def small(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """``count`` elements of ``dtype`` at the start of ``small_raw``."""
        found = self.smalls.get((dtype, count))
        if found is None:
            whole = torch.frombuffer(self.small_raw, dtype=torch.uint8)
            found = self.smalls[dtype, count] = whole[: count * dtype.itemsize].view(dtype)
        return found

    def gather_layout(self, world: int, shapes: Shapes, header_bytes: int) -> GatherLayout:
        """A new layout of a gather of ``shapes`` over ``world`` ranks (the buffer holds it), remembered."""
        if len(self.layouts) >= _LAYOUTS:
            self.layouts.clear()
        offsets, at = _offsets(shapes)
        width = _aligned(at + header_bytes)
        gathered, message = self.tensor[: world * width], self.tensor[world * width : (world + 1) * width]
        inputs: list[torch.Tensor | None] = []
        rows: list[list[torch.Tensor] | None] = []
        for (dtype, shape), offset in zip(shapes, offsets, strict=True):
            nbytes = shape.numel() * dtype.itemsize
            if not nbytes:
                inputs.append(None)
                rows.append(None)
                continue
            inputs.append(message[offset : offset + nbytes].view(dtype).view(shape))
            row = shape if len(shape) else torch.Size([1])  # a 0-d leaf's values: one entry per rank
            rows.append([gathered[r * width + offset : r * width + offset + nbytes].view(dtype).view(row)
                         for r in range(world)])  # fmt: skip
        headers = [r * width + at for r in range(world)]
        layout = self.layouts[world, shapes] = GatherLayout(gathered, message, inputs, rows, world * width + at,
                                                            headers, width)  # fmt: skip
        return layout

    def message_layout(self, shapes: Shapes, dtype: torch.dtype, tail_bytes: int) -> MessageLayout:
        """A new layout of a message of ``shapes`` seen as ``dtype``, then ``tail_bytes`` bytes, remembered."""
        if len(self.layouts) >= _LAYOUTS:
            self.layouts.clear()
        offsets, at = _offsets(shapes)
        whole = self.tensor[: _aligned(at + tail_bytes)]
        inputs = [whole[o : o + shape.numel() * d.itemsize].view(d).view(shape)
                  for (d, shape), o in zip(shapes, offsets, strict=True)]  # fmt: skip
        layout = self.layouts[shapes, dtype, tail_bytes] = MessageLayout(whole.view(dtype), inputs, at)
        return layout


_LOCAL = threading.local()


def mine() -> Buffer | None:
    """This thread's buffer, if it made one."""
    return getattr(_LOCAL, "buffer", None)


def gather_width(shapes: Shapes, header_bytes: int) -> int:
    """The bytes of one rank's message of a gather of ``shapes``, with its header."""
    return _aligned(_offsets(shapes)[1] + header_bytes)


def gather(world: int, shapes: Shapes, header_bytes: int) -> tuple[Buffer, GatherLayout]:
    """This thread's buffer and the layout in it of a gather of ``shapes`` over ``world`` ranks, with a header
    of ``header_bytes`` after each rank's data (made, and the buffer grown, the first time)."""
    found: Buffer | None = getattr(_LOCAL, "buffer", None)
    layout = found.layouts.get((world, shapes)) if found is not None else None
    if found is None or layout is None:
        found = _at_least((world + 1) * gather_width(shapes, header_bytes))
        layout = found.gather_layout(world, shapes, header_bytes)
    return found, layout


def message_width(shapes: Shapes, tail_bytes: int) -> int:
    """The bytes of a message of ``shapes``, then ``tail_bytes``."""
    return _aligned(_offsets(shapes)[1] + tail_bytes)


def message(shapes: Shapes, dtype: torch.dtype, tail_bytes: int, limit: int) -> tuple[Buffer, MessageLayout | None]:
    """This thread's buffer and the layout in it of a message of ``shapes`` (seen as ``dtype``), then
    ``tail_bytes`` bytes (made, and the buffer grown, the first time); None beyond ``limit`` bytes."""
    found: Buffer | None = getattr(_LOCAL, "buffer", None)
    layout = found.layouts.get((shapes, dtype, tail_bytes)) if found is not None else None
    if found is None or layout is None:
        width = message_width(shapes, tail_bytes)
        if width > limit:
            return head(), None
        found = _at_least(width)
        layout = found.message_layout(shapes, dtype, tail_bytes)
    return found, layout


def head() -> Buffer:
    """This thread's buffer, for its header or bits on their own (:meth:`Buffer.head`, :meth:`Buffer.small`)."""
    found: Buffer | None = getattr(_LOCAL, "buffer", None)
    return found if found is not None else _at_least(0)


def _at_least(nbytes: int) -> Buffer:
    found: Buffer | None = getattr(_LOCAL, "buffer", None)
    if found is None or len(found.raw) < nbytes:
        grown = min(max(_FIRST, 2 * len(found.raw) if found is not None else 0), LIMIT)
        found = _LOCAL.buffer = Buffer(max(nbytes, grown))
    return found


def _offsets(shapes: Shapes) -> tuple[list[int], int]:
    """Where each leaf's bytes begin in a rank's message, and where they end (each at a multiple of 16)."""
    offsets, at = [], 0
    for dtype, shape in shapes:
        offsets.append(at)
        at = _aligned(at + shape.numel() * dtype.itemsize)
    return offsets, at


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
