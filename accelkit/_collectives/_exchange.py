"""The torch.distributed calls behind the collectives: any dtype, results that own their storage.

- One backend call per leaf, as raw torch.distributed code would make: gather and broadcast
  move dtypes the backend lacks as bytes; reductions use a wider dtype for those it cannot
  reduce (int16, unsigned ints, float8), and a mean is a sum divided (gloo cannot average).
- Every result is a new tensor with compact storage of its own; inputs are never written.
- Python objects travel pickled in uint8 tensors (numpy is not needed).
- A backend failure becomes :class:`CommunicationError`, which the collective names.

Every call takes the process group it runs over (``group``: None is the world); a ``src`` is a
global rank, as in torch.distributed.
"""

from __future__ import annotations

import collections
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_BYTE = torch.uint8
_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}
_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
# Dtypes that gloo and nccl cannot reduce, and the dtype they are reduced in (torch lacks some ops too).
WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64,
         torch.uint64: torch.int64} | {d: torch.float32 for d in _FLOAT8}  # fmt: skip
# Dtypes every backend moves natively; others move as bytes.
NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128}  # fmt: skip
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}  # fmt: skip
# torch 2.13 renamed all_gather_into_tensor (now deprecated, with a FutureWarning) to all_gather_single.
_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SLOT = 1024  # bytes of the first message of an object exchange: 8 of length, then data


class CommunicationError(Exception):
    """A backend call failed (a timeout, a lost peer); the collective re-raises it under its name."""

    def __init__(self, cause: RuntimeError) -> None:
        super().__init__(str(cause))
        self.cause = cause


# The tensors of each thread's last backend calls, kept alive from Python. gloo's worker thread drops a finished
# call's tensors after the caller's wait returned, holding its queue's lock; if a tensor's last Python
# reference was gone by then, dropping it needs the GIL. Were the group being destroyed on the main thread
# at that moment (a DDP model freed after ak.end_training: ~ProcessGroupGloo takes that lock, holding the
# GIL), both would wait for ever. Kept here, the worker never drops a tensor's Python object. A collective
# lets its thread's earlier calls' tensors go as it begins (:func:`release`), long after the worker finished
# with them: a message is not held beyond the next collective (it would hold its memory, and a new message
# would fault in fresh pages where raw code reuses the ones it just freed).
_KEPT: dict[int, collections.deque[tuple[Any, ...]]] = {}


def _keep(args: tuple[Any, ...]) -> None:
    kept = _KEPT.get(threading.get_ident())
    if kept is None:
        kept = mine(_KEPT, lambda: collections.deque(maxlen=4))
    kept.append(args)


def mine(table: dict[int, Any], make: Callable[[], Any]) -> Any:
    """This thread's entry in ``table``, made now; the entries of threads that ended go (a background save's)."""
    alive = {t.ident for t in threading.enumerate()}
    for ident in [i for i in table if i not in alive]:
        table.pop(ident, None)
    entry = table[threading.get_ident()] = make()
    return entry


def release() -> None:
    """Let go of the tensors this thread's earlier backend calls kept (as a collective begins)."""
    kept = _KEPT.get(threading.get_ident())
    if kept:
        kept.clear()


def _wait(work: Any) -> None:
    """Wait for ``work``, bounded by the group's timeout.

    A plain wait: gloo's wait with a timeout (to look for trouble now and then) costs up to twice a
    small collective, and NCCL's blocks the host and aborts the communicator when it passes. Ranks
    that call different collectives never wait in different backend calls (see ``_checked``).
    """
    if work is not None:
        work.wait()


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """One torch.distributed call (``async_op=False``: the backend may run it on this thread; ``True``: its
    work, for :func:`wait`)."""
    _keep(args)
    return held(fn, *args, **kwargs)


