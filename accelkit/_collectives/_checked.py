"""Each collective, checked: the data through torch's own collective for the job, the call's token with it.

Every rank moves the same message sizes whatever its input (see :mod:`._plan`), and learns from
the tokens whether every rank made the same call:

- first call at a point of the program: the check alone (a small all-reduce), then the data;
- later calls there: the planned message, with the token in it (small) or beside it (large);
- a planned message that every rank's call missed alike (a smaller last batch): the data again,
  now that the ranks are known to agree, and a new plan;
- any disagreement: every rank that can tell raises debug mode's table (:mod:`._mismatch`).

A broadcast's receivers judge the source's token; the source, which hears from nobody, learns of a
disagreement at its next collective. On an accelerator the verdict of a planned call is read at the
rank's next collective instead of now (see :class:`._check.Deferred`): the host never waits for it.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _state, _tree
from .._state import ProcessState
from . import _check, _exchange, _mismatch, _plan, _scratch
from ._signature import AGREE, HEADER, Signature, token

__all__ = ["Broadcast", "Call", "Gather", "Reduce", "barrier", "run", "settle"]


class Call:
    """This rank's side of one collective: what it is, the tensors it moves, what the tables show."""

    __slots__ = ("data", "free_dim", "op", "params", "problem", "seq", "shapes", "sig", "spec", "token")

    def __init__(
        self,
        sig: Signature,
        seq: int,
        data: list[torch.Tensor],
        params: dict[str, Any],
        spec: _tree.TreeSpec | None = None,
        shapes: list[tuple[torch.dtype, torch.Size]] | None = None,
        free_dim: int | None = None,
        problem: BaseException | None = None,
    ) -> None:
        self.sig, self.seq, self.token, self.data = sig, seq, token(sig, seq), data
        self.op, self.params, self.spec, self.free_dim, self.problem = sig.op, params, spec, free_dim, problem
        self.shapes = shapes  # the user's leaves as (dtype, shape), for the tables; None: ``data``'s

    def leaf_shapes(self) -> list[tuple[torch.dtype, torch.Size]]:
        return self.shapes if self.shapes is not None else [(x.dtype, x.shape) for x in self.data]


