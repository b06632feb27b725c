"""The first message of every collective: a slot whose header lets every rank check the call.

Without debug mode, ranks that disagree about a collective (another operation, other dtypes or
shapes, another source rank, ranks out of step) must neither mix up data silently nor let the
backend abort: gloo kills a process (SIGABRT) that receives a message longer than the buffer it
posted, before anything can be checked. So no rank sends data of a size it chose alone until
every rank has seen every other's header:

- **Two-way collectives** (gather, reduce, pad_across_processes, gather_object, the barrier, the
  breakpoint check) start with an all-gather of one *slot* per rank. Every rank computes the
  same slot size from what all ranks sent before, never from its own input. A slot starts with a
  64-byte header (operation, sequence number, a fingerprint of the arguments, structure, dtypes
  and shapes, a digest of every earlier header) and carries the data when it fits: the
  collective is then that one message (a reduction is computed from the gathered slots, and the
  next one at this point of the program is one all-reduce, see :mod:`._plan`). Every
  rank sees every header, so every rank reaches the same verdict, and on a disagreement all of
  them raise debug mode's per-process table. Data that does not fit follows in a second message,
  once the sizes are known to agree. The slot size is learned: each call records, under the key
  of the call before it, the size it needed, so a training loop's calls soon fit in one message.
- **Broadcasts** are one-way: the source hears from nobody, and making it wait for the others
  would double the cost. It sends header and data in one message; gloo accepts a message shorter
  than the buffer posted for it, so receivers post ``_INBOX`` bytes whatever the source sends.
  A receiver that finds a mismatch posts its table to the job's store, closes the process group
  and raises: the source's next collective fails at once and quotes the table. If every rank
  thinks it is the source, nobody receives; the digest in the next header tells.
"""

from __future__ import annotations

import zlib
from typing import NoReturn

import torch

from .. import _state
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _bytes, _exchange, _mismatch
from ._header import AGREE, HEADER, LENGTH, MAGIC, OPS, Arrival, Call

__all__ = ["broadcast", "exchange"]

_INBOX = 1 << 20  # bytes gloo broadcast receivers post; larger payloads follow the header separately
_BUDGET = {"reduce": 1 << 20}  # bytes of slots per call (all ranks) worth learning, beyond which data
_DEFAULT_BUDGET = 4 << 20  # moves in a second message (the reduction of gathered slots costs world x)
_MAX_LEARNED = 1024  # learned sizes kept; beyond, forgotten alike on every rank
_VARYING = ("gather_object",)  # calls whose payload lengths may differ across ranks


def exchange(st: ProcessState, call: Call) -> Arrival:
    """The first message of a two-way collective; raises on every rank if the ranks disagree.

    Every rank must call it. A rank with ``call.problem`` takes part and returns (the caller
    raises its own error) while the others raise a :class:`DistributedOperationError` quoting it.
    """
    group = _state.group
    if group.closed:
        _refuse_closed(st, group)
    world, device = st.world_size, st.device
    size = group.slot_sizes.get(group.last_key, 0)
    base = _base(world)
    if size < base:
        size = base
    header = call.sent = call.header(group.chain, group.seq)
    group.call = call
    # Both buffers are reused from call to call: every result is copied or computed out of them.
    slot = _buffer(group, "send", size, device)
    _bytes.write(slot, 0, header)
    length = call.length
    if length <= size - HEADER:
        _write_payload(slot, call)
    out = _buffer(group, "receive", world * size, device)
    if st.backend == "fake":  # torch's fake group moves nothing: as if every rank had sent this slot
        out.view(world, size).copy_(slot)
    _exchange.all_gather(out, slot, world)
    headers = _bytes.read(out, size, world, HEADER)
    agree = header[:AGREE]
    if all(h.startswith(agree) for h in headers):
        lengths = [LENGTH.unpack_from(h, 28)[0] for h in headers] if call.op in _VARYING else [length] * world
        longest = max(lengths)
        group.chain = zlib.crc32(agree, group.chain)  # every rank takes this branch, or none
        _learn(group, call.op, header, HEADER + longest, world)
        return Arrival(out, size, lengths, longest <= size - HEADER)
    lengths = [LENGTH.unpack_from(h, 28)[0] for h in headers]
    group.chain = zlib.crc32(b"".join(h[:AGREE] for h in headers), group.chain)
    first = headers[0][4]
    _learn(group, OPS[first - 1] if 0 < first <= len(OPS) else "", headers[0], HEADER + max(lengths), world)
    arrival = Arrival(out, size, lengths, False)
    _mismatch.disagree(st, call, headers, arrival)
    return arrival


