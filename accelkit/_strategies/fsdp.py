"""FSDP2 for ``ak.prepare``: which submodules become shard units, ``fully_shard``, and the optimizer.

``torch.distributed.fsdp`` is imported only when a model is really sharded: ``import
accelkit`` and DDP runs never load it.

How the configured precision combines with sharding: with ``"bf16"`` or ``"fp16"`` the
units get ``MixedPrecisionPolicy(param_dtype=<that dtype>, reduce_dtype=float32)``, so
parameters are all-gathered and computed in half precision (half the traffic and the
unsharded memory) while gradients are reduced, and the sharded parameters the optimizer
updates are kept, in fp32. The prepared forward still runs under ``ak.precision``'s
autocast as well, which keeps the ops autocast runs in fp32 (softmax, norms, losses) in
fp32, and returns fp32 outputs, exactly as under DDP.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigurationError, StateError

if TYPE_CHECKING:
    from .._state import ProcessState

__all__ = ["grad_scaler", "is_fsdp_module", "no_gradient_sync", "repoint_optimizer", "select_units", "shard"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def select_units(model: nn.Module, wrap: tuple[str, ...] = (), min_params: int = 0) -> list[nn.Module]:
    """The submodules that become their own FSDP unit, children before parents (the root excluded).

    A submodule is a unit when its class ``__name__`` is in ``wrap``, or, with ``min_params > 0``,
    when its subtree holds at least ``min_params`` parameters not already in a unit below it
    (bottom-up, like a size-based auto-wrap policy). Modules without parameters never are.

    Example:
        >>> net = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 1))
        >>> [type(m).__name__ for m in select_units(net, min_params=1000)]
        ['Linear']
    """
    classes = {type(m).__name__ for m in model.modules()}
    for name in wrap:
        if name not in classes:
            close = difflib.get_close_matches(name, sorted(classes), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigurationError(
                f"fsdp_wrap names {name!r}, but {type(model).__name__} has no submodule of that class; {hint}"
                f"name classes of this model (match is by class __name__): {', '.join(sorted(classes))}"
            )
    units: list[nn.Module] = []
    claimed: set[int] = set()  # ids of parameters already in a unit

    def visit(module: nn.Module, is_root: bool) -> None:
        for child in module.children():
            visit(child, False)
        free = [p for p in module.parameters() if id(p) not in claimed]
        if is_root or not free:
            return
        by_size = min_params > 0 and sum(p.numel() for p in free) >= min_params
        if type(module).__name__ in wrap or by_size:
            units.append(module)
            claimed.update(id(p) for p in free)

    visit(model, True)
    return units


def shard(model: nn.Module, st: ProcessState) -> nn.Module:
    """Apply ``fully_shard`` to the policy's units, then to ``model`` (in place); returns ``model``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):  # the user sharded it already
        return model
    opts = st.options
    units = [u for u in select_units(model, opts.fsdp_wrap, opts.fsdp_min_params) if not isinstance(u, FSDPModule)]
    dtype = _DTYPES.get(opts.precision)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    # Pinned host memory needs an accelerator; on a CPU device the offload is a plain copy.
    offload = CPUOffloadPolicy(pin_memory=st.device.type != "cpu") if opts.fsdp_cpu_offload else OffloadPolicy()
    mesh = init_device_mesh(st.device.type, (st.world_size,))
    before = dict(model.named_parameters(remove_duplicate=False))
    for module in [*units, model]:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=opts.fsdp_reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    # An optimizer built before prepare holds the old parameters: leave each a pointer to its
    # shard, which repoint_optimizer follows when that optimizer is prepared.
    for name, new in model.named_parameters(remove_duplicate=False):
        old = before.get(name)
        if old is not None and old is not new:
            old._accelkit_sharded_as = new  # type: ignore[attr-defined]
    return model


def repoint_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point ``optimizer``'s param groups at the shards of parameters that ``shard`` replaced.

    Hyper-parameters and the group structure stay; an optimizer that already has state
    (it stepped, or loaded a checkpoint) cannot follow its parameters into shards.
    """
    stale = [p for group in optimizer.param_groups for p in group["params"] if hasattr(p, "_accelkit_sharded_as")]
    if not stale:
        return
    if optimizer.state:
        raise StateError(
            f"{type(optimizer).__name__} already has state for {len(optimizer.state)} parameter(s), and FSDP "
            f"replaced its parameters with shards, to which that state does not fit. Prepare the model and the "
            f"optimizer before the first step, and restore optimizer state after ak.prepare (ak.load_state)."
        )
    for group in optimizer.param_groups:
        group["params"] = [getattr(p, "_accelkit_sharded_as", p) for p in group["params"]]


def is_fsdp_module(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module (without importing FSDP to ask)."""
    return callable(getattr(model, "set_requires_gradient_sync", None))


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: gradients accumulate unreduced until the outermost region ends."""
    depth: int = getattr(model, "_accelkit_no_sync_depth", 0)
    model._accelkit_no_sync_depth = depth + 1  # type: ignore[assignment]
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model._accelkit_no_sync_depth = depth  # type: ignore[assignment]
        if depth == 0:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]


def grad_scaler(device_type: str) -> Any:
    """The fp16 grad scaler for sharded gradients: it agrees on overflow across ranks."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)