class Reduce:
    def __init__(self, op: str) -> None:
        self.op, self.wire = op, "sum" if op == "mean" else op
        self.key: tuple[str, Any] = ("reduce", op)

    def data(self, st: ProcessState, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exchange.reduce(leaves, self.op, st.world_size)

    def tail(self, st: ProcessState, leaves: list[torch.Tensor], call: Call) -> tuple[list[torch.Tensor], Any]:
        """One all-reduce per dtype; the token's bits after the first dtype's data."""
        x = leaves[0]
        if len(leaves) == 1 and x.dtype not in _exchange.WIDER and _exchange.plain(x):  # the common case, lean
            n, logic = x.numel(), _check.logic(x.dtype, self.wire)
            message = torch.cat([_exchange.flat(x), *_check.bits(call.token, x.dtype, st.device, logic)])
            _exchange.all_reduce(message, self.wire)
            result, bits = message.split_with_sizes([n, message.numel() - n])
            return [_exchange.reduced(result, self.op, st.world_size, x)], _verdict_of_bits(st, bits, logic)
        if len(leaves) == 1:  # the common case, in as few tensor operations as it takes
            groups = {_exchange.WIDER.get(leaves[0].dtype, leaves[0].dtype): [0]}
        else:
            groups = {}
            for i, x in enumerate(leaves):
                groups.setdefault(_exchange.WIDER.get(x.dtype, x.dtype), []).append(i)
        out: list[torch.Tensor] = [leaves[0]] * len(leaves)
        verdict: Any = None
        for dtype, members in groups.items():
            values = [_exchange.flat(leaves[i]) for i in members]
            values = [v if v.dtype == dtype else v.to(dtype) for v in values]
            n = values[0].numel() if len(values) == 1 else sum(v.numel() for v in values)
            if verdict is None:  # the first dtype carries the token
                logic = _check.logic(dtype, self.wire)
                message = torch.cat([*values, *_check.bits(call.token, dtype, st.device, logic)])
                _exchange.all_reduce(message, self.wire)
                verdict = _verdict_of_bits(st, message[n:], logic)
                # The first result is the message itself: its data at offset 0 of a fresh storage that holds
                # nothing else a user can see (the token's bits after it); the others are copied out of it.
                reduced, kept = message[:n], 1
            else:
                reduced = torch.cat(values) if len(values) > 1 else values[0].clone()
                _exchange.all_reduce(reduced, self.wire)
                kept = 1 if len(values) == 1 else 0  # the whole message is this leaf's result
            parts = [reduced] if len(values) == 1 else torch.split(reduced, [v.numel() for v in values])
            for k, (i, part) in enumerate(zip(members, parts, strict=True)):
                out[i] = _exchange.reduced(part if k < kept else part.clone(), self.op, st.world_size, leaves[i])
        return out, verdict


class Gather:
    key: tuple[str, Any] = ("gather", None)

    def data(self, st: ProcessState, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exchange.gather(leaves, st.world_size)

    def tail(self, st: ProcessState, leaves: list[torch.Tensor], call: Call) -> tuple[list[torch.Tensor], Any]:
        """One all-gather of every leaf's bytes and the header, per rank."""
        world = st.world_size
        mine = call.sig.header(call.seq)
        if st.device.type == "cpu":
            found = _scratch.gather(world, tuple((x.dtype, x.shape) for x in leaves), HEADER)
            if found is not None:
                return self._lean(st, leaves, mine, *found)
        parts = [_exchange.as_bytes(x) for x in leaves]
        header = _check.header_tensor(mine, st.device)
        width = sum(p.numel() for p in parts) + HEADER
        message = torch.cat([*parts, header])
        gathered = message.new_empty(world * width)
        _exchange.all_gather(gathered, message)
        at = width - HEADER
        if st.device.type == "cpu":
            verdict: Any = _check.headers_agree(gathered, world, width, at, mine)
        else:
            verdict = _check.headers_agree_on_device(gathered, world, width, at, header)
        out, offset = [], 0
        for x, part in zip(leaves, parts, strict=True):
            n = part.numel()  # each rank's bytes of this leaf, copied out of every rank's message
            rows = gathered.as_strided((world, n), (width, 1), offset).clone()
            out.append(_exchange.from_bytes(rows, x, world))
            offset += n
        return out, verdict

    @staticmethod
    def _lean(
        st: ProcessState, leaves: list[torch.Tensor], mine: bytes, found: _scratch.Buffer, layout: _scratch.GatherLayout
    ) -> tuple[list[torch.Tensor], Any]:
        """The gather through this thread's buffer: the leaves copied in, the header written and read as bytes,
        each result one concatenation of every rank's values."""
        world, raw = st.world_size, found.raw
        for into, x in zip(layout.inputs, leaves, strict=True):
            if into is not None:
                into.copy_(x.detach() if x.requires_grad else x)
        raw[layout.header : layout.header + HEADER] = mine
        if st.backend == "fake":  # torch's fake group moves nothing: as if every rank sent this
            start = world * layout.width
            for r in range(world):
                raw[r * layout.width : (r + 1) * layout.width] = raw[start : start + layout.width]
        _exchange.all_gather(layout.gathered, layout.message)
        agreed = mine[:AGREE]
        verdict = all(raw[at : at + AGREE] == agreed for at in layout.headers)
        out = [torch.cat(rows) if rows is not None else _exchange.from_bytes(x, x, world)  # (empty: a new one)
               for x, rows in zip(leaves, layout.rows, strict=True)]  # fmt: skip
        return out, verdict


class Broadcast:
    def __init__(self, src: int) -> None:
        self.src = src
        self.key: tuple[str, Any] = ("broadcast", src)
        self.theirs = b""  # a receiver's copy of the source's header (on the CPU)
        self.tail_seen: torch.Tensor | None = None  # on an accelerator: the source's header, still on the device

    def data(self, st: ProcessState, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exchange.broadcast(leaves, self.src, st.rank)

    def tail(self, st: ProcessState, leaves: list[torch.Tensor], call: Call) -> tuple[list[torch.Tensor], Any]:
        """One broadcast of the source's bytes and header; a receiver compares the header with its own.

        The first result is the message itself (at offset 0 of a fresh storage whose only other bytes are
        the header and the later leaves' bytes, which are copied out): at any size, the copies raw code
        makes (the source's copy of its input, nothing on a receiver) and one backend call."""
        header = call.sig.header(call.seq)
        if len(leaves) == 1 and st.device.type == "cpu" and leaves[0].numel():
            return self._lean(st, leaves[0], header)
        sizes = [x.numel() * x.element_size() for x in leaves]
        at = sum(sizes)
        if st.rank == self.src:
            parts = [_exchange.as_bytes(x) for x in leaves]
            message = torch.cat([*parts, _check.header_tensor(header, st.device)])
        else:
            message = torch.empty(at + HEADER, dtype=torch.uint8, device=st.device)
        _exchange.broadcast_tensor(message, self.src)
        out, offset = [], 0
        for x, n in zip(leaves, sizes, strict=True):
            part = message[offset : offset + n]
            out.append(_exchange.from_bytes(part if offset == 0 else part.clone(), x))
            offset += n
        return out, self._verdict(st, message, at, header)

    def _lean(self, st: ProcessState, x: torch.Tensor, header: bytes) -> tuple[list[torch.Tensor], Any]:
        """One tensor on the host, in as few tensor operations as it takes: the message in its dtype, the header
        its last 64 bytes, written (the source) or read (a receiver) as bytes through this thread's buffer."""
        found = _scratch.head()
        as_is = x.dtype in _exchange.NATIVE and x.dtype != torch.bool  # else as bytes: a header's bytes are no bools
        head = found.head(x.dtype if as_is else torch.uint8)
        n = x.numel() if as_is else x.nbytes
        if st.rank == self.src:
            found.head_raw[:] = header
            message = torch.cat([_exchange.flat(x) if as_is else _exchange.as_bytes(x), head])
        else:
            message = head.new_empty(n + head.numel())
        _exchange.broadcast_tensor(message, self.src)
        result, tail = message.split_with_sizes([n, head.numel()])
        out = _exchange.from_bytes(result, x) if not as_is else result if x.dim() == 1 else result.view(x.shape)
        if st.rank == self.src:
            return [out], True
        head.copy_(tail)
        self.theirs = bytes(found.head_raw)
        return [out], self.theirs[:AGREE] == header[:AGREE]

    def _verdict(self, st: ProcessState, message: torch.Tensor, at: int, header: bytes) -> Any:
        """Whether the source's header (at ``at`` in ``message``) is this rank's (the source: True)."""
        if st.rank == self.src:
            return True
        tail = message[at : at + HEADER]
        if st.device.type != "cpu":
            self.tail_seen = tail.clone()
            return _check.headers_agree_on_device(
                message, 1, message.numel(), at, _check.header_tensor(header, st.device)
            )
        self.theirs = bytes(tail.tolist())
        return self.theirs[:AGREE] == header[:AGREE]

    def source_missed(self, st: ProcessState, plan: _plan.Plan, fits: bool) -> bool:
        """Whether the source's call was another than the plan's (then every rank knows it: a receiver from
        the source's header, where it has it on the host)."""
        if st.rank == self.src:
            return not fits
        if not self.theirs and self.tail_seen is not None and not fits:
            self.theirs = bytes(self.tail_seen.tolist())  # this rank waits for the verdict anyway
        return bool(self.theirs) and int.from_bytes(self.theirs[16:24], "little") != plan.fingerprint


Mover = Reduce | Gather | Broadcast


def planned(key: tuple[str, Any]) -> Mover:
    """The mover a plan names (a rank whose call differs from the plan still moves the planned message)."""
    kind, arg = key
    return Reduce(arg) if kind == "reduce" else Broadcast(arg) if kind == "broadcast" else Gather()


def run(st: ProcessState, call: Call, mover: Mover) -> list[torch.Tensor] | None:
    """``call``'s results; None when this rank's input was invalid (the caller raises its own error).

    Every rank must call it. Raises :class:`DistributedOperationError` on every rank that can tell
    when the ranks' calls differ.
    """
    group = _state.group
    key = group.key
    point = group.plans.get(key)
    plan = point.plan if point is not None else None
    if point is None or plan is None:  # the first call here: the check, then the data
        if not _checked_now(st, call):
            return _disagree(st, call, None)
        return _agreed(st, call, mover, key)
    fits = plan.fingerprint == call.sig.fingerprint and call.problem is None
    # A rank whose call differs from the plan moves the planned message all the same, with zeros in it.
    moving = mover if fits else planned(plan.mover)
    data = call.data if fits else plan.dummies(st.device)
    if plan.tail:
        out, verdict = moving.tail(st, data, call)
        if isinstance(moving, Broadcast) and moving.source_missed(st, plan, fits):
            # Every rank knows that the source made another call than planned: compare the calls both ways.
            return _agreed(st, call, mover, key) if _checked_now(st, call) else _disagree(st, call, None)
    else:
        work, check = _start_check(st, call)
        out = moving.data(st, data)
        verdict = _end_check(st, work, check)
    if fits and isinstance(verdict, torch.Tensor) and st.device.type == "cuda":  # read at the next collective
        seen = moving.tail_seen if isinstance(moving, Broadcast) else None
        group.pending = _check.Deferred.start(verdict, call, seen, getattr(moving, "src", -1))
        group.key = call.sig.fingerprint
        point.agreed(plan.fingerprint)  # if not, every rank raises at its next collective and forgets the counts
        return out
    if _agree(verdict):
        if fits:
            group.key = call.sig.fingerprint
            point.agreed(plan.fingerprint)
            return out
        return _agreed(st, call, mover, key)  # every rank made this same call, another than planned
    if isinstance(moving, Broadcast) and moving.tail_seen is not None:
        moving.theirs = bytes(moving.tail_seen.tolist())
    return _disagree(st, call, moving if plan.tail else None)


def barrier(st: ProcessState, call: Call) -> None:
    """``wait_for_everyone``: the check alone."""
    if not _checked_now(st, call):
        _disagree(st, call, None)
    _state.group.key = 0 if call.problem is not None else call.sig.fingerprint


def settle(st: ProcessState) -> None:
    """Read the verdict of the last call, if it was left on its way from the device; raise if the ranks differed."""
    group = _state.group
    pending, group.pending = group.pending, None
    if pending is None or pending.agreed():
        return
    if pending.seen is not None:  # a broadcast's receiver: the source's header tells what it sent
        _forget(group)
        _mismatch.refuse_broadcast(st, pending.call, pending.src, bytes(pending.seen.tolist()))
        return
    _disagree(st, pending.call, None)


def _agreed(st: ProcessState, call: Call, mover: Mover, key: int) -> list[torch.Tensor] | None:
    """Every rank made ``call``: move its data, and plan the next call at ``key`` like it."""
    group = _state.group
    if call.problem is not None:  # every rank's input was invalid: each raises its own error
        group.key = 0
        return None
    out = mover.data(st, call.data)
    _plan.learn(group.plans, key, call.sig.fingerprint, mover.key, call.data, st.world_size)
    group.key = call.sig.fingerprint
    return out


def _checked_now(st: ProcessState, call: Call) -> bool:
    check = _check.check_tensor(call.token, st.device)
    _exchange.all_reduce(check, "sum")  # nothing to overlap with: on this thread, as a small call runs fastest
    return _agree(_verdict_of_bits(st, check, False))


def _start_check(st: ProcessState, call: Call) -> tuple[Any, torch.Tensor]:
    check = _check.check_tensor(call.token, st.device)
    return _exchange.start_sum(check), check


def _end_check(st: ProcessState, work: Any, check: torch.Tensor) -> Any:
    _exchange.wait(work)
    return _verdict_of_bits(st, check, False)


def _verdict_of_bits(st: ProcessState, bits: torch.Tensor, logic: bool) -> Any:
    world = 1 if st.backend == "fake" else st.world_size  # torch's fake group reduces nothing: one rank's bits
    if st.device.type != "cpu":
        return _check.bits_agree_on_device(bits, world, logic)
    return _check.bits_agree(bits.tolist(), world, logic)


def _agree(verdict: Any) -> bool:
    return bool(verdict.item()) if isinstance(verdict, torch.Tensor) else bool(verdict)


def _forget(group: Any) -> None:
    """After a disagreement, on every rank that raises: no point (the ranks' histories may differ from here), and no
    plan (their counts may differ: on an accelerator, a rank counted a call before it knew the others made another)."""
    group.key = 0
    group.plans.clear()


def _disagree(st: ProcessState, call: Call, mover: Mover | None) -> list[torch.Tensor] | None:
    """The ranks' calls differ: every rank that can tell raises the table (an invalid input's rank: returns,
    and the caller raises its own error)."""
    _forget(_state.group)
    if isinstance(mover, Broadcast) and st.rank != mover.src:  # a one-way broadcast's receiver: only it can tell
        _mismatch.refuse_broadcast(st, call, mover.src, mover.theirs)
    else:
        _mismatch.disagree(st, call)
    return None
