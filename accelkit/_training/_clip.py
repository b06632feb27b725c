"""Clipping gradients: by their total norm (across shards and mesh dimensions), or by value."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch

from .. import _state

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients' total norm to ``max_norm``; return the total norm before clipping.

    fp16 gradients are unscaled first, once per step. On accumulation micro-steps the
    gradients are incomplete: nothing is clipped, the current total norm is returned.
    Under FSDP the norm is that of the full gradients, computed across the shards on every
    rank (so every rank must call it), and returned as a plain tensor.

    Args:
        parameters: the parameters whose gradients are clipped (``model.parameters()``), or one tensor.
        max_norm: the largest total norm allowed.
        norm_type: the norm's order; ``float("inf")`` for the largest absolute value.

    Example:
        >>> import accelkit as ak, torch
        >>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 2.0)
        >>> ak.clip_grad_norm_([w], 1.0)
        tensor(4.)
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    training = _state.training
    strategy = training.strategy or _state.strategy()
    if not training.sync_gradients:
        norm = _total_norm(params, norm_type)
        scale = strategy.gradient_scale()
        return norm / scale if scale is not None else norm
    strategy.unscale()
    norm = _total_norm(params, norm_type)
    for same_mesh in _by_mesh(params):  # torch's foreach multiply takes the DTensors of one mesh at a time
        _clip_with_norm(same_mesh, max_norm, norm)
    return norm


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` grouped by their gradients' device mesh (plain tensors together): one group but on a mesh
    whose FSDP x TP parameters sit on the 2-D mesh and the others (tensor parallelism left them) on its dp part."""
    if "torch.distributed.tensor" not in sys.modules:
        return [params]
    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    return list(groups.values())


def _total_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist yet
        return _norm_of(grads, norm_type)
    from torch.distributed.tensor import DTensor

    plain = [g for g in grads if not isinstance(g, DTensor)]
    parts = [_norm_of(plain, norm_type)] if plain else []
    groups: dict[tuple[int, Any], list[DTensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((id(g.device_mesh), g.placements), []).append(g)
    parts.extend(_sharded_norm(group, norm_type) for group in groups.values())
    return _norm_of(parts, norm_type)  # the norm of the parts' norms


def _sharded_norm(grads: list[Any], norm_type: float) -> torch.Tensor:
    """The norm of whole DTensors from their local shards, reduced over the sharded mesh dims.

    By hand rather than through DTensor's norm: that fails for the inf-norm when a rank's
    shard is empty (uneven sharding: a bias of size 1 on 2 ranks), as _foreach_norm has no identity.
    """
    import torch.distributed as dist

    local = [t for t in (g.to_local() for g in grads) if t.numel()]
    norm = _norm_of(local, norm_type) if local else grads[0].to_local().new_zeros(())
    norm = norm.float()
    power = norm if norm_type in (0, math.inf) else norm**norm_type
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    mesh = grads[0].device_mesh
    for dim, placement in enumerate(grads[0].placements):
        # Sharded: Shard, and FSDP x TP's strided shard (not a Shard in recent torch).
        if not (placement.is_replicate() or placement.is_partial()):
            dist.all_reduce(power, op=op, group=mesh.get_group(dim))
    return power if norm_type in (0, math.inf) else power ** (1.0 / norm_type)


# torch's own from 2.6 on (get_total_norm, clip_grads_with_norm_); before, the same computation written here.
_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)
_CLIP_WITH_NORM = getattr(torch.nn.utils, "clip_grads_with_norm_", None)


def _norm_of(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of ``tensors`` seen as one vector (``torch.nn.utils.get_total_norm``)."""
    if _TOTAL_NORM is not None:
        return _TOTAL_NORM(tensors, norm_type)  # type: ignore[no-any-return]
    if not tensors:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    return total


def _clip_with_norm(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``params``' gradients by ``max_norm / norm`` where that is below 1 (``clip_grads_with_norm_``)."""
    if _CLIP_WITH_NORM is not None:
        _CLIP_WITH_NORM(params, max_norm, norm)
        return
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.device))


def clip_grad_value_(parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient to ``[-clip_value, clip_value]`` (fp16 gradients unscaled first).

    Args:
        parameters: the parameters whose gradients are clamped (``model.parameters()``), or one tensor.
        clip_value: the largest absolute value allowed.

    Example:
        >>> import accelkit as ak, torch
        >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.tensor([5.0, -5.0])
        >>> ak.clip_grad_value_([w], 1.0); w.grad
        tensor([ 1., -1.])
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    training = _state.training
    if training.sync_gradients:
        (training.strategy or _state.strategy()).unscale()
    torch.nn.utils.clip_grad_value_(params, clip_value)
