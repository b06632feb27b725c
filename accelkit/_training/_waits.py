"""Where a rank is while a pass that may wait for the other ranks runs, for the heartbeat (``_group.meet``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import _group, _state

__all__ = ["mark_waits"]


def mark_waits(model: nn.Module) -> nn.Module:
    """Publish, while ``model``'s forward runs, that it may wait for the other ranks (DDP rebuilds its
    buckets and broadcasts buffers there; FSDP gathers parameters): a rank left waiting for this one
    can tell where it is (see ``_group.meet``). Returns ``model``.

    DDP's forward, any DDP's, is found on the rank's stack by the heartbeat (module hooks would send
    every forward through torch's slower hooked call path); FSDP modules publish through hooks.
    """
    if hasattr(model, "reshard"):
        model.register_forward_pre_hook(_waiting)
        model.register_forward_hook(_done_waiting, always_call=True)
    return model


def _always() -> bool:
    return True


# A rank found in DDP's forward may wait for the others (as ak.backward on a boundary: training._step).
_group.PASSES_THAT_WAIT[nn.parallel.DistributedDataParallel.forward.__code__] = _always


def _waiting(module: nn.Module, args: Any) -> None:
    _state.group.now = _state.group.now._replace(doing=_group.SYNCING)


def _done_waiting(module: nn.Module, args: Any, output: Any) -> None:
    _state.group.now = _state.group.now._replace(doing="")
