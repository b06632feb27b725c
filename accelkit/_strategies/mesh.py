"""A device mesh for ``ak.prepare``: tensor parallelism, then FSDP2 over the data-parallel dimensions.

The mesh's dimensions are torchtitan's: ``dp_replicate`` (HSDP's replicas), ``dp_shard`` (FSDP's
shards), ``tp`` (innermost: neighbouring ranks), of the sizes :mod:`.mesh_sizes` resolved. A
model is laid out as torchtitan does it: the tensor-parallel plan on ``tp`` (torch's
``parallelize_module``), activation checkpointing, then ``fully_shard`` over the data-parallel
dimensions (a 2-D mesh, replicate x shard, is HSDP), the policy's units first. Every parameter
becomes a DTensor: checkpoints go through DCP, which reshards on load, and ``ak.clip_grad_norm_``
reduces each gradient's norm over the dimensions it is sharded on.

The data-parallel group (``process_group("dp")``) is what the loaders shard by: the ranks of a
``tp`` group share their batches. With both ``dp_replicate`` and ``dp_shard`` above 1 beside
``tp``, it is formed once with ``new_subgroups_by_enumeration`` (torch's public way to one group
per set of ranks; Accelerate flattens the mesh with a private DeviceMesh method instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._options import Options
from ..errors import ConfigurationError
from .comm_hooks import refuse_comm_hook
from .fsdp import FSDP, fully_shard_model
from .layout import Layout, apply_plan, check_plan, checkpoint_modules
from .mesh_sizes import MeshSizes

__all__ = ["Mesh", "data_parallel_ranks"]


class Mesh(FSDP):
    """Lays models out on an N-D device mesh (TP, then FSDP2 / HSDP over the data-parallel dimensions)."""

    name = "fsdp"  # a sharded data-parallel job, as ak.strategy() tells; ak.mesh() says how

    def __init__(self, options: Options, device: torch.device, sizes: MeshSizes) -> None:
        super().__init__(options, device, sizes.dp_replicate * sizes.dp_shard * sizes.cp * sizes.tp)
        self.sizes = sizes
        self._dp_group: Any = None  # the data-parallel group when no mesh dimension is it (HSDP x TP)
        self._layouts: dict[int, tuple[Layout, dict[str, nn.Parameter]]] = {}  # id(model) -> until wrapped

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_dp_group"], state["_layouts"] = None, {}  # this process's group, and models being prepared
        return state

    def device_mesh(self) -> Any:
        """The mesh (its dimensions larger than 1, and dp_shard beside dp_replicate), made on first use."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            names, shape = zip(*self.sizes.dims(), strict=True)
            self._mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._mesh

    def process_group(self, name: str) -> Any:
        mesh = self.device_mesh()
        names = mesh.mesh_dim_names or ()
        if name == "dp":
            dp_dims = [n for n in ("dp_replicate", "dp_shard") if n in names and mesh[n].size() > 1]
            if self.sizes.dp == self.world_size:
                return None  # every process sees its own batches
            if len(dp_dims) == 1:
                return mesh.get_group(dp_dims[0])
            return self._flat_dp_group()  # HSDP beside tp; or tp alone: a group of one rank each
        if name in names:
            return mesh.get_group(name)
        raise ValueError(
            f"process group {name!r}: the mesh ({self.sizes.describe()}) has the dimensions "
            f"{', '.join(map(repr, names))} and 'dp' (the data-parallel ranks); a dimension of size 1 has none"
        )

    def _flat_dp_group(self) -> Any:
        if self._dp_group is None:
            import torch.distributed as dist

            groups = data_parallel_ranks(self.sizes)
            self._dp_group, _ = dist.new_subgroups_by_enumeration(groups)  # type: ignore[no-untyped-call]
        return self._dp_group

    def lay_out(self, model: nn.Module, layout: Layout) -> nn.Module:
        check_plan(model, layout.tp_plan)  # applied in wrap_model, where the parameters it replaces are seen
        self._layouts[id(model)] = (layout, dict(model.named_parameters(remove_duplicate=False)))
        return model

    def wrap_model(self, model: nn.Module, model_options: Mapping[str, Any]) -> nn.Module:
        refuse_comm_hook(model_options, self.name)
        layout, before = self._layouts.pop(id(model), (Layout(), dict(model.named_parameters())))
        mesh = self.device_mesh()
        if self.sizes.tp > 1:
            if layout.tp_plan is None:
                raise ConfigurationError(
                    f"accelkit.prepare({type(model).__name__}): tp={self.sizes.tp} splits each layer over "
                    f"{self.sizes.tp} processes, and this model has no plan saying how; pass tp_plan, e.g. "
                    f"ak.prepare(model, tp_plan={{'blocks.*.mlp.up': 'colwise', 'blocks.*.mlp.down': 'rowwise'}}), "
                    f"or use tp=1"
                )
            model = apply_plan(model, layout.tp_plan, mesh["tp"])
        checkpoint_modules(model, layout.activation_checkpointing)
        dp_dims = tuple(n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ()))
        if dp_dims:
            fully_shard_model(model, self.options, self.device, mesh[dp_dims])
        self.remember_shards(model, before)
        return model


def data_parallel_ranks(sizes: MeshSizes) -> list[list[int]]:
    """The ranks of each data-parallel group: those with the same ``cp`` and ``tp`` coordinates, in the
    mesh's row-major order (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``).

    Example:
        >>> data_parallel_ranks(MeshSizes(dp_replicate=2, dp_shard=2, cp=1, tp=2))
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    inner = sizes.cp * sizes.tp
    return [[dp * inner + offset for dp in range(sizes.dp)] for offset in range(inner)]
