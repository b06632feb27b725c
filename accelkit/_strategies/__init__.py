"""Parallelism strategies: how ``ak.prepare`` wraps a model, and how a training step runs under it.

One small protocol, one module per strategy (single process, DDP, FSDP2, DeepSpeed), chosen
once when the process state is built (:func:`select_strategy`, from ``options.strategy`` and
the world size). Training, ``ak.prepare`` and checkpoints ask ``ak.state().strategy``; they
never branch on the strategy's name. What a strategy learns about the user's objects (which
parameters became shards, a model's no-sync depth, the DeepSpeed engine) it keeps itself,
in weak maps, instead of stamping attributes on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigurationError
from ._protocol import LAYOUT_OPTIONS, Setup, Skipped, Strategy
from .mesh_sizes import MESH_NAMES, MeshSizes, mesh_sizes, on_mesh, torch_version_refusal

if TYPE_CHECKING:
    import torch

    from .._options import Options

__all__ = [
    "LAYOUT_OPTIONS",
    "MESH_NAMES",
    "MeshSizes",
    "Setup",
    "Skipped",
    "Strategy",
    "check_layout",
    "mesh_sizes",
    "on_mesh",
    "select_strategy",
    "torch_version_refusal",
]


def check_layout(
    options: Options, world_size: int, local_world_size: int | None, device: torch.device, call: str = ""
) -> MeshSizes | None:
    """The mesh's sizes (None: no mesh), refusing a layout or a torch that cannot run it; before the group forms."""
    sizes = mesh_sizes(options, world_size, local_world_size, call)
    if sizes is not None and world_size > 1:
        import torch

        refusal = torch_version_refusal(device.type == "cpu", torch.__version__)
        if refusal:
            raise ConfigurationError(f"{call}: {refusal}" if call else refusal)
    return sizes


def select_strategy(
    options: Options, world_size: int, device: torch.device, local_world_size: int | None = None
) -> Strategy:
    """The strategy for these options: DeepSpeed when asked for; one process: no wrapping; a device mesh
    when its sizes are set; else DDP or FSDP2."""
    sizes = check_layout(options, world_size, local_world_size, device)
    if sizes is not None and world_size > 1:
        from .mesh import Mesh

        return Mesh(options, device, sizes)
    if options.strategy == "deepspeed":
        from .deepspeed import DeepSpeed

        return DeepSpeed(options, device, world_size)
    if world_size == 1:
        from .single import SingleProcess

        return SingleProcess(options, device)
    if options.strategy == "fsdp":
        from .fsdp import FSDP

        return FSDP(options, device, world_size)
    from .ddp import DDP

    return DDP(options, device)
