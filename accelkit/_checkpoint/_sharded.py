"""Sharded (DTensor) state in checkpoints, through ``torch.distributed.checkpoint`` (DCP): saving.

An object is sharded when its state holds DTensors: a module ``fully_shard``-ed (by hand or
by ``ak.prepare``), or an optimizer over such a module's parameters. Each rank saves its own
shards with ``dcp.save`` into ``NAME.dcp/`` among the save's files (``_storage.Staging``: a
temporary directory, or a folder on an object store), through a ``FileSystem`` of ours that
checksums every file while writing (:class:`_StagingFileSystem`), so that the commit protocol of
``ak.save_state`` covers them as any other file. Loading is ``_sharded_load``'s.

``torch.distributed.checkpoint`` is imported here, inside functions: ``import accelkit``
does not pay for it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

import torch
from torch import nn

from .. import _torch_private
from .._training import PreparedOptimizer
from ..errors import CheckpointError
from . import _files, _integrity, _rank_state
from ._storage import Staging

__all__ = [
    "check_listed",
    "dcp_failure",
    "first_line",
    "optimizer_owner",
    "relative_filesystem",
    "save",
    "single_process_is_meant",
    "state_dict",
    "torch_optimizer",
]


def torch_optimizer(obj: Any) -> Any:
    return obj.optimizer if isinstance(obj, PreparedOptimizer) else obj


def optimizer_owner(call: str, name: str, optimizer: Any, modules: dict[str, nn.Module]) -> nn.Module:
    """The module among ``modules`` whose parameters ``optimizer`` updates (DCP keys its state by their names)."""
    params = {id(p) for group in torch_optimizer(optimizer).param_groups for p in group["params"]}
    for module in modules.values():
        if params <= {id(p) for p in module.parameters()}:
            return module
    passed = f"none of the modules passed ({', '.join(modules)}) holds all of them" if modules else ""
    passed = passed or "no module was passed"
    raise ValueError(
        f"{call}: {name}={type(optimizer).__qualname__} updates sharded (DTensor) parameters, but {passed}; "
        f"pass the model it optimizes too, e.g. model=model, {name}={name}"
    )


def state_dict(obj: Any, owner: nn.Module | None) -> dict[str, Any]:
    """This rank's shards of ``obj``'s state, keyed by parameter names (what ``dcp.save`` writes)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(obj, nn.Module):
        return get_model_state_dict(obj)
    optimizer = torch_optimizer(obj)
    if owner is None:
        raise TypeError(f"{type(obj).__qualname__} is sharded: pass the module it optimizes (optimizer_owner)")
    fresh = not optimizer.state
    state = get_optimizer_state_dict(owner, optimizer)
    if fresh:  # torch initialised the state with a zero-lr step to save it; leave the optimizer as it was
        optimizer.state.clear()
    return state


# --- saving -----------------------------------------------------------------------------------


@functools.cache
def relative_filesystem() -> type:
    """DCP's local ``FileSystem`` with paths relative to a checkpoint's files (``model.dcp/__0_0.distcp``): the base
    of the ones that write a save's files and read a load's snapshot."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _RelativeFileSystem(FileSystem):
        def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> PurePosixPath:
            return PurePosixPath(path)

        def concat_path(self, path: str | os.PathLike[str], suffix: str) -> PurePosixPath:
            return PurePosixPath(path) / suffix

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return False

    return _RelativeFileSystem


@functools.cache
def _filesystem_type() -> type:
    class _StagingFileSystem(relative_filesystem()):  # type: ignore[misc]
        """DCP's file work in a save's files (``_storage.Staging``): each file checksummed while written, finished
        (fsynced, uploaded) with the others; names are relative to them."""

        def __init__(self, staging: Staging) -> None:
            super().__init__()
            self.staging = staging
            self.records: dict[str, _integrity.FileRecord] = {}

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                raise PermissionError(f"{path}: a checkpoint's files are written, not read, while it is saved")
            with self.staging.create(str(path)) as writer:
                yield writer
            self.records[str(path)] = writer.record()

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            self.staging.rename(str(path), str(new_path))  # DCP writes .metadata.tmp, then renames it
            record = self.records.pop(str(path), None)
            if record is not None:
                self.records[str(new_path)] = record

        def mkdir(self, path: str | os.PathLike[str]) -> None:
            self.staging.mkdir(str(path))

        def exists(self, path: str | os.PathLike[str]) -> bool:
            return self.staging.exists(str(path))

        def rm_file(self, path: str | os.PathLike[str]) -> None:
            self.staging.remove(str(path))
            self.records.pop(str(path), None)

    return _StagingFileSystem


def save(
    staging: Staging, folder: str, state: dict[str, Any], distributed: bool, group: Any = None
) -> dict[str, _integrity.FileRecord]:
    """Write this rank's shards of ``state`` into ``folder`` of ``staging`` with ``dcp.save``; every rank must call it.

    Returns ``{"FOLDER/FILE": record}`` for the files this rank wrote (rank 0 also ``.metadata``).
    DCP shares every rank's failure: it raises on all ranks, or on none. ``group``: the process
    group DCP plans over (None: the default one; a background save passes its own). The staging
    finishes the files (fsync, upload) with the save's others. DCP writes each tensor with
    ``torch.save``; its record CRC-32 is off, since every byte is checksummed for the manifest.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if distributed and _rank_state.numpy_missing():  # every rank says so, before DCP's first collective
        raise CheckpointError(
            "a sharded object is saved by torch.distributed.checkpoint, whose plan travels through torch's object "
            "collectives, and those need numpy (Tensor.numpy()), which cannot be imported here: pip install numpy"
        )
    options: dict[str, Any] = (
        {"overwrite": False} if "overwrite" in inspect.signature(FileSystemWriter).parameters else {}
    )
    writer = FileSystemWriter(folder, sync_files=False, thread_count=1, **options)  # the staging finishes files
    fs = _filesystem_type()(staging)
    _torch_private.use_filesystem(writer, fs, PurePosixPath(folder))
    try:
        with single_process_is_meant(), _files.no_zip_crc():
            dcp_save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(dcp_failure(exc)) from exc
    staging.finish_folder(folder)
    return dict(fs.records)


def check_listed(staging: Staging, folder: str, files: dict[str, _integrity.FileRecord]) -> None:
    """Main process, before the commit: every file in ``folder`` was checksummed (is in ``files``)."""
    unlisted = sorted(name for name in staging.listdir(folder) if f"{folder}/{name}" not in files)
    if unlisted:  # DCP wrote it some other way than through the hashing filesystem: it would be refused on load
        raise CheckpointError(
            f"{staging.where}/{folder}/{unlisted[0]} was written without a checksum (torch {torch.__version__}'s DCP "
            f"writer changed?); save it with ak.save_state(..., full_state=True) instead"
        )


@contextlib.contextmanager
def single_process_is_meant() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns that it assumes one process: accelkit asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def dcp_failure(exc: BaseException, local: bool = False) -> str:
    """DCP's failure, each failed rank's error without its traceback; ``local``: this rank's alone (DCP ran
    without collectives, and numbers this rank 0)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures and local:
        return "; ".join(first_line(failure[0]) for _, failure in sorted(failures.items()))
    if isinstance(failures, dict) and failures:  # DCP's CheckpointException: {rank: (exception, traceback)}
        parts = [f"rank {rank}: {first_line(failure[0])}" for rank, failure in sorted(failures.items())]
        return "torch.distributed.checkpoint failed on " + "; ".join(parts)
    return first_line(exc)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
