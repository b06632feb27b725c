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
  collective is then that one message (a reduction is computed from the gathered slots). Every
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

import contextlib
import functools
import hashlib
import struct
import zlib
from typing import Any, NamedTuple, NoReturn

import torch

from .. import _group, _state, _tree
from .._state import ProcessState
from ..errors import DistributedOperationError
from . import _bytes, _debug, _exchange

__all__ = ["HEADER", "Arrival", "Call", "broadcast", "exchange"]

HEADER = 64
ONE_WAY = ("broadcast", "broadcast_object")
_OPS = ("gather", "reduce", "broadcast", "pad_across_processes", "gather_object", "broadcast_object",
        "wait_for_everyone", "check_breakpoint")  # fmt: skip
_CODES = {op: i + 1 for i, op in enumerate(_OPS)}
# magic, op, flags, dtype, ndim, chain, seq, fingerprint, payload bytes, up to 7 dims: 64 bytes.
_FORMAT = struct.Struct("<4sBBBBIQQQ7I")
_HEAD, _MOVING, _LENGTH, _DIMS = (
    struct.Struct("<4sBBBB"),
    struct.Struct("<IQ"),
    struct.Struct("<Q"),
    struct.Struct("<7I"),
)
_MAGIC = b"akc1"
_AGREE = 28  # the header's bytes every rank must share: magic .. fingerprint (not the length, not the dims)
_ERROR = 1  # flag: this rank's input was invalid; its slot holds the error's text
_TREE = 255  # dtype / ndim code of a call with several tensors, or none
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)  # fmt: skip
_INBOX = 1 << 20  # bytes gloo broadcast receivers post; larger payloads follow the header separately
_BUDGET = {"reduce": 1 << 20}  # bytes of slots per call (all ranks) worth learning, beyond which data
_DEFAULT_BUDGET = 4 << 20  # moves in a second message (the reduction of gathered slots costs world x)
_MAX_LEARNED = 1024  # learned sizes kept; beyond, forgotten alike on every rank
_VARYING = ("gather_object",)  # calls whose payload lengths may differ across ranks
_PROBLEM_TEXT = 180  # bytes of an invalid input's error that travel with its header (fits the smallest slot)


