"""Every private or undocumented torch name accelkit uses, in one place.

Each is here because torch offers no public way to the same end. Each was checked on the
torch versions in :data:`CHECKED`; on a torch outside them, the scaler's names give way to
their public, slower equivalents, and the others (no public equivalent) are looked up with
a clear error if torch removed them. ``tests/test_private_torch.py`` holds this list: a
private torch name anywhere else in accelkit fails it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.torch_version import TorchVersion

# The torch versions each name below was checked on (the tested range: the smoke set runs on each).
CHECKED = ("2.4.1", "2.13.0", "2.14.1")
# Within the checked range (patch releases of the newest included): the scaler's private names are used.
SCALER = TorchVersion(CHECKED[0]) <= TorchVersion(torch.__version__.split("+")[0]) < TorchVersion("2.15")

# name -> why accelkit uses it (the test checks this list against the code); each was checked on CHECKED.
NAMES = {
    "GradScaler._get_scale_async": "fp16: the loss scale as a device tensor; get_scale() reads it to the host "
    "(a sync per step)",
    "GradScaler._found_inf_per_device": "fp16 with a fused optimizer: whether its step was skipped, as a device "
    "flag, without a sync",
    "Optimizer._step_supports_amp_scaling": "fp16: fused optimizers skip on the device, so GradScaler always calls "
    "their step()",
    "OptimizedModule._orig_mod": "unwrapping a torch.compile'd model (ak.unwrap, DDP under compile); no public "
    "accessor",
    "torch._dynamo.eval_frame.OptimizedModule": "recognising a torch.compile'd model, only once dynamo is imported",
    "distributed_c10d._get_default_store": "find_executable_batch_size's agreement over a group the user formed "
    "(accelkit did not make its store; a group accelkit formed uses the store it formed it on)",
    "DistributedDataParallel.reducer/logger/process_group": "dropped when a prepared model is released: left to "
    "interpreter exit they keep a destroyed gloo group's threads alive (SIGABRT)",
    "DistributedDataParallel.require_backward_grad_sync": "read, never written: whether a prepared DDP model's "
    "backward all-reduces now (its own no_sync() turns it off), for the heartbeat's proof that a rank waits for "
    "every other; DDP has no public getter",
    "torch.distributed.nn.functional's __defaults__": "rewritten, group.WORLD -> None, when accelkit destroys a "
    "group: its functions' defaults hold the group that existed when it was imported (DDP imports it), which "
    "keeps that group's gloo connections open after it is destroyed; no public way to drop them",
    "powerSGD_hook._orthogonalize": "probing whether torch's batched PowerSGD hook can run (it fails in backward "
    "on torch versions whose helper wants a batch)",
    "_get_layout of torch's serialization module": "named, not used: a pickled layout (in DCP metadata) is a call "
    "of it, which the metadata unpickler answers with layout_named, from torch's public layouts",
    "torch.distributed.checkpoint.filesystem._StorageInfo": "a class DCP metadata holds: the metadata unpickler "
    "builds it (no public equivalent)",
    "_StorageInfo.relative_path/offset/length/transform_descriptors": "where each item of a sharded checkpoint "
    "lies (storage_item): its non-tensor items are unpickled safely before the load, and the ranges a load reads "
    "from an object store are verified before it; transform_descriptors is absent before torch 2.6",
    "FileSystemWriter.fs/.path, FileSystemReader.fs/.path": "DCP does its file work through them "
    "(use_filesystem): accelkit's FileSystem writes into a save's files (checksummed, local or an object store) "
    "and reads a load's verified snapshot; no public argument takes a FileSystem (DCP's own FsspecWriter and "
    "FsspecReader set them the same way, in a private module)",
}

# How torch pickles a layout (torch.strided, ...): a call of this function by its module and name, with the
# layout's name. Recognised when unpickling DCP metadata and answered by layout_named, not by torch's function.
PICKLED_LAYOUT = ("torch.serialization", "_get_layout")
# The private classes DCP's metadata holds: the metadata unpickler builds them.
DCP_METADATA_CLASSES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


def layout_named(name: str) -> torch.layout:
    """The layout a pickle names (``"torch.strided"``), from torch's public layouts; ValueError for anything else."""
    found = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
    if not isinstance(found, torch.layout):
        raise ValueError(f"{name!r} is not a torch layout")
    return found


