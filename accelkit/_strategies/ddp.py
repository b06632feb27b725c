"""Several processes, each with the whole model: ``DistributedDataParallel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .. import _torch_private
from .comm_hooks import CommHook
from .single import SingleProcess, inner_attribute

__all__ = ["DDP", "PreparedDDP"]


class PreparedDDP(nn.parallel.DistributedDataParallel):
    """``DistributedDataParallel`` whose attributes it does not define are the wrapped module's.

    ``model.config``, ``model.generate(...)``, a custom method: as on the user's module, as they
    are on one process (where the prepared model is the module itself). DDP's own (``module``,
    ``no_sync()``, ``forward``, ``state_dict()`` with its ``module.`` keys) stay DDP's.
    """

    def __getattr__(self, name: str) -> Any:
        return inner_attribute(self, name, "module")  # ``module`` itself (in DDP's every forward) first


class DDP(SingleProcess):
    """Wraps models in ``DistributedDataParallel`` (its options, e.g. ``find_unused_parameters``, pass through),
    with the communication hook ``ak.prepare`` resolved, if any."""

    name = "ddp"
    _mesh: Any = None  # the device mesh, made on first use (every rank must ask)

    def wrap_model(self, model: nn.Module, model_options: Mapping[str, Any]) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        options = dict(model_options)
        hook: CommHook | None = options.pop("comm_hook", None)
        ddp = PreparedDDP(model, device_ids=device_ids, **options)
        if hook is not None:
            hook.register(ddp)
        return ddp

    def device_mesh(self) -> Any:
        """A one-dimensional mesh over every process, ``"dp_replicate"``; made on first use."""
        if self._mesh is None:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (dist.get_world_size(),), mesh_dim_names=("dp_replicate",))
        return self._mesh

    def release(self, model: nn.Module) -> None:
        # DDP's reducer, logger and process_group keep the gloo group (and its threads) alive after it was
        # destroyed; left to the interpreter's teardown, a gloo thread then dies taking the GIL: SIGABRT.
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else _torch_private.compiled_inner(model)
        if isinstance(ddp, nn.parallel.DistributedDataParallel):
            _torch_private.release_ddp(ddp)