class Call:
    """This rank's side of one collective: what it is, and the bytes it carries.

    ``payload``: bytes, or tensors at their byte offsets (see ``_bytes.parts``), ``length`` bytes in
    all. A ``problem`` (this rank's input was invalid) travels as its text: the others quote it.
    """

    __slots__ = ("free_dim", "leaves", "length", "op", "params", "payload", "problem", "sent", "spec")

    def __init__(
        self,
        op: str,
        params: dict[str, Any],
        leaves: list[torch.Tensor] | None = None,
        spec: _tree.TreeSpec | None = None,
        *,
        free_dim: int | None = None,
        payload: bytes | list[tuple[int, torch.Tensor]] = b"",
        length: int = -1,
        problem: BaseException | None = None,
    ) -> None:
        self.op, self.params, self.leaves, self.spec, self.free_dim = op, params, leaves or [], spec, free_dim
        self.problem = problem
        if problem is not None:
            payload = f"{type(problem).__name__}: {problem}".encode()[:_PROBLEM_TEXT]
        self.payload = payload
        self.length = len(payload) if isinstance(payload, bytes) else length
        self.sent = b""  # the header this rank sent

    def signature(self) -> str:
        """What two ranks in the same call share: operation and fingerprint (not the number, nor the digest)."""
        return (self.sent[4:8] + self.sent[20:28]).hex()

    def header(self, chain: int, seq: int) -> bytes:
        """This rank's 64-byte header for call number ``seq``, after calls whose digest is ``chain``."""
        if self.problem is not None:
            head, fingerprint, dims = _pieces(self.op, None)
        elif self.spec is not None and self.spec.kind == "leaf":
            x = self.leaves[0]
            head, fingerprint, dims = _pieces(self.op, (tuple(self.params.values()), x.dtype, x.shape, self.free_dim))
        else:
            shapes = tuple((x.dtype, x.shape) for x in self.leaves)
            structure = _tree.signature(self.spec) if self.spec is not None else None
            head, fingerprint, dims = _pieces(self.op, (tuple(self.params.values()), structure, shapes, self.free_dim))
        return head + _MOVING.pack(chain, seq) + fingerprint + _LENGTH.pack(self.length) + dims

    def describe(self) -> str:
        """The call as debug mode's tables show it: ``accelkit.reduce(op='sum') float32 [4]``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        text = f"accelkit.{self.op}({args})"
        if self.problem is not None:
            return f"{text} raised {type(self.problem).__name__}: {self.problem}"
        if self.spec is None:
            return text
        return f"{text} {_tree.describe(self.spec, [_debug.leaf_text(x) for x in self.leaves])}"


class Arrival(NamedTuple):
    """What the first message brought: every rank's slot (a broadcast: the source's) and their payload lengths."""

    buffer: torch.Tensor  # uint8: the slots, one after the other (a broadcast: the source's only)
    stride: int  # bytes per slot
    lengths: list[int]  # each slot's payload bytes
    fits: bool  # every payload came whole in its slot

    @property
    def rows(self) -> torch.Tensor:
        """The slots as a (ranks, stride) uint8 matrix."""
        return self.buffer[: len(self.lengths) * self.stride].view(-1, self.stride)


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
    agree = header[:_AGREE]
    if all(h.startswith(agree) for h in headers):
        lengths = [_LENGTH.unpack_from(h, 28)[0] for h in headers] if call.op in _VARYING else [length] * world
        longest = max(lengths)
        group.chain = zlib.crc32(agree, group.chain)  # every rank takes this branch, or none
        _learn(group, call.op, header, HEADER + longest, world)
        return Arrival(out, size, lengths, longest <= size - HEADER)
    lengths = [_LENGTH.unpack_from(h, 28)[0] for h in headers]
    group.chain = zlib.crc32(b"".join(h[:_AGREE] for h in headers), group.chain)
    first = headers[0][4]
    _learn(group, _OPS[first - 1] if 0 < first <= len(_OPS) else "", headers[0], HEADER + max(lengths), world)
    arrival = Arrival(out, size, lengths, False)
    _disagree(st, call, headers, arrival)
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
        group.chain = zlib.crc32(header[:_AGREE], group.chain)
        return Arrival(slot, slot.numel(), [call.length], fits)
    inbox = _buffer(group, "inbox", size, st.device)
    _exchange.broadcast_tensor(inbox, src)
    theirs = _bytes.read(inbox, size, 1, HEADER)[0]
    group.chain = zlib.crc32(theirs[:_AGREE], group.chain)
    length = _LENGTH.unpack_from(theirs, 28)[0] if theirs[:4] == _MAGIC else 0
    arrival = Arrival(inbox, size, [length], length <= size - HEADER)
    if theirs[:_AGREE] != header[:_AGREE] or call.problem is not None:
        _refuse_broadcast(st, call, src, {src: theirs, st.rank: header}, arrival)
    return arrival


# --- headers ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _pieces(op: str, what: tuple[Any, ...] | None) -> tuple[bytes, bytes, bytes]:
    """A header's fixed parts for a call: (magic .. ndim, fingerprint, dims), computed once per kind of call.

    ``what``: None for an invalid input; (params, dtype, shape, free dim) for one tensor;
    (params, structure, ((dtype, shape), ...), free dim) for a tree, or a call without tensors.
    """
    if what is None:
        return _HEAD.pack(_MAGIC, _CODES[op], _ERROR, _TREE, 0), bytes(8), bytes(28)
    params, kind, shapes, free_dim = what
    if isinstance(kind, torch.dtype):  # one tensor
        key: tuple[Any, ...] = (op, params, kind, _shape(shapes, free_dim))
        dtype = _DTYPES.index(kind) if kind in _DTYPES else _TREE - 1
        dims = tuple(min(d, 0xFFFFFFFF) for d in shapes[:7])
        ndim = len(shapes)
    else:
        key = (op, params, kind, tuple((d, _shape(s, free_dim)) for d, s in shapes))
        dtype, ndim, dims = _TREE, (_TREE if kind is not None else 0), (len(shapes),) if kind is not None else ()
    # Stable across processes (unlike hash()): dtypes, shapes and names have the same repr everywhere.
    fingerprint = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (
        _HEAD.pack(_MAGIC, _CODES[op], 0, dtype, min(ndim, _TREE)),
        fingerprint,
        _DIMS.pack(*dims, *(0,) * (7 - len(dims))),
    )


def _shape(shape: tuple[int, ...], free_dim: int | None) -> tuple[int, ...]:
    if free_dim is None or not shape:
        return tuple(shape)
    free = free_dim % len(shape)
    return tuple(-1 if i == free else n for i, n in enumerate(shape))


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


# --- disagreements --------------------------------------------------------------------------------


def _disagree(st: ProcessState, call: Call, headers: list[bytes], arrival: Arrival) -> None:
    """The ranks sent different headers; every rank saw all of them, so every rank is here."""
    codes = {h[4] for h in headers}
    if any(_CODES[op] in codes for op in ONE_WAY):
        # A rank broadcast while this one gathered: it takes part in no further exchange, and does
        # not know: close the group, so that its next collective fails at once.
        table = _table(st, call, dict(enumerate(headers)), arrival)
        _post(st, table)
        _state.close_group(table.splitlines()[0])
        raise DistributedOperationError(table)
    # The others came here too: the same exchange as debug mode describes every rank's call in full.
    _debug.check(st, call.op, call.params, call.leaves, call.spec, call.free_dim, call.problem)
    if call.problem is not None:
        return  # this rank raises its own error; the others quote it
    raise DistributedOperationError(_out_of_step(call.op, headers))


def _refuse_broadcast(st: ProcessState, call: Call, src: int, headers: dict[int, bytes], arrival: Arrival) -> None:
    source_failed = bool(_FORMAT.unpack(headers[src])[2] & _ERROR) and headers[src][:4] == _MAGIC
    table = _table(st, call, headers, arrival)
    if not source_failed:
        # The source went on, unaware: close the group so that its next collective fails at once, quoting this.
        _post(st, table)
        _state.close_group(table.splitlines()[0])
    if call.problem is None:
        raise DistributedOperationError(table)


def _post(st: ProcessState, table: str) -> None:
    group = _state.group
    if group.store is not None:
        with contextlib.suppress(Exception):  # the store is gone: the others' error says less, nothing worse
            _group.post_report(group.store, group.board, st.rank, table)


def _table(st: ProcessState, call: Call, headers: dict[int, bytes], arrival: Arrival) -> str:
    """Debug mode's table, from the headers this rank saw (a broadcast: the source's and its own)."""
    unpacked = {r: _FORMAT.unpack(h) for r, h in headers.items() if h[:4] == _MAGIC}
    if len({u[1] for u in unpacked.values()}) > 1 or len(unpacked) < len(headers):
        head = "the processes called different operations."
    elif any(u[2] & _ERROR for u in unpacked.values()):
        head = "a process could not apply it to its input."
    elif len({u[7] for u in unpacked.values()}) > 1:
        head = "the inputs differ across processes."
    else:
        head = "the processes are out of step (they made different calls before this one)."
    lines = [f"Cannot apply accelkit.{call.op}: {head}"]
    for rank in range(st.world_size):
        if rank == st.rank:
            row = f"{call.describe()} (#{_state.group.seq})"
        elif rank in headers:
            row = _seen(headers[rank], arrival.rows[rank if len(arrival.lengths) > 1 else 0])
        else:
            row = "(not seen by this process: a broadcast reaches each process from the source only)"
        lines.append(f"  - Process {rank}: {row}")
    lines.append(
        "Fix: Every process must call the same collectives in the same order, with the same structure, dtypes "
        "and shapes (and the same src)."
    )
    return "\n".join(lines)


def _seen(header: bytes, row: torch.Tensor) -> str:
    """Another process's call, as its header shows it."""
    if header[:4] != _MAGIC:
        return "a message that is no accelkit collective's (a torch.distributed call made directly?)"
    _, code, flags, dtype, ndim, _, seq, _, length, *dims = _FORMAT.unpack(header)
    op = _OPS[code - 1] if 0 < code <= len(_OPS) else "?"
    if flags & _ERROR:
        text = _bytes.read(row, row.numel(), 1, HEADER + length)[0][HEADER:]
        return f"accelkit.{op} #{seq} raised {text.decode(errors='replace')}"
    if dtype == _TREE:
        what = f"{dims[0]} tensors ({length} bytes)" if ndim else f"{length} bytes"
    else:
        name = str(_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_DTYPES) else "tensor"
        what = f"{name} {list(dims[:ndim])}" if ndim <= 7 else f"{name} of {ndim} dimensions"
    return f"accelkit.{op} #{seq} {what}"


def _out_of_step(op: str, headers: list[bytes]) -> str:
    lines = [f"Cannot apply accelkit.{op}: the processes are out of step: they agree on this call but made "
             f"different collective calls before it."]  # fmt: skip
    for rank, header in enumerate(headers):
        _, code, _, _, _, chain, seq, *_ = _FORMAT.unpack(header)
        lines.append(f"  - Process {rank}: accelkit.{_OPS[code - 1]} #{seq}, after calls with digest {chain:08x}")
    lines.append(
        "Fix: Every process must call the same collectives in the same order (a broadcast given another src on "
        "some processes, or a collective that only some processes called, puts them out of step)."
    )
    return "\n".join(lines)
