"""Reductions that repeat: one all-reduce, with each rank's fingerprint in the same message.

Once a reduction went through the checked first message (:mod:`._wire`), every rank knows that
all of them reduced N elements of one dtype with one operation at this point of the program. The
next call there is *planned*: one all-reduce of N + K elements of that dtype, the plan taken from
what every rank saw, so that the ranks' messages agree in size and dtype whatever their inputs.
The last K elements carry the rank's fingerprint (operation, arguments, dtype, shapes, call number,
digest of the calls before), reduced along with the data so that any disagreement shows: a sum
adds bits (0 or 1), which total 0 or the world size only where all ranks agree; max, min and
product (and the logical or/and of booleans) carry each bit and its complement, which come out as
sent only where all agree. Every rank reads the same reduced bits, so every rank reaches the same
verdict. A call that does not fit the plan still sends the planned message, with its fingerprint:
when all ranks made that same call, the plan is dropped and the call goes the checked way; when
they did not, every rank raises debug mode's table.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import _state
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _bytes, _debug, _exchange

if TYPE_CHECKING:
    from ._header import Call

__all__ = ["Plan", "learn", "run"]

_BITS = 64
# The largest world size whose sum of ones each dtype holds exactly (a bit's count reaches it).
_EXACT = {torch.float16: 2048, torch.bfloat16: 256, torch.float32: 1 << 24, torch.float64: 1 << 53, torch.uint8: 255,
          torch.int8: 127, torch.int32: 1 << 31, torch.int64: 1 << 62, torch.bool: 1 << 62}  # fmt: skip
_WIRE = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "product": "product"}  # mean: sum, then divide
_MIX = 0x9E3779B97F4A7C15  # spreads the call number and digest over the fingerprint's bits
_MASK = (1 << _BITS) - 1


@dataclass(frozen=True)
class Plan:
    """The all-reduce every rank sends at one point of the program: ``numel`` elements of ``dtype``, a fingerprint."""

    dtype: torch.dtype
    wire: str  # the backend's reduction: "sum", "max", "min" or "product"
    numel: int


def learn(group: _state.GroupState, key: int, leaves: list[torch.Tensor], op: str, world: int) -> None:
    """After a reduction every rank checked the long way: plan the next call at ``key`` (when it can be)."""
    dtypes = {x.dtype for x in leaves}
    numel = sum(x.numel() for x in leaves)
    if len(dtypes) == 1 and numel and world <= _EXACT.get(next(iter(dtypes)), 0) and op in _WIRE:
        group.plans[key] = Plan(next(iter(dtypes)), _WIRE[op], numel)


def run(st: ProcessState, call: Call, plan: Plan) -> list[torch.Tensor] | None:
    """The planned all-reduce: ``call``'s results when it fits the plan, None when every rank's call differs from it.

    Every rank must call it when the plan exists. Raises :class:`DistributedOperationError` on every
    rank when the ranks disagree (a rank with ``call.problem`` returns None and raises its own error).
    """
    group = _state.group
    world, key = st.world_size, group.last_key
    header = call.sent = call.header(group.chain, group.seq)
    group.call = call
    fits = _fits(call, plan)
    width = _BITS if plan.wire == "sum" and plan.dtype != torch.bool else 2 * _BITS
    size = plan.dtype.itemsize
    message = torch.empty(plan.numel + width, dtype=plan.dtype, device=st.device)
    raw = message.view(torch.uint8)
    if fits:
        offset = 0
        for x in call.leaves:
            _bytes.write(raw, offset, x)
            offset += x.numel() * size
    bits = (int.from_bytes(header[20:28], "little") ^ (zlib.crc32(header[4:20]) * _MIX)) & _MASK
    _bytes.write(raw, plan.numel * size, _pattern(plan.dtype, width, bits, 1))
    _exchange.all_reduce(message, plan.wire)
    if st.backend == "fake" and width == _BITS:  # torch's fake group reduces nothing: as if every rank sent this
        message.mul_(world)
    seen = _bytes.read(raw[plan.numel * size :], width * size, 1, width * size)[0]
    scale = world if width == _BITS else 1
    if seen == _pattern(plan.dtype, width, bits, scale):
        if not fits:  # every rank made this same call, another than planned: it goes the checked way
            group.plans.pop(key, None)
            return None
        group.chain = zlib.crc32(header[:28], group.chain)  # as the checked way would, from what all sent
        group.last_key = zlib.crc32(header[4:8] + header[20:28])
        return _results(message, call, world)
    group.plans.pop(key, None)
    group.last_key = 0
    # Every rank saw the disagreement: describe every rank's call as debug mode does.
    _debug.check(st, call.op, call.params, call.leaves, call.spec, call.free_dim, call.problem)
    if call.problem is not None:
        return None
    raise DistributedOperationError(
        f"Cannot apply accelkit.{call.op}: the processes are out of step: they agree on this call (#{group.seq}: "
        f"{call.describe()}) but made different collective calls before it.\nFix: Every process must call the "
        f"same collectives in the same order (a broadcast given another src on some processes, or a collective "
        f"that only some processes called, puts them out of step)."
    )


def _fits(call: Call, plan: Plan) -> bool:
    if call.op != "reduce" or call.problem is not None or _WIRE.get(call.params.get("op", "")) != plan.wire:
        return False
    return all(x.dtype == plan.dtype for x in call.leaves) and sum(x.numel() for x in call.leaves) == plan.numel


def _results(message: torch.Tensor, call: Call, world: int) -> list[torch.Tensor]:
    if call.params.get("op") == "mean":
        message.div_(world)
    out, offset = [], 0
    for x in call.leaves:
        out.append(message[offset : offset + x.numel()].view(x.shape))
        offset += x.numel()
    return out


def _pattern(dtype: torch.dtype, width: int, bits: int, scale: int) -> bytes:
    """The fingerprint as ``width`` elements of ``dtype``: each bit (times ``scale``), then (128) each complement."""
    table = _byte_table(dtype, scale)
    data = bits.to_bytes(8, "little")
    parts = [table[b] for b in data]
    if width > _BITS:
        parts += [table[b ^ 0xFF] for b in data]
    return b"".join(parts)


@functools.lru_cache(maxsize=64)
def _byte_table(dtype: torch.dtype, scale: int) -> list[bytes]:
    """For each byte value: its 8 bits (least first) as elements of ``dtype``, each 0 or ``scale``."""
    values = torch.tensor([[(v >> j) & 1 for j in range(8)] for v in range(256)], dtype=torch.int64) * scale
    table = values.to(dtype).contiguous()
    raw = table.view(-1).view(torch.uint8)
    row = raw.numel() // 256
    return _bytes.read(raw, row, 256, row)
