"""Each collective, checked: the data through torch's own collective over the channel's group, the call's token with it.

Every rank of the group moves the same message sizes whatever its input (see :mod:`._plan`), and
learns from the tokens whether every rank made the same call:

- first call at a point of the program: the check alone (a small all-reduce), then the data;
- later calls there: the planned message, with the token in it (small) or beside it (large);
- a planned message that every rank's call missed alike (a smaller last batch): the data again,
  now that the ranks are known to agree, and a new plan;
- any disagreement: every rank of the group that can tell raises debug mode's table (:mod:`._mismatch`).

A broadcast's receivers judge the source's token; the source, which hears from nobody, learns of a
disagreement at its next collective. On the device wire the verdict of a planned call is read at the
rank's next collective instead of now (:func:`settle`): the host never waits for it.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _state
from .._state import ProcessState
from .._tree import LEAF
from . import _exchange, _mismatch, _plan, _scope, _scratch
from ._channel import Channel, Channels, Pending
from ._movers import Broadcast, Mover, planned
from ._plan import Plan, Point
from ._signature import Call
from ._wire import Again, Verdict

__all__ = ["again", "barrier", "run", "settle"]

_BARE = ("gather", "reduce", "broadcast")  # the operations whose call of one tensor moves that tensor


def run(st: ProcessState, ch: Channel, call: Call, mover: Mover) -> list[torch.Tensor] | None:
    """``call``'s results; None when this rank's input was invalid (the caller raises its own error).

    Every rank of the channel's group must call it. Raises :class:`DistributedOperationError` on every rank
    that can tell when the ranks' calls differ.
    """
    key = ch.key
    point = ch.plans.get(key)
    plan = point.plan if point is not None else None
    if point is None or plan is None:  # the first call here: the check, then the data
        if not ch.wire.check(call.token, ch.group, ch.size):
            return _disagree(st, ch, call, None)
        return _agreed(ch, call, mover, key)
    fits = plan.fingerprint == call.sig.fingerprint and call.problem is None
    # A rank whose call differs from the plan moves the planned message all the same, with zeros in it.
    moving = mover if fits else planned(plan.mover)
    data = call.data if fits else plan.dummies(ch.device)
    if plan.tail:
        out, verdict = moving.tail(ch, data, call.sig, call.seq, call.token)
    else:
        begun = ch.wire.start_check(call.token, ch.group)
        out = moving.data(ch, data)
        verdict = ch.wire.end_check(begun, call.token, ch.size)
    return _judged(st, ch, call, mover, moving, point, plan, fits, out, verdict)


def again(st: ProcessState, op: str, param: Any, x: Any, group: Any) -> torch.Tensor | None:
    """The result of ``op`` of the one tensor ``x`` where it repeats the call planned at its channel's point (the
    plan's bare call: operation, argument, dtype, shape), run as :func:`run` runs a planned call that fits, without
    a :class:`Call` unless the verdict needs one; None for any other call (the caller describes it).

    Most collectives of a loop repeat the call made at their point the step before: this is their path, the call
    as the wire prepared it for this thread (:meth:`~._wire.Wire.again`) where it can. A disagreement raises
    (the call is valid: it made the plan).
    """
    channels = _state.group.channels
    if channels is None or not isinstance(x, torch.Tensor):
        return None
    ch = channels.world if group is None and channels.again is st else channels.repeating(st, group)
    if ch is None:
        return None
    point = ch.plans.get(ch.key)
    plan = point.plan if point is not None else None
    if point is None or plan is None or plan.bare != (op, param, x.dtype, x.shape):
        return None
    if channels.unsettled:
        settle(st)
    quick = point.quick
    if quick is None or quick[0] is not plan or quick[1] is not _scratch.mine():
        prepared = ch.wire.again(plan.bare, plan.sig, ch.group, ch.size, ch.me)
        quick = point.quick = (plan, _scratch.mine(), prepared)
    return _again(st, ch, point, plan, x, quick[2])


def _again(
    st: ProcessState, ch: Channel, point: Point, plan: Plan, x: torch.Tensor, prepared: Again | None
) -> torch.Tensor:
    sig = plan.sig
    seq, token = _scope.begin(st, ch, sig)
    try:
        mover: Mover | None = None
        verdict: Verdict
        if prepared is not None:
            result, verdict, seen = prepared(x, seq, token)
        else:
            mover = planned(plan.mover)
            out, verdict = mover.tail(ch, [x], sig, seq, token)
            result = out[0]
        if verdict is True:
            ch.key = sig.fingerprint
            point.agreed(sig.fingerprint)
        else:  # a verdict to read later, or a disagreement: judged as run() judges it, with the call described
            if mover is None:
                mover = planned(plan.mover)
                if isinstance(mover, Broadcast):
                    mover.seen = seen
            op, param = plan.bare[:2]  # type: ignore[index]
            call = Call(sig, [x], {_PARAMS[op]: param} if op in _PARAMS else {}, LEAF)
            call.seq, call.token = seq, token
            judged = _judged(st, ch, call, mover, mover, point, plan, True, [result], verdict)
            result = judged[0]  # type: ignore[index]
    except BaseException as exc:
        _scope.end(ch)
        if isinstance(exc, _exchange.CommunicationError):
            _scope.failed(sig.op, st, exc, ch)
        raise
    _scope.end(ch)
    return result


_PARAMS = {"reduce": "op", "broadcast": "src"}  # the argument of a bare call, by operation (gather has none)


def _judged(
    st: ProcessState, ch: Channel, call: Call, mover: Mover, moving: Mover, point: Point, plan: Plan, fits: bool,
    out: list[torch.Tensor], verdict: Verdict,
) -> list[torch.Tensor] | None:  # fmt: skip
    """What the planned message ``moving`` moved says, and the results: kept where every rank made the planned
    call (its verdict to be read later, on the device wire), else the call's own data moved anew or the tables."""
    key = ch.key
    if plan.tail and isinstance(moving, Broadcast) and moving.source_missed(ch, plan, fits):
        # Every rank knows that the source made another call than planned: compare the calls both ways.
        if ch.wire.check(call.token, ch.group, ch.size):
            return _agreed(ch, call, mover, key)
        return _disagree(st, ch, call, None)
    if callable(verdict):
        if fits:  # read at the next collective; if the ranks differed, every rank raises then and forgets the counts
            seen = moving.seen if isinstance(moving, Broadcast) and isinstance(moving.seen, torch.Tensor) else None
            ch.pending = Pending(verdict, call, seen, moving.src if isinstance(moving, Broadcast) else -1)
            _state.group.channels.unsettled.append(ch)
            ch.key = call.sig.fingerprint
            point.agreed(plan.fingerprint)
            return out
        verdict = verdict()  # this rank's call missed the plan: it waits for the verdict anyway
    if verdict:
        if fits:
            ch.key = call.sig.fingerprint
            point.agreed(plan.fingerprint)
            return out
        return _agreed(ch, call, mover, key)  # every rank made this same call, another than planned
    return _disagree(st, ch, call, moving if plan.tail else None)