def held(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`call` over tensors that outlive it elsewhere (views of a thread's reused buffer): none to keep."""
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        raise CommunicationError(exc) from exc


def reduce_op(op: str) -> Any:
    """torch's ReduceOp for ``op`` ("sum", "max", "min" or "product")."""
    return _OPS[op]


def broadcast_tensor(x: torch.Tensor, src: int, group: Any = None) -> None:
    """Broadcast ``x`` in place from global rank ``src`` over ``group``."""
    call(dist.broadcast, torch.view_as_real(x) if x.is_complex() else x, src, group)


def all_reduce(x: torch.Tensor, op: str, group: Any = None) -> None:
    """Reduce ``x`` in place over ``group``'s ranks with ``op`` ("sum", "max", "min" or "product")."""
    call(dist.all_reduce, torch.view_as_real(x) if x.is_complex() else x, _OPS[op], group)


def all_gather(out: torch.Tensor, x: torch.Tensor, group: Any = None) -> None:
    """``out`` (``world`` times ``x`` along dim 0) receives every rank's ``x`` in rank order (over ``group``)."""
    if x.is_complex():
        out, x = torch.view_as_real(out), torch.view_as_real(x)
    call(_GATHER_SINGLE, out, x, group=group)  # every backend of torch >= 2.4 has it (gloo too)


def plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a contiguous tensor without autograd history or lazy negation/conjugation (viewed as is)."""
    return not x.requires_grad and x.is_contiguous() and not x.is_neg() and not x.is_conj()


def flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a contiguous 1-d tensor (``x`` itself or a view when it already is one, to be read only),
    without autograd history."""
    # detach: the backends refuse tensors that require grad; contiguous: reshape keeps a broadcast
    # (stride 0) view as it is, which cannot be viewed as bytes.
    if plain(x):
        return x if x.dim() == 1 else x.view(-1)  # the common case: x itself, or one call
    return (x.resolve_conj() if x.dtype in _COMPLEX else x).resolve_neg().detach().contiguous().view(-1)


def own(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` that owns its storage, without autograd history."""
    if not x.requires_grad and not x.is_neg() and not x.is_conj():  # the common case, one call
        return x.clone(memory_format=torch.contiguous_format)
    return (
        (x.resolve_conj() if x.dtype in _COMPLEX else x)
        .resolve_neg()
        .detach()
        .clone(memory_format=torch.contiguous_format)
    )


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a 1-d uint8 tensor (a view when ``x`` is contiguous)."""
    if not x.numel():
        return torch.empty(0, dtype=_BYTE, device=x.device)
    values = flat(x)
    return values if values.dtype == _BYTE else values.view(_BYTE)


def from_bytes(data: torch.Tensor, like: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """A tensor shaped like ``like`` (``rows`` of them, concatenated along dim 0) from contiguous uint8 ``data``
    (1-d, or one row per rank)."""
    shape = tuple(like.shape) if not rows else (rows * like.shape[0], *like.shape[1:]) if like.dim() else (rows,)
    if not like.numel():
        return like.new_empty(shape)
    if like.dtype != _BYTE:
        data = data.view(like.dtype)
    return data if len(shape) == 1 and data.dim() == 1 else data.view(shape)


def full(shape: Any, value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full`` of any dtype: torch 2.4 cannot fill a float8 tensor on the CPU (nor an empty one with
    ``zeros``), so float8 is filled in float32, then converted."""
    if dtype in _FLOAT8:
        return torch.full(shape, value, dtype=torch.float32, device=device).to(dtype)
    return torch.full(shape, value, dtype=dtype, device=device)


def gather(leaves: list[torch.Tensor], world: int, group: Any = None) -> list[torch.Tensor]:
    """Every rank's leaves (``world`` ranks), each concatenated along dim 0 in rank order (one all-gather per leaf)."""
    out = []
    for x in leaves:
        if x.dtype in NATIVE:
            mine = flat(x)
            result = mine.new_empty((world * x.shape[0], *x.shape[1:]) if x.dim() else (world,))
            if mine.numel():
                all_gather(result.view(-1), mine, group)
        else:  # moved as bytes
            mine = as_bytes(x)
            data = mine.new_empty(world * mine.numel())
            if mine.numel():
                all_gather(data, mine, group)
            result = from_bytes(data, x, world)
        out.append(result)
    return out


def broadcast(leaves: list[torch.Tensor], src: int, rank: int, group: Any = None) -> list[torch.Tensor]:
    """``src``'s leaves on every rank (``rank``: this one's global rank), as new tensors (one broadcast per leaf,
    as bytes)."""
    out = []
    for x in leaves:
        data = own(x).view(-1).view(_BYTE) if rank == src else torch.empty(x.nbytes, dtype=_BYTE, device=x.device)
        if data.numel():
            broadcast_tensor(data, src, group)
        out.append(from_bytes(data, x))
    return out


def reduce(leaves: list[torch.Tensor], op: str, world: int, group: Any = None) -> list[torch.Tensor]:
    """The leaves reduced over ``group``'s ``world`` ranks with ``op`` (one all-reduce per leaf, in a wider dtype
    where needed)."""
    out = []
    for x in leaves:
        wide = WIDER.get(x.dtype)
        buf = own(x) if wide is None else flat(x).to(wide)
        if buf.numel():
            all_reduce(buf, "sum" if op == "mean" else op, group)
        out.append(reduced(buf, op, world, x))
    return out


def reduced(buf: torch.Tensor, op: str, world: int, like: torch.Tensor) -> torch.Tensor:
    """A reduced ``buf`` (1-d, or shaped like ``like``) as the result for ``like``: the mean divided, back in
    ``like``'s dtype and shape."""
    if op == "mean":
        buf = buf.div_(world)
    elif buf.dtype == torch.bool:  # gloo's sum leaves the count in each byte: proper booleans (0 or 1)
        buf = buf.view(torch.uint8).clamp_(max=1).view(torch.bool)
    if buf.dtype != like.dtype:  # (booleans reduced as bytes with max or min: 0 or 1, booleans as they are)
        buf = buf.view(like.dtype) if like.dtype == torch.bool else buf.to(like.dtype)
    return buf if buf.shape == like.shape else buf.view(like.shape)


def pad(
    leaves: list[torch.Tensor], dims: list[int], sizes: list[int], pad_index: Any, pad_first: bool
) -> list[torch.Tensor]:
    """New tensors: each leaf padded with ``pad_index`` along its dim to its size in ``sizes``."""
    result = []
    for x, d, n in zip(leaves, dims, sizes, strict=True):
        x = x.detach()
        if x.shape[d] == n:
            result.append(own(x))
            continue
        out = full((*x.shape[:d], n, *x.shape[d + 1 :]), pad_index, x.dtype, x.device)
        out.narrow(d, n - x.shape[d] if pad_first else 0, x.shape[d]).copy_(x)
        result.append(out)
    return result


def gather_bytes(payload: bytes, device: torch.device, world: int, group: Any = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order (one call when all fit in the first slot; over ``group``)."""
    first = _slot(payload, device)
    out = first.new_empty(world * _SLOT)
    all_gather(out, first, group)
    rows = _split(_host_bytes(out), _SLOT)
    lengths = [int.from_bytes(r[:8], "little") for r in rows]
    rest = max(lengths) - (_SLOT - 8)
    if rest <= 0:
        return [bytes(r[8 : 8 + n]) for r, n in zip(rows, lengths, strict=True)]
    tail = to_tensor(payload[_SLOT - 8 :].ljust(rest, b"\0"), device)
    out = tail.new_empty(world * rest)
    all_gather(out, tail, group)
    tails = _split(_host_bytes(out), rest)
    return [bytes((r[8:] + t)[:n]) for r, t, n in zip(rows, tails, lengths, strict=True)]


def gather_padded(
    payload: bytes, width: int, lengths: list[int], device: torch.device, world: int, group: Any = None
) -> list[bytes]:
    """Every rank's ``payload`` (``lengths`` bytes each, agreed beforehand), padded to ``width`` in one all-gather."""
    mine = to_tensor(payload.ljust(width, b"\0"), device)
    out = mine.new_empty(world * width)
    all_gather(out, mine, group)
    data = _host_bytes(out)
    return [bytes(data[r * width : r * width + n]) for r, n in enumerate(lengths)]


def broadcast_bytes(payload: bytes, length: int, src: int, rank: int, device: torch.device, group: Any = None) -> bytes:
    """``src``'s ``payload`` (``length`` bytes, agreed beforehand) on every rank."""
    data = to_tensor(payload, device) if rank == src else torch.empty(length, dtype=_BYTE, device=device)
    if length:
        broadcast_tensor(data, src, group)
    return payload if rank == src else bytes(_host_bytes(data))


def exchange_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's picklable ``obj`` over ``group``, in rank order: an unchecked all-gather on the host.

    For a gloo group of its own that one thread alone uses (a background checkpoint save's agreements);
    its backend calls keep their tensors alive as the collectives' do (``_KEPT``, per thread), so that destroying the
    group later never waits on gloo's worker thread for the GIL.
    """
    world = dist.get_world_size(group)
    return [loads(b) for b in gather_bytes(pickle.dumps(obj), torch.device("cpu"), world, group)]


def barrier(group: Any = None) -> None:
    """The backend's own barrier (unchecked collectives)."""
    call(dist.barrier, group)


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


def start_sum(x: torch.Tensor, group: Any = None) -> Any:
    """Begin summing ``x`` in place over ``group``'s ranks without waiting; :func:`wait` waits for it."""
    return call(dist.all_reduce, x, group=group, async_op=True)


def wait(work: Any) -> None:
    """Wait for work begun with :func:`start_sum`."""
    try:
        _wait(work)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        raise CommunicationError(exc) from exc
