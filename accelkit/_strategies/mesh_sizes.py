"""The device mesh's sizes: resolved from the options and checked, before any worker starts.

Torch-free (the launcher checks a launch with it before starting anything; the workers check
again with what they see). The dimensions, outermost first, are torchtitan's and Accelerate's:
``dp_replicate`` (HSDP's replicas), ``dp_shard`` (FSDP's shards), ``cp``, ``tp``. Ranks that
differ only in ``tp`` are neighbours (the same node, the fastest links).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, NamedTuple

from ..errors import ConfigurationError

__all__ = ["MESH_NAMES", "MESH_OPTIONS", "MeshSizes", "mesh_sizes", "torch_version_refusal"]

MESH_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dimensions, outermost first
MESH_OPTIONS = ("dp_replicate", "dp_shard", "tp", "cp")  # as the options name them
# FSDP2's fully_shard is public from torch 2.6; on the CPU its gradients average over gloo from 2.9.
TORCH_FOR_MESH = "2.6"
TORCH_FOR_MESH_ON_CPU = "2.9"


class MeshSizes(NamedTuple):
    """The size of each dimension (their product: the world size)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @property
    def dp(self) -> int:
        """The data-parallel size: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    def dims(self) -> tuple[tuple[str, int], ...]:
        """The dimensions the torch mesh has: those larger than 1, and ``dp_shard`` beside ``dp_replicate``
        (HSDP's two-dimensional mesh), at least one."""
        hsdp = self.dp_replicate > 1
        kept = [(n, s) for n, s in zip(MESH_NAMES, self, strict=True) if s > 1 or (n == "dp_shard" and hsdp)]
        return tuple(kept) or (("dp_shard", 1),)

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(MESH_NAMES, self, strict=True) if s > 1) or "one process"


def on_mesh(options: Any) -> bool:
    """Whether the options put the model on a device mesh (any mesh size set)."""
    return bool(options.dp_replicate > 1 or options.dp_shard != -1 or options.tp > 1 or options.cp > 1)


def mesh_sizes(options: Any, world_size: int, local_world_size: int | None = None, call: str = "") -> MeshSizes | None:
    """The mesh's sizes for ``options`` (their ``dp_replicate``, ``dp_shard``, ``tp``, ``cp``) on
    ``world_size`` processes (``local_world_size`` per node, when known), None when the options set no mesh.

    Raises ConfigurationError for a layout that cannot run, naming the sizes and the fix.

    Example:
        >>> from accelkit._options import Options
        >>> mesh_sizes(Options(tp=2), 8)
        MeshSizes(dp_replicate=1, dp_shard=4, cp=1, tp=2)
    """
    if not on_mesh(options):
        return None
    said = f"{call}: " if call else ""
    given = f"dp_replicate={options.dp_replicate}, dp_shard={options.dp_shard}, tp={options.tp}, cp={options.cp}"
    if options.strategy == "deepspeed":
        raise ConfigurationError(
            f"{said}{given} with strategy='deepspeed': DeepSpeed forms its own groups; drop the mesh sizes, "
            f"or use strategy='fsdp' (FSDP2 over the mesh's data-parallel dimensions)"
        )
    if options.cp > 1:
        raise ConfigurationError(
            f"{said}cp={options.cp}: context parallelism is not supported. On the CPU torch has none (its ring "
            f"attention runs on CUDA's attention kernels); on CUDA torch offers it only as an experimental API "
            f"(torch.distributed.tensor.experimental.context_parallel, a context around every step given the "
            f"batch's buffers), and FSDP over dp_shard x cp needs a private DeviceMesh method. Use cp=1, and "
            f"split long sequences with tp (SequenceParallel in the tp_plan)"
        )
    rest = options.dp_replicate * options.tp * options.cp
    shard = options.dp_shard
    if shard == -1:
        shard, left = divmod(world_size, rest)
        if left or not shard:
            raise ConfigurationError(
                f"{said}{given}: dp_shard=-1 takes the processes the other sizes leave, but dp_replicate x tp x cp "
                f"= {rest} does not divide the {world_size} processes; choose sizes whose product divides "
                f"{world_size}, or run a multiple of {rest} processes"
            )
    if rest * shard != world_size:
        raise ConfigurationError(
            f"{said}{given}: the product dp_replicate x dp_shard x tp x cp is {rest * shard}, but the job has "
            f"{world_size} processes; make the product {world_size} (dp_shard=-1 takes the rest), or run "
            f"{rest * shard} processes"
        )
    if local_world_size is not None and options.tp > 1 and local_world_size % options.tp:
        raise ConfigurationError(
            f"{said}tp={options.tp} with {local_world_size} process(es) per node: a tensor-parallel group "
            f"exchanges activations in every layer and must sit within one node; use a tp that divides "
            f"{local_world_size} (e.g. tp={_largest_divisor(local_world_size, options.tp)}), and grow the "
            f"data-parallel sizes across nodes"
        )
    return MeshSizes(options.dp_replicate, shard, options.cp, options.tp)


def torch_version_refusal(on_cpu: bool, version: str | None = None) -> str | None:
    """Why this torch cannot run a mesh (on the CPU, or on an accelerator), None when it can."""
    have = version if version is not None else _torch_version()
    need = TORCH_FOR_MESH_ON_CPU if on_cpu else TORCH_FOR_MESH
    if have is None or _release(have) >= _release(need):
        return None
    where = " on the CPU (gloo's reduce-scatter averages gradients correctly from 2.9)" if on_cpu else ""
    return (
        f"a device mesh (FSDP2's fully_shard over it, tensor parallelism on DTensors) needs PyTorch >= {need}"
        f"{where}; this is PyTorch {have}. Upgrade PyTorch, or drop the mesh sizes (dp_replicate, dp_shard, tp)"
    )


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if not piece.isdigit() else piece
        parts.append(int(digits or 0))
        if not piece.isdigit():
            break
    return tuple(parts)


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, min(n, below) + 1) if n % d == 0)