def barrier(st: ProcessState, ch: Channel, call: Call) -> None:
    """``wait_for_everyone``: the check alone."""
    if not ch.wire.check(call.token, ch.group, ch.size):
        _disagree(st, ch, call, None)
    ch.key = 0 if call.problem is not None else call.sig.fingerprint


def settle(st: ProcessState) -> None:
    """Raise now what the last collectives' verdicts left on their way from the device found, if anything."""
    found: Channels | None = _state.group.channels
    if found is not None and found.unsettled:
        with _scope.communication(st, "the last collective"):
            _settle(st, found)


def _settle(st: ProcessState, found: Channels) -> None:
    """Read the verdicts left on their way from the device, in call order; raise if the ranks of a group differed."""
    while found.unsettled:
        ch = found.unsettled.pop(0)
        pending, ch.pending = ch.pending, None
        if pending is None or pending.read():
            continue
        if pending.seen is not None:  # a broadcast's receiver: the source's header tells what it sent
            ch.forget()
            _mismatch.refuse_broadcast(st, ch, pending.call, pending.src, bytes(pending.seen.tolist()))
            continue
        _disagree(st, ch, pending.call, None)


def _agreed(ch: Channel, call: Call, mover: Mover, key: int) -> list[torch.Tensor] | None:
    """Every rank made ``call``: move its data, and plan the next call at ``key`` like it."""
    if call.problem is not None:  # every rank's input was invalid: each raises its own error
        ch.key = 0
        return None
    out = mover.data(ch, call.data)
    data = call.data
    tail = bool(data) and mover.rides(ch, data)
    bare = None
    if call.spec is LEAF and call.op in _BARE:  # one tensor, the user's own: a call that can run again as it is
        bare = (call.op, next(iter(call.params.values()), None), data[0].dtype, data[0].shape)
    _plan.learn(ch.plans, key, call.sig, mover.key, data, tail, bare)
    ch.key = call.sig.fingerprint
    return out


def _disagree(st: ProcessState, ch: Channel, call: Call, mover: Mover | None) -> list[torch.Tensor] | None:
    """The ranks' calls differ: every rank that can tell raises the table (an invalid input's rank: returns,
    and the caller raises its own error)."""
    ch.forget()
    if isinstance(mover, Broadcast) and ch.me != mover.src:  # a one-way broadcast's receiver: only it can tell
        _mismatch.refuse_broadcast(st, ch, call, mover.src, mover.theirs())
    else:
        _mismatch.disagree(st, ch, call)
    return None
