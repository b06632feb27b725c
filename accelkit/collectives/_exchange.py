"""The torch.distributed calls behind the collectives: few calls, any dtype, new tensors.

- Data movement (gather, broadcast) of several leaves goes through one byte buffer: the
  leaves are viewed as bytes (any dtype moves, even those the backend cannot reduce)
  and packed largest element size first, so that every leaf's offset stays aligned and
  unpacking is a view (broadcast) or one copy (gather).
- Reductions pack one buffer per (device, dtype) and reduce dtypes the backends lack
  (int16, unsigned ints, float8) in a wider dtype.
- Python objects travel pickled in uint8 tensors (numpy is not needed): a fixed-size
  first message carries the length and, for small objects, the bytes themselves.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import _state
from ._bytes import WIDER, flat, layout

_BYTE = torch.uint8
# Dtypes every backend moves natively; others move as bytes.
_NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128}  # fmt: skip
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}  # fmt: skip
_SLOT = 1024  # bytes of the first message of an object exchange: 8 of length, then data
_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SLICE = timedelta(seconds=1)  # how often a waiting call looks whether it should give up early


class CommunicationError(Exception):
    """A backend call failed (a timeout, a lost peer); the collective re-raises it under its name."""

    def __init__(self, cause: RuntimeError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Conflict(Exception):
    """The heartbeat found the ranks waiting in different calls of the same number: no wait can end."""


def _call(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        _wait(fn(*args, async_op=True, **kwargs))
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        raise CommunicationError(exc) from exc


def _wait(work: Any) -> None:
    """Wait for ``work``; on gloo, look every second whether the heartbeat found a conflict (then give up).

    Only gloo's wait with a timeout returns and may be called again. NCCL's blocks the host until the
    work is done and, when the timeout passes first, aborts the communicator: there the wait is
    one plain ``wait()`` and the group's own timeout (its watchdog) bounds it.
    """
    if work is not None and dist.get_backend() != "gloo":
        work.wait()
        return
    while work is not None:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as exc:
            if not str(exc).startswith("Operation timed out"):
                raise
        if _state.group.alarm:  # the ranks are in different calls (see _group's heartbeat)
            raise Conflict(_state.group.alarm)


def accepts_short_messages(backend: str) -> bool:
    """Whether ``backend`` lets a receiver post a buffer longer than the message (gloo: yes; nccl: no)."""
    return backend == "gloo"


def broadcast_tensor(x: torch.Tensor, src: int) -> None:
    _call(dist.broadcast, x, src)


def all_reduce(x: torch.Tensor, op: str) -> None:
    """Reduce ``x`` in place over the ranks with ``op`` ("sum", "max", "min" or "product")."""
    _call(dist.all_reduce, x, _OPS[op])


def all_gather(out: torch.Tensor, x: torch.Tensor, world: int) -> None:
    """``out`` (``world`` times ``x`` along dim 0) receives every rank's ``x`` in rank order."""
    global _gather_single
    if _gather_single is not None:
        try:
            _wait(_gather_single(out, x, async_op=True))
            return
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # gloo before torch 2.6 lacks the single-tensor form: not tried again
            if "_allgather_base" not in str(exc):
                raise CommunicationError(exc) from exc
            _gather_single = None
    _call(dist.all_gather, list(out.view(world, *x.shape).unbind(0)), x)


