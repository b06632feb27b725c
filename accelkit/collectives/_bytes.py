"""Bytes in and out of the collectives' slots: packing leaves, reading headers, results from rows.

A slot is a uint8 tensor: a header, then the call's leaves packed largest element first (so that
every leaf's offset stays aligned). On the CPU, bytes move with ``ctypes.memmove`` between the
tensors' memory: a collective of a thousand floats does not pay for a dozen tensor views and
copies on top of the message itself. Other devices go through tensor copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

__all__ = ["flat", "gather_rows", "layout", "parts", "read", "reduce_rows", "unpack", "write"]

_BYTE = torch.uint8
_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}
# Dtypes that gloo and nccl cannot reduce, and the dtype they are reduced in (torch lacks some ops too).
WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64,
         torch.uint64: torch.int64} | {d: torch.float32 for d in (torch.float8_e4m3fn, torch.float8_e5m2)}  # fmt: skip


def layout(leaves: list[torch.Tensor]) -> tuple[list[int], int, list[int]]:
    """Pack order (largest element first, so offsets stay aligned), total size, offsets."""
    order = sorted(range(len(leaves)), key=lambda i: -leaves[i].element_size())
    offsets = [0]
    for i in order:
        offsets.append(offsets[-1] + leaves[i].numel() * leaves[i].element_size())
    align = leaves[order[0]].element_size() if leaves else 1
    return order, -(-offsets[-1] // align) * align, offsets


def flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a contiguous 1-d tensor (a view when it already is one), without autograd history."""
    # detach: the backends refuse tensors that require grad; contiguous: reshape keeps a broadcast
    # (stride 0) view as it is, which cannot be viewed as bytes.
    return (x.resolve_conj() if x.dtype in _COMPLEX else x).resolve_neg().detach().contiguous().view(-1)


