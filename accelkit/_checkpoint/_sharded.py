"""Sharded (DTensor) state in checkpoints, through ``torch.distributed.checkpoint`` (DCP).

An object is sharded when its state holds DTensors: a module ``fully_shard``-ed (by hand or
by ``ak.prepare``), or an optimizer over such a module's parameters. Each rank saves its own
shards with ``dcp.save`` into ``NAME.dcp/`` inside the checkpoint's temporary directory,
checksumming every file while writing (:class:`_HashingFileSystem`), so that the commit
protocol of ``ak.save_state`` covers them as any other file. Loading reads ``.metadata``
with a restricted unpickler, runs DCP's planning and unpickles every non-tensor item with
``torch.load(weights_only=True)`` first (:func:`load`); once every file is verified, the
function it returns reads the shards into the live tensors with ``dcp.load``, through a
``FileSystemReader`` of ours that reads the checkpoint's snapshot (the files that were verified)
and hands DCP the metadata read before, and a load planner of ours that refuses non-tensor items
needing code to unpickle. DCP reshards on load: a checkpoint saved by N processes loads on M, sharded or not.

``torch.distributed.checkpoint`` is imported here, inside functions: ``import accelkit``
does not pay for it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .. import _safe_io, _torch_private
from .._training import PreparedOptimizer
from ..errors import CheckpointError
from . import _files, _rank_state
from ._snapshot import METADATA
from ._snapshot import Snapshot as _Snapshot

__all__ = [
    "METADATA",
    "SUFFIX",
    "check_listed",
    "load",
    "optimizer_owner",
    "read_metadata",
    "referenced_files",
    "save",
    "state_dict",
    "torch_optimizer",
]

SUFFIX = ".dcp"


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
def _filesystem_type() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _HashingFileSystem(FileSystem):
        """DCP's local filesystem, writing through :func:`accelkit._safe_io.open_hashed` (checksummed, fsynced)."""

        def __init__(self, flusher: _safe_io.Flusher | None = None) -> None:
            super().__init__()
            self.records: dict[str, _safe_io.FileRecord] = {}
            self.flusher = flusher

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "r" in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with _safe_io.open_hashed(Path(path), flusher=self.flusher) as writer:
                yield writer
            self.records[Path(path).name] = writer.record()

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                self.records[Path(new_path).name] = record

    return _HashingFileSystem


def save(
    folder: Path, state: dict[str, Any], distributed: bool, group: Any = None, flusher: _safe_io.Flusher | None = None
) -> dict[str, _safe_io.FileRecord]:
    """Write this rank's shards of ``state`` into ``folder`` with ``dcp.save``; every rank must call it.

    Returns ``{"FOLDER/FILE": record}`` for the files this rank wrote (rank 0 also ``.metadata``).
    DCP shares every rank's failure: it raises on all ranks, or on none. ``group``: the process
    group DCP plans over (None: the default one; a background save passes its own). ``flusher``
    fsyncs the files (else each is fsynced as it is closed). DCP writes each tensor with
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
    writer = FileSystemWriter(folder, sync_files=False, thread_count=1, overwrite=False)  # open_hashed fsyncs
    fs = writer.fs = _filesystem_type()(flusher)
    try:
        with _single_process_is_meant(), _files.no_zip_crc():
            dcp_save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(_dcp_failure(exc)) from exc
    _safe_io.fsync_dir(folder, flusher)
    return {f"{folder.name}/{name}": record for name, record in fs.records.items()}


def check_listed(folder: Path, files: dict[str, _safe_io.FileRecord]) -> None:
    """Main process, before the commit: every file in ``folder`` was checksummed (is in ``files``)."""
    unlisted = sorted(p.name for p in folder.iterdir() if f"{folder.name}/{p.name}" not in files)
    if unlisted:  # DCP wrote it some other way than through the hashing filesystem: it would be refused on load
        raise CheckpointError(
            f"{folder / unlisted[0]} was written without a checksum (torch {torch.__version__}'s DCP writer changed?); "
            f"save it with ak.save_state(..., full_state=True) instead"
        )


@contextlib.contextmanager
def _single_process_is_meant() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns that it assumes one process: accelkit asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _dcp_failure(exc: BaseException, local: bool = False) -> str:
    """DCP's failure, each failed rank's error without its traceback; ``local``: this rank's alone (DCP ran
    without collectives, and numbers this rank 0)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures and local:
        return "; ".join(_first_line(failure[0]) for _, failure in sorted(failures.items()))
    if isinstance(failures, dict) and failures:  # DCP's CheckpointException: {rank: (exception, traceback)}
        parts = [f"rank {rank}: {_first_line(failure[0])}" for rank, failure in sorted(failures.items())]
        return "torch.distributed.checkpoint failed on " + "; ".join(parts)
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# --- loading ----------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: its own classes and a few torch/pathlib values."""

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        *_torch_private.DCP_METADATA_CLASSES,
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as metadata

            found = getattr(metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:  # its classes, not what it imports
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) == _torch_private.PICKLED_LAYOUT:
            return _torch_private.layout_named
        elif (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(snapshot: _Snapshot, name: str) -> Any:
    """DCP's ``Metadata`` from the file ``name`` of ``snapshot``, unpickled without running code; CheckpointError
    if refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = snapshot.path / name
    try:
        found = _MetadataUnpickler(io.BytesIO(snapshot.read_bytes(name))).load()
    except Exception as exc:
        raise CheckpointError(f"{path} was refused: {_first_line(exc)}") from None
    if not isinstance(found, Metadata):
        raise CheckpointError(f"{path} was refused: it holds a {type(found).__qualname__}, not DCP metadata")
    return found


def referenced_files(metadata: Any) -> set[str]:
    """The file names (relative to its folder) that ``metadata`` reads data from."""
    return {str(info.relative_path) for info in (metadata.storage_data or {}).values()}


@functools.cache
def _planner_type() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafePlanner(DefaultLoadPlanner):
        """DCP's default load planner that plans once and refuses non-tensor items needing code to unpickle.

        :func:`_plan` plans (and checks) before anything is applied; ``dcp.load`` then sets the planner
        up again over the same live tensors and gets the same plan back, not made a second time.
        """

        def __init__(self) -> None:
            super().__init__()
            self.checked: set[bytes] = set()  # items already unpickled as weights_only (by _plan)
            self.plan: Any = None

        def create_local_plan(self) -> Any:
            if self.plan is None:
                self.plan = super().create_local_plan()
            return self.plan

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP unpickles non-tensor items without restriction: check that they need no code first.
            if value.getvalue() not in self.checked:
                torch.load(value, weights_only=True)
                value.seek(0)
            super().load_bytes(read_item, value)

    return _SafePlanner


@functools.cache
def _local(dcp_load: Callable[..., Any]) -> dict[str, bool]:
    """``dcp.load``'s argument for a load without collectives (``no_dist``; torch 2.4 has none, and uses the
    group: every rank loads the same objects in the same order, so they meet there)."""
    import inspect

    return {"no_dist": True} if "no_dist" in inspect.signature(dcp_load).parameters else {}


@functools.cache
def _reader_type() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

    class _SnapshotFileSystem(FileSystem):
        """Opens a checkpoint's files as its snapshot holds them (the verified ones), never by their path now."""

        def __init__(self, snapshot: _Snapshot) -> None:
            super().__init__()
            self.snapshot = snapshot

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "r" not in mode or "+" in mode:
                raise PermissionError(f"{path}: a checkpoint is read, not written, when it is loaded")
            name = Path(path).relative_to(self.snapshot.path).as_posix()
            with open(self.snapshot.opener(name), "rb") as stream:
                yield stream
            self.snapshot.check_same(name)

    class _SnapshotReader(FileSystemReader):
        """DCP's reader of a checkpoint's folder, over its snapshot, with the metadata read (restricted) before."""

        def __init__(self, snapshot: _Snapshot, folder: str, metadata: Any) -> None:
            super().__init__(snapshot.path / folder)
            self.fs = _SnapshotFileSystem(snapshot)
            self.metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.metadata

    return _SnapshotReader