def broadcast(st: ProcessState, call: Call, src: int) -> Arrival:
    """The first message of a broadcast from ``src``: the source's slot, whose data may follow separately.

    Every rank must call it; the source sends, the others receive and check. A receiver that
    finds a mismatch closes the group (the source hears of it at its next collective) and raises.
    """
    group = _state.group
    if group.closed:
        _refuse_closed(st, group)
    short_ok = _exchange.accepts_short_messages(st.backend)
    size = _INBOX if short_ok else max(_base(st.world_size), group.slot_sizes.get(group.last_key, 0))
    header = call.sent = call.header(group.chain, group.seq)
    group.call = call
    if st.rank == src:
        fits = call.length <= size - HEADER
        sent = (HEADER + (call.length if fits else 0)) if short_ok else size
        # Not reused: the source's results are views of the slot it sent (its copy of the input).
        slot = _slot(header, call if fits else None, torch.empty(sent, dtype=torch.uint8, device=st.device))
        _exchange.broadcast_tensor(slot, src)
        group.chain = zlib.crc32(header[:AGREE], group.chain)
        return Arrival(slot, slot.numel(), [call.length], fits)
    inbox = _buffer(group, "inbox", size, st.device)
    _exchange.broadcast_tensor(inbox, src)
    theirs = _bytes.read(inbox, size, 1, HEADER)[0]
    group.chain = zlib.crc32(theirs[:AGREE], group.chain)
    length = LENGTH.unpack_from(theirs, 28)[0] if theirs[:4] == MAGIC else 0
    arrival = Arrival(inbox, size, [length], length <= size - HEADER)
    if theirs[:AGREE] != header[:AGREE] or call.problem is not None:
        _mismatch.refuse_broadcast(st, call, src, {src: theirs, st.rank: header}, arrival)
    return arrival


# --- headers ------------------------------------------------------------------------------------


def _slot(header: bytes, call: Call | None, slot: torch.Tensor) -> torch.Tensor:
    """``slot`` with the header, then ``call``'s payload (None: it does not fit); the rest left as it was."""
    _bytes.write(slot, 0, header)
    if call is not None:
        _write_payload(slot, call)
    return slot


def _write_payload(slot: torch.Tensor, call: Call) -> None:
    if isinstance(call.payload, bytes):
        _bytes.write(slot, HEADER, call.payload)
    else:
        for offset, part in call.payload:
            _bytes.write(slot, HEADER + offset, part)


def _base(world: int) -> int:
    """The smallest slot: room for a small payload, few bytes in all however many ranks."""
    return max(256, min(4096, (32 << 10) // world // 64 * 64))


def _size_class(n: int) -> int:
    """``n`` rounded up to a coarse ladder (at most 1/8 more), so that sizes that vary a little share one."""
    step = max(64, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def _learn(group: _state.GroupState, op: str, header: bytes, needed: int, world: int) -> None:
    """After a two-way first message, from what every rank saw: the same update on every rank.

    ``op`` and ``header`` are the call's (every rank's, when they agree; rank 0's otherwise),
    ``needed`` the largest slot any rank needed for it. Only two-way calls teach: what a broadcast's
    receivers see may differ from what its source sent, and no slot size may ever differ between ranks.
    """
    sizes = group.slot_sizes
    if needed * world <= _BUDGET.get(op, _DEFAULT_BUDGET):
        if len(sizes) >= _MAX_LEARNED:
            sizes.clear()
        sizes[group.last_key] = _size_class(needed)
    else:
        sizes.pop(group.last_key, None)
    group.last_key = zlib.crc32(header[4:8] + header[20:28])


def _buffer(group: _state.GroupState, role: str, size: int, device: torch.device) -> torch.Tensor:
    """The group's reusable uint8 buffer for ``role``, of ``size`` bytes (a new one when the size changes).

    A group's collectives all run on one device: only the size is compared.
    """
    buffer = group.buffers.get(role)
    if buffer is None or buffer.numel() != size:
        buffer = group.buffers[role] = torch.empty(size, dtype=torch.uint8, device=device)
    return buffer


def _refuse_closed(st: ProcessState, group: _state.GroupState) -> NoReturn:
    raise DistributedOperationError(
        f"the process group of process {st.rank} was closed: {group.closed}\nEvery process must call the "
        f"same collectives in the same order; fix the call above and start the job again."
    )