def parts(leaves: list[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """The leaves at their packed offsets, and the total bytes (:func:`write` takes them as they are)."""
    if len(leaves) == 1:
        x = leaves[0]
        return [(0, x)], x.numel() * x.element_size()
    order, size, offsets = layout(leaves)
    return [(offsets[k], leaves[i]) for k, i in enumerate(order)], size


def write(buffer: torch.Tensor, offset: int, data: bytes | torch.Tensor) -> None:
    """Copy ``data`` (bytes, or a tensor's bytes) into the uint8 ``buffer`` at ``offset``."""
    if isinstance(data, bytes):
        n = len(data)
        if n and buffer.is_cpu:
            ctypes.memmove(buffer.data_ptr() + offset, data, n)
            return
    else:
        n = data.numel() * data.element_size()
        # A lazily conjugated or negated tensor's memory does not hold its values.
        plain = data.dtype not in _COMPLEX and not data.is_neg()
        if n and plain and buffer.is_cpu and data.is_cpu and data.is_contiguous():
            ctypes.memmove(buffer.data_ptr() + offset, data.data_ptr(), n)
            return
    if not n:
        return
    source = torch.frombuffer(bytearray(data), dtype=_BYTE) if isinstance(data, bytes) else flat(data).view(_BYTE)
    buffer[offset : offset + n].copy_(source)


def read(buffer: torch.Tensor, stride: int, count: int, n: int) -> list[bytes]:
    """The first ``n`` bytes of each of ``count`` rows of ``stride`` bytes of the uint8 ``buffer``."""
    if buffer.is_cpu:
        base = buffer.data_ptr()
        return [ctypes.string_at(base + r * stride, n) for r in range(count)]
    host = bytearray(count * n)
    if host:
        rows = buffer[: count * stride].view(count, stride)[:, :n]
        torch.frombuffer(host, dtype=_BYTE).view(count, n).copy_(rows)
    return [bytes(host[r * n : (r + 1) * n]) for r in range(count)]


def unpack(buffer: torch.Tensor, leaves: list[torch.Tensor], copy: bool) -> list[torch.Tensor]:
    """Tensors shaped like ``leaves`` from the packed uint8 ``buffer`` (views, or copies with ``copy``)."""
    order, _, offsets = layout(leaves)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for k, i in enumerate(order):
        x = leaves[i]
        t = buffer[offsets[k] : offsets[k + 1]].view(x.dtype).view(x.shape) if x.numel() else x.new_empty(x.shape)
        out[i] = t.clone() if copy and x.numel() else t
    return out  # type: ignore[return-value]


def gather_rows(buffer: torch.Tensor, stride: int, start: int, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """``gather``'s result from every rank's packed leaves, at ``start`` of each ``stride``-byte slot of ``buffer``."""
    world = len(leaves) and buffer.numel() // stride
    if len(leaves) == 1 and buffer.is_cpu and leaves[0].is_cpu and world <= 64:
        return [_gather_one(buffer, stride, start, leaves[0])]
    rows = buffer.view(world, stride)
    order, _, offsets = _layout(leaves)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for k, i in enumerate(order):
        x = leaves[i]
        result = x.new_empty((world * x.shape[0], *x.shape[1:]) if x.dim() else (world,))
        n, at = offsets[k + 1] - offsets[k], start + offsets[k]
        if n:
            result.view(-1).view(_BYTE).view(world, n).copy_(rows[:, at : at + n])
        out[i] = result
    return out  # type: ignore[return-value]


def reduce_rows(
    buffer: torch.Tensor, stride: int, start: int, leaves: list[torch.Tensor], op: str
) -> list[torch.Tensor]:
    """``reduce``'s result from every rank's packed leaves, at ``start`` of each ``stride``-byte slot of ``buffer``.

    Every rank combines the rows in rank order, so every rank computes the same bits.
    """
    world = buffer.numel() // stride
    order, _, offsets = _layout(leaves)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for k, i in enumerate(order):
        x = leaves[i]
        if not x.numel():
            out[i] = x.new_empty(x.shape)
            continue
        size, typed, n = x.element_size(), buffer.view(x.dtype), x.numel()
        at = (start + offsets[k]) // size
        if world == 2 and x.dtype not in WIDER and x.dtype != torch.bool:
            step = stride // size
            out[i] = _PAIRS[op](typed[at : at + n], typed[at + step : at + step + n]).view(x.shape)
            continue
        values = typed.as_strided((world, n), (stride // size, 1), typed.storage_offset() + at)
        out[i] = _combine(values, op, world, x.dtype).view(x.shape)
    return out  # type: ignore[return-value]


def _gather_one(buffer: torch.Tensor, stride: int, start: int, x: torch.Tensor) -> torch.Tensor:
    world = buffer.numel() // stride
    shape = x.shape
    result = torch.empty((world * shape[0], *shape[1:]) if shape else (world,), dtype=x.dtype)
    n = x.numel() * x.element_size()
    if n:
        base, dest = buffer.data_ptr() + start, result.data_ptr()
        for r in range(world):
            ctypes.memmove(dest + r * n, base + r * stride, n)
    return result


# Two ranks (the common case): one elementwise op on the two rows, in rank order.
_PAIRS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "mean": lambda a, b: torch.add(a, b).div_(2),
    "max": torch.maximum,
    "min": torch.minimum,
    "product": torch.mul,
}


def _layout(leaves: list[torch.Tensor]) -> tuple[list[int], int, list[int]]:
    if len(leaves) == 1:  # the common case, without sorting
        n = leaves[0].numel() * leaves[0].element_size()
        return [0], n, [0, n]
    return layout(leaves)


def _combine(values: torch.Tensor, op: str, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Reduce the (world, n) ``values`` over the ranks, in ``dtype`` (widened where torch lacks the op)."""
    if dtype == torch.bool:
        return values.any(0) if op in ("sum", "max") else values.all(0)
    wide = WIDER.get(dtype, dtype)
    v = values if wide == dtype else values.to(wide)
    if op in ("sum", "mean"):
        result = v[0] + v[1] if world == 2 else v.sum(0, dtype=wide)
        if op == "mean":
            result = result.div_(world) if result.is_floating_point() or result.is_complex() else result / world
    elif op == "max":
        result = torch.maximum(v[0], v[1]) if world == 2 else v.amax(0)
    elif op == "min":
        result = torch.minimum(v[0], v[1]) if world == 2 else v.amin(0)
    else:
        result = v[0] * v[1] if world == 2 else v.prod(0, dtype=wide)
    return result if result.dtype == dtype else result.to(dtype)
