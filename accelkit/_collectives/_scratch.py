"""Each thread's reused host buffer, for the messages of the host wire whose bytes no result shares.

The buffer is a ``bytearray`` seen as a uint8 tensor (``torch.frombuffer``): the backend moves the
tensor, and the few bytes that are Python's (a call's header) are written and read in the bytearray
itself, without a tensor operation. The views of the buffer that one kind of message needs are made
once (:class:`GatherLayout`) and reused; results are always copied out of it (``torch.cat``), so that
no user ever holds a view of it. A new buffer replaces one too small; the host wire plans only
messages of up to :data:`LIMIT` bytes through it (larger ones move as raw code moves them). Each
thread has its own (``threading.local``): it goes with its thread.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

__all__ = ["HEAD", "LIMIT", "Buffer", "GatherLayout", "gather", "gather_width", "head", "mine"]

LIMIT = 16 << 20  # bytes
_FIRST = 64 << 10  # a thread's first buffer: grown as needed
_ALIGN = 16  # every view begins at a multiple of it (a dtype view needs its element size)
HEAD = 64  # bytes of a header on its own (_signature.HEADER; every element size divides it)
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


class Buffer:
    """A thread's buffer, and the layouts made in it."""

    __slots__ = ("head_raw", "heads", "layouts", "raw", "tensor")

    def __init__(self, nbytes: int) -> None:
        self.raw = bytearray(nbytes)
        self.tensor = torch.frombuffer(self.raw, dtype=torch.uint8)
        self.layouts: dict[Any, GatherLayout] = {}
        self.head_raw = bytearray(HEAD)  # a header on its own: a broadcast's, before or after it travels
        self.heads = {torch.uint8: torch.frombuffer(self.head_raw, dtype=torch.uint8)}

    def head(self, dtype: torch.dtype) -> torch.Tensor:
        """The header's bytes as a 1-d tensor of ``dtype`` (its bytes are ``head_raw``'s)."""
        found = self.heads.get(dtype)
        if found is None:
            found = self.heads[dtype] = self.heads[torch.uint8].view(dtype)
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


def head() -> Buffer:
    """This thread's buffer, for its header on its own (:meth:`Buffer.head`)."""
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
