"""Where a rank is while a pass that may wait for the other ranks runs, for the heartbeat (``_group.meet``)."""

from __future__ import annotations

from collections.abc import Iterable
from types import FrameType
from typing import Any

from torch import nn

from .. import _group, _state, _torch_private
from ._precision import MixedPrecisionModule
from ._step import backward

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


_DDP_FORWARD = nn.parallel.DistributedDataParallel.forward.__code__


_DDP_SYNCING = _group.Waiting(_group.DDP_SYNCING, blocked=True)
_MAY_SYNC = _group.Waiting(_group.MAY_SYNC, blocked=False)


def _ddp_forward_waits(inside: list[FrameType]) -> _group.Waiting:
    """In DDP's own code (it broadcasts buffers, rebuilds buckets: every rank takes part), it cannot go on
    without the others; in the wrapped module's forward, it may be computing or waiting for I/O."""
    own = all(frame.f_code.co_filename == _DDP_FORWARD.co_filename for frame in inside)
    return _DDP_SYNCING if own else _MAY_SYNC


_group.PASSES_THAT_WAIT[_DDP_FORWARD] = _ddp_forward_waits


def _waiting(module: nn.Module, args: Any) -> None:
    _state.group.now = _state.group.now._replace(doing=_group.MAY_SYNC)


def _done_waiting(module: nn.Module, args: Any, output: Any) -> None:
    _state.group.now = _state.group.now._replace(doing="")


_SYNCING = _group.Waiting(_group.SYNCING, blocked=True)


def _backward_waits(inside: list[Any]) -> _group.Waiting:
    """Blocked while a backward all-reduces the prepared models' gradients: on an accumulation boundary, outside
    ``ak.no_sync`` (and ``ak.local_sgd``) and a DDP model's own ``no_sync()``; else not waiting."""
    training = _state.training
    models = list(training.models)
    if not (models and training.sync_gradients and not training.unsynced):
        return _group.NOT_WAITING
    wrapped = (_torch_private.compiled_inner(m) or m for m in _inner(models))
    ddps = [m for m in wrapped if isinstance(m, nn.parallel.DistributedDataParallel)]
    return _SYNCING if all(_torch_private.ddp_syncs(m) for m in ddps) else _group.NOT_WAITING


def _inner(models: list[nn.Module]) -> Iterable[nn.Module]:
    return (m.forward_module if isinstance(m, MixedPrecisionModule) else m for m in models)


# A rank found in ak.backward on such a step waits for the others: its heartbeat says so (see _group.meet).
_group.PASSES_THAT_WAIT[backward.__code__] = _backward_waits