def _plan(snapshot: _Snapshot, folder: str, state: dict[str, Any], metadata: Any) -> Any:
    """DCP's planner for loading ``state`` from ``folder``, its plan checked; what DCP would refuse, raised now.

    DCP's own planning (keys, sizes) runs here, and every non-tensor item it would read is
    unpickled as ``torch.load(weights_only=True)`` does, so that the load that follows meets
    nothing it refuses once it has begun. The planner keeps those items' bytes: the same bytes
    read again need no second check.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    planner = _planner_type()()
    planner.set_up_planner(state, metadata, False)
    plan = planner.create_local_plan()
    for item in plan.items:
        if item.type != LoadItemType.BYTE_IO:
            continue
        info = metadata.storage_data[item.storage_index]
        where = f"the item {item.storage_index.fqn} in {info.relative_path}"
        if info.transform_descriptors:  # accelkit writes none
            raise ValueError(f"{where} is stored transformed ({info.transform_descriptors}): accelkit refuses it")
        data = os.pread(snapshot.fd(f"{folder}/{info.relative_path}"), info.length, info.offset)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise ValueError(f"{where} was refused: {_first_line(exc)}") from None
        planner.checked.add(data)
    return planner


def load(snapshot: _Snapshot, folder: str, obj: Any, owner: nn.Module | None, metadata: Any) -> Callable[[], None]:
    """Check that ``folder`` of ``snapshot`` loads into ``obj``, changing nothing; the function that loads it.

    The check raises CheckpointError when the checkpoint does not fit ``obj``: DCP's planning and
    every non-tensor item. Called once every file is verified, the function then meets nothing to
    refuse: ``dcp.load`` reads the verified files into the live tensors. It reads this rank's
    shards without DCP's collectives (a load's global plan is every rank's own plan), so the
    caller shares its outcome between the ranks, once for every object. ``metadata`` is the
    folder's, as :func:`read_metadata` read it: both use it, neither reads it again.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if isinstance(obj, nn.Module):
        module, optimizer = obj, None
    elif owner is not None:
        module, optimizer = owner, torch_optimizer(obj)
    else:
        raise TypeError(f"{type(obj).__qualname__} is loaded from DCP: pass the module it optimizes (optimizer_owner)")
    fresh = optimizer is not None and not optimizer.state
    failed = f"{snapshot.path / folder} could not be loaded into {type(obj).__qualname__}"
    target: Any  # the state dict of get_model_state_dict or get_optimizer_state_dict
    try:
        if optimizer is None:
            target = get_model_state_dict(module)  # the live tensors
        else:
            target = get_optimizer_state_dict(module, optimizer)  # initialises a fresh optimizer's state
        planner = _plan(snapshot, folder, target, metadata)
    except Exception as exc:
        if fresh and optimizer is not None:
            optimizer.state.clear()  # as it was
        raise CheckpointError(f"{failed} (nothing was changed): {_dcp_failure(exc)}") from exc

    def apply() -> None:
        reader = _reader_type()(snapshot, folder, metadata)
        try:
            with _single_process_is_meant():
                dcp_load(target, storage_reader=reader, planner=planner, **_local(dcp_load))
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointError(f"{failed}: {_dcp_failure(exc, local=True)}") from exc
        if optimizer is None:
            set_model_state_dict(module, target)
        else:
            set_optimizer_state_dict(module, optimizer, target)

    return apply
