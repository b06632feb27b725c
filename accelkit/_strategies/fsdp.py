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

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .._options import Options, suggest
from ..errors import ConfigurationError, StateError
from .comm_hooks import refuse_comm_hook
from .single import PRECISION_DTYPES, SingleProcess

__all__ = ["FSDP", "fully_shard_model", "refuse_old_torch", "select_units"]


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
            hint = suggest(name, sorted(classes))[2:]
            hint = f"{hint} " if hint else ""
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


class FSDP(SingleProcess):
    """Shards models in place with FSDP2's ``fully_shard`` (units from the policy, then the root)."""

    name = "fsdp"

    def __init__(self, options: Options, device: torch.device, world_size: int) -> None:
        super().__init__(options, device)
        self.world_size = world_size
        # parameter -> its shard, for optimizers built before prepare (see fit_optimizer)
        self._shard_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._mesh: Any = None  # the device mesh, made on first use (every rank must ask)

    def wrap_model(self, model: nn.Module, model_options: Mapping[str, Any]) -> nn.Module:
        refuse_comm_hook(model_options, self.name)
        refuse_old_torch(torch.__version__, self.device)
        before = dict(model.named_parameters(remove_duplicate=False))
        fully_shard_model(model, self.options, self.device, self.device_mesh())
        self.remember_shards(model, before)
        return model

    def remember_shards(self, model: nn.Module, before: dict[str, nn.Parameter]) -> None:
        """An optimizer built before prepare holds the old parameters: remember each one's shard."""
        for name, new in model.named_parameters(remove_duplicate=False):
            old = before.get(name)
            if old is not None and old is not new:
                self._shard_of[old] = new

    def device_mesh(self) -> Any:
        """A one-dimensional mesh over every process, ``"dp_shard"``; made on first use."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp_shard",))
        return self._mesh

    def fit_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer``'s param groups at the shards of the parameters it was built with.

        Hyper-parameters and the group structure stay; an optimizer that already has state
        (it stepped, or loaded a checkpoint) cannot follow its parameters into shards.
        """
        stale = [p for group in optimizer.param_groups for p in group["params"] if p in self._shard_of]
        if stale and optimizer.state:
            raise StateError(
                f"{type(optimizer).__name__} already has state for {len(optimizer.state)} parameter(s), and FSDP "
                f"replaced its parameters with shards, to which that state does not fit. Prepare the model and the "
                f"optimizer before the first step, and restore optimizer state after ak.prepare (ak.load_state)."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._shard_of.get(p, p) for p in group["params"]]  # type: ignore[no-untyped-call]
        super().fit_optimizer(optimizer)

    def new_scaler(self) -> Any:
        """The fp16 grad scaler for sharded gradients: it agrees on overflow across ranks."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device.type)


def refuse_old_torch(version: str, device: torch.device) -> None:
    """FSDP2 needs torch 2.6 (``fully_shard`` public), and 2.9 on the CPU: gloo's averaging reduce-scatter
    sums without dividing before (checked: 2.7.1 and 2.8.0; pytorch#162338), which would train silently
    with gradients world-size times too large; 2.6 lacks a CPU stream event FSDP2 records."""
    from torch.torch_version import TorchVersion

    have = TorchVersion(version.split("+")[0])
    need = "2.9" if device.type == "cpu" else "2.6"
    if have < TorchVersion(need):
        where = " on the CPU (gloo's reduce-scatter averages correctly from 2.9)" if device.type == "cpu" else ""
        raise ConfigurationError(
            f"accelkit.prepare(strategy='fsdp') needs PyTorch >= {need}{where}; this is PyTorch {version}. "
            f"Upgrade PyTorch, or use strategy='ddp'"
        )


def fully_shard_model(model: nn.Module, options: Options, device: torch.device, mesh: Any) -> nn.Module:
    """Apply ``fully_shard`` over ``mesh`` (1-D: FSDP; 2-D, replicate x shard: HSDP) to the policy's units,
    then to ``model`` (in place); returns ``model``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):  # the user sharded it already
        return model
    units = select_units(model, options.fsdp_wrap, options.fsdp_min_params)
    units = [u for u in units if not isinstance(u, FSDPModule)]
    dtype = PRECISION_DTYPES.get(options.precision)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    # Pinned host memory needs an accelerator; on a CPU device the offload is a plain copy.
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if options.fsdp_cpu_offload else OffloadPolicy()
    for module in [*units, model]:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=options.fsdp_reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    return model
