"""Where a rank is while a pass that may wait for the other ranks runs, for the heartbeat (``_group.meet``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import _group, _state
from .._state import NOWHERE, Now
from .._strategies.ddp import PreparedDDP

__all__ = ["WaitingDDP", "mark", "mark_waits", "marks"]


def mark_waits(model: nn.Module) -> nn.Module:
    """Publish, while ``model``'s forward runs, that it may wait for the other ranks (DDP rebuilds its
    buckets and broadcasts buffers there; FSDP gathers parameters): a rank left waiting for this one
    can tell where it is (see ``_group.meet``). Returns ``model``.

    The DDP ``ak.prepare`` made publishes from its own forward (module hooks would send every
    forward through torch's slower hooked call path); other modules through hooks.
    """
    if type(model) is PreparedDDP:
        model.__class__ = WaitingDDP
    elif isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "reshard"):
        model.register_forward_pre_hook(_waiting)
        model.register_forward_hook(_done_waiting, always_call=True)
    return model


class WaitingDDP(PreparedDDP):
    """The prepared DDP of a job with several processes: its forward publishes that it may wait."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        group = _state.group
        before, marked = marks
        if group.now is not before:
            before, marked = mark(group.now)
        group.now = marked
        try:
            return _ddp_forward(self, *inputs, **kwargs)
        finally:
            group.now = before if group.now is marked else group.now._replace(doing="")

    def _get_name(self) -> str:
        return "PreparedDDP"  # as printed: the same module


def _waiting(module: nn.Module, args: Any) -> None:
    _state.group.now = _state.group.now._replace(doing=_group.SYNCING)


def _done_waiting(module: nn.Module, args: Any, output: Any) -> None:
    _state.group.now = _state.group.now._replace(doing="")


def mark(now: Now) -> tuple[Now, Now]:
    """``now`` as it reads outside and inside a pass that may wait, kept for the next pass: the
    snapshot changes only with an accelkit collective, so a step usually allocates nothing."""
    global marks
    marks = (now._replace(doing="") if now.doing else now, now._replace(doing=_group.SYNCING))
    return marks


marks = (NOWHERE, NOWHERE._replace(doing=_group.SYNCING))  # the last snapshot seen, and it marked
_ddp_forward: Any = PreparedDDP.forward