def _data(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves without autograd history: results are new tensors, and the backends refuse (gloo's
    all-gather) or silently mis-record (in-place reductions) tensors that require grad."""
    return [x.detach() if x.requires_grad else x for x in leaves]


def gather(leaves: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    leaves = _data(leaves)
    if len(leaves) == 1 and leaves[0].dtype in _NATIVE:
        x = leaves[0]
        x = x.reshape(1) if x.dim() == 0 else x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        all_gather(out, x, world)
        return [out]
    result: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in _by_device(leaves):
        order, buf, offsets = _pack([leaves[i] for i in indices])
        out = buf.new_empty((world, buf.numel()))
        all_gather(out.view(-1), buf, world)
        for j, rows in zip(order, torch.split(out, _sizes(offsets, buf.numel()), dim=1), strict=False):
            leaf = leaves[indices[j]]
            shape = (world * leaf.shape[0], *leaf.shape[1:]) if leaf.dim() else (world,)
            # rows: (world, bytes) -> (world, numel) -> the leaves of every rank, concatenated (one copy)
            result[indices[j]] = rows.view(leaf.dtype).reshape(shape) if leaf.numel() else leaf.new_empty(shape)
    return result  # type: ignore[return-value]


def broadcast(leaves: list[torch.Tensor], src: int, rank: int) -> list[torch.Tensor]:
    leaves = _data(leaves)
    if len(leaves) == 1 and leaves[0].dtype in _NATIVE:
        x = leaves[0]
        if rank == src:
            out = x.resolve_conj().clone(memory_format=torch.contiguous_format)
        else:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _call(dist.broadcast, out, src)
        return [out]
    result: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in _by_device(leaves):
        group = [leaves[i] for i in indices]
        if rank == src:
            order, buf, offsets = _pack(group)
        else:
            order, size, offsets = layout(group)
            buf = torch.empty(size, dtype=_BYTE, device=group[0].device)
        _call(dist.broadcast, buf, src)
        for j, part in zip(order, torch.split(buf, _sizes(offsets, buf.numel())), strict=False):
            x = group[j]
            result[indices[j]] = part.view(x.dtype).view(x.shape) if x.numel() else x.new_empty(x.shape)
    return result  # type: ignore[return-value]


def reduce(leaves: list[torch.Tensor], op: str, world: int) -> list[torch.Tensor]:
    leaves = _data(leaves)
    red = dist.ReduceOp.SUM if op == "mean" and any(x.is_complex() for x in leaves) else _OPS[op]
    if len(leaves) == 1 and leaves[0].dtype not in WIDER:  # the common case, kept lean
        buf = leaves[0].clone(memory_format=torch.contiguous_format).resolve_conj()
        _call(dist.all_reduce, buf, red)
        return [buf / world if red != _OPS[op] else buf]
    result: list[torch.Tensor | None] = [None] * len(leaves)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault((x.device, WIDER.get(x.dtype, x.dtype)), []).append(i)
    for (_, dtype), indices in groups.items():
        buf = torch.cat([flat(leaves[i]).to(dtype) for i in indices])
        _call(dist.all_reduce, buf, red)
        if red != _OPS[op]:  # the mean of complex tensors: no backend averages them
            buf /= world
        for i, part in zip(indices, torch.split(buf, [leaves[i].numel() for i in indices]), strict=True):
            result[i] = part.view(leaves[i].shape).to(leaves[i].dtype)
    return result  # type: ignore[return-value]


def max_sizes(sizes: list[int], device: torch.device, world: int) -> list[int]:
    """The element-wise maximum of ``sizes`` over every rank (one all-gather)."""
    if not sizes:
        return []
    mine = torch.tensor(sizes, dtype=torch.int64, device=device)
    everyone = mine.new_empty(world * mine.numel())
    all_gather(everyone, mine, world)
    return everyone.view(world, -1).amax(0).tolist()


def pad(
    leaves: list[torch.Tensor], dims: list[int], sizes: list[int], pad_index: Any, pad_first: bool
) -> list[torch.Tensor]:
    """New tensors: each leaf padded with ``pad_index`` along its dim to its size in ``sizes``."""
    result = []
    for x, d, n in zip(leaves, dims, sizes, strict=True):
        if x.shape[d] == n:
            result.append(x.clone())
            continue
        out = x.new_full((*x.shape[:d], n, *x.shape[d + 1 :]), pad_index)
        out.narrow(d, n - x.shape[d] if pad_first else 0, x.shape[d]).copy_(x)
        result.append(out)
    return result


def gather_bytes(payload: bytes, device: torch.device, world: int) -> list[bytes]:
    """Every rank's ``payload``, in rank order (one call when all fit in the first slot)."""
    first = _slot(payload, device)
    out = first.new_empty(world * _SLOT)
    all_gather(out, first, world)
    rows = _split(_host_bytes(out), _SLOT)
    lengths = [int.from_bytes(r[:8], "little") for r in rows]
    rest = max(lengths) - (_SLOT - 8)
    if rest <= 0:
        return [bytes(r[8 : 8 + n]) for r, n in zip(rows, lengths, strict=True)]
    tail = to_tensor(payload[_SLOT - 8 :].ljust(rest, b"\0"), device)
    out = tail.new_empty(world * rest)
    all_gather(out, tail, world)
    tails = _split(_host_bytes(out), rest)
    return [bytes((r[8:] + t)[:n]) for r, t, n in zip(rows, tails, lengths, strict=True)]


def gather_padded(payload: bytes, width: int, lengths: list[int], device: torch.device, world: int) -> list[bytes]:
    """Every rank's ``payload`` (``lengths`` bytes each, agreed beforehand), padded to ``width`` in one all-gather."""
    mine = to_tensor(payload.ljust(width, b"\0"), device)
    out = mine.new_empty(world * width)
    all_gather(out, mine, world)
    data = _host_bytes(out)
    return [bytes(data[r * width : r * width + n]) for r, n in enumerate(lengths)]


def loads(payload: bytes) -> Any:
    return pickle.loads(payload)  # only ever bytes that the ranks of this job sent


def _slot(payload: bytes, device: torch.device) -> torch.Tensor:
    head = bytearray(_SLOT)
    head[:8] = len(payload).to_bytes(8, "little")
    chunk = payload[: _SLOT - 8]
    head[8 : 8 + len(chunk)] = chunk
    return to_tensor(head, device)


def to_tensor(data: bytes | bytearray, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=_BYTE, device=device)
    return torch.frombuffer(bytearray(data), dtype=_BYTE).to(device)


def _host_bytes(t: torch.Tensor) -> bytearray:
    out = bytearray(t.numel())
    if out:
        torch.frombuffer(out, dtype=_BYTE).copy_(t.reshape(-1))
    return out


def _split(data: bytearray, size: int) -> list[bytearray]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _by_device(leaves: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(x.device, []).append(i)
    return list(groups.values())


def _sizes(offsets: list[int], total: int) -> list[int]:
    """The byte size of each packed leaf, then of the alignment padding."""
    return [b - a for a, b in itertools.pairwise(offsets)] + [total - offsets[-1]]


def _pack(leaves: list[torch.Tensor]) -> tuple[list[int], torch.Tensor, list[int]]:
    order, size, offsets = layout(leaves)
    parts = [flat(leaves[i]).view(_BYTE) for i in order]
    if size > offsets[-1]:
        parts.append(torch.zeros(size - offsets[-1], dtype=_BYTE, device=leaves[0].device))  # alignment
    return order, torch.cat(parts) if parts else torch.empty(0, dtype=_BYTE), offsets