def storage_item(metadata: Any, index: Any) -> tuple[str, int, int, tuple[Any, ...]]:
    """Where the item ``index`` of DCP's ``metadata`` lies: (file, offset, length, the transforms it was stored by)."""
    info = metadata.storage_data[index]
    transforms = tuple(getattr(info, "transform_descriptors", None) or ())  # a field from torch 2.6 on
    return str(info.relative_path), int(info.offset), int(info.length), transforms


def use_filesystem(io: Any, fs: Any, path: Any) -> None:
    """Make DCP's ``FileSystemWriter`` or ``FileSystemReader`` ``io`` do its file work through ``fs`` in ``path``."""
    io.fs, io.path = fs, path


def _missing(name: str) -> RuntimeError:
    return RuntimeError(
        f"accelkit needs torch's {name}, which torch {torch.__version__} no longer has (accelkit was checked on "
        f"torch {', '.join(CHECKED)}): install one of those, or a newer accelkit"
    )


def scale_on_device(scaler: Any) -> torch.Tensor | None:
    """The scaler's scale as a tensor where it is, without a sync; None where only the public way is left."""
    get = getattr(scaler, "_get_scale_async", None) if SCALER else None
    return get() if get is not None else None


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether ``optimizer`` skips an overflowing step itself (fused); None where only the public way is left."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) if SCALER else None


def found_inf_flags(scaler: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The overflow flags the scaler stepped ``optimizer`` with, one per device (read before ``update()``)."""
    return list(scaler._found_inf_per_device(optimizer).values())


def compiled_inner(model: Any) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper runs; None for any other object."""
    inner = getattr(model, "_orig_mod", None) if isinstance(model, nn.Module) else None
    return inner if isinstance(inner, nn.Module) else None


def compiled_type() -> type | None:
    """torch.compile's wrapper class, where dynamo was imported (importing it is slow); else None."""
    module = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(module, "OptimizedModule", None) if module is not None else None


def default_store() -> Any:
    """The store of the default process group."""
    from torch.distributed import distributed_c10d

    get = getattr(distributed_c10d, "_get_default_store", None)
    if get is None:
        raise _missing("torch.distributed.distributed_c10d._get_default_store")
    return get()


def release_ddp(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Drop the references a DDP model keeps to its process group (its reducer, logger and group)."""
    for name in ("reducer", "logger", "process_group"):
        if name in vars(ddp):
            setattr(ddp, name, None)


def ddp_syncs(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp``'s next backward all-reduces its gradients (False inside its ``no_sync()``)."""
    return bool(getattr(ddp, "require_backward_grad_sync", False))  # not known: no proof


def unpin_from_defaults(group: Any) -> None:
    """Free ``group`` from torch.distributed.nn.functional's defaults (``def all_reduce(tensor, op=...,
    group=group.WORLD)``): ``None`` means the default group to torch.distributed, as the defaults intend."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for function in vars(module).values() if module is not None else ():
        defaults = getattr(function, "__defaults__", None)
        if isinstance(defaults, tuple) and any(d is group for d in defaults):
            function.__defaults__ = tuple(None if d is group else d for d in defaults)


def batched_power_sgd_runs() -> bool:
    """Whether torch's batched PowerSGD hook can compress: its helper orthogonalises one 2-D matrix,
    which some versions' helper refuses (it wants a batch). Probed, so a fixed torch passes by itself."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    probe = getattr(powerSGD_hook, "_orthogonalize", None)
    if probe is None:
        raise _missing("powerSGD_hook._orthogonalize")
    try:
        probe(torch.ones(2, 1))
    except AssertionError:
        return False
    return True
