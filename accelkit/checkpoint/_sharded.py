"""Sharded (DTensor) state in checkpoints, through ``torch.distributed.checkpoint`` (DCP).

An object is sharded when its state holds DTensors: a module ``fully_shard``-ed (by hand or
by ``ak.prepare``), or an optimizer over such a module's parameters. Each rank saves its own
shards with ``dcp.save`` into ``NAME.dcp/`` inside the checkpoint's temporary directory,
checksumming every file while writing (:class:`_HashingFileSystem`), so that the commit
protocol of ``ak.save_state`` covers them as any other file. Loading reads ``.metadata``
with a restricted unpickler, runs DCP's planning and unpickles every non-tensor item with
``torch.load(weights_only=True)`` first (:func:`load`); once every file is verified, the
function it returns reads the shards into the live tensors, as ``dcp.load`` does, on the plan
already made, each tensor copied once from the mapped file (:func:`read_items`).
DCP reshards on load: a checkpoint saved by N processes loads on M, sharded or not.

``torch.distributed.checkpoint`` is imported here, inside functions: ``import accelkit``
does not pay for it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .. import _safe_io
from ..errors import CheckpointError
from ..training import PreparedOptimizer
from . import _files

__all__ = [
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
_METADATA = ".metadata"


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


def _dcp_failure(exc: BaseException) -> str:
    """DCP's failure, each failed rank's error without its traceback."""
    failures = getattr(exc, "failures", None)
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
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as metadata

            found = getattr(metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:  # its classes, not what it imports
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(path: Path) -> Any:
    """DCP's ``Metadata`` from ``path``, unpickled without running code; CheckpointError if refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        found = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
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
        def __init__(self) -> None:
            super().__init__()
            self.checked: set[bytes] = set()  # items already unpickled as weights_only (by _plan)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP unpickles non-tensor items without restriction: check that they need no code first.
            if value.getvalue() not in self.checked:
                torch.load(value, weights_only=True)
                value.seek(0)
            super().load_bytes(read_item, value)

    return _SafePlanner


def _plan(folder: Path, state: dict[str, Any], metadata: Any) -> tuple[Any, Any]:
    """DCP's planner and local plan for loading ``state`` from ``folder``; what DCP would refuse, raised now.

    DCP's own planning (keys, sizes) runs here, and every non-tensor item it would read is
    unpickled as ``torch.load(weights_only=True)`` does, so that the in-place read that follows
    meets nothing it refuses once it has begun. The planner keeps those items' bytes: the same
    bytes read again need no second check.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    planner = _planner_type()()
    planner.set_up_planner(state, metadata, False)
    plan = planner.create_local_plan()
    with contextlib.ExitStack() as files:
        opened: dict[str, Any] = {}  # each file opened once
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                continue
            info = metadata.storage_data[item.storage_index]
            where = f"the item {item.storage_index.fqn} in {info.relative_path}"
            if info.transform_descriptors:  # accelkit writes none
                raise ValueError(f"{where} is stored transformed ({info.transform_descriptors}): accelkit refuses it")
            name = str(info.relative_path)
            f = opened.get(name)
            if f is None:
                f = opened[name] = files.enter_context(open(folder / name, "rb"))
            f.seek(info.offset)
            data = f.read(info.length)
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except Exception as exc:
                raise ValueError(f"{where} was refused: {_first_line(exc)}") from None
            planner.checked.add(data)
    return planner, plan


def load(folder: Path, obj: Any, owner: nn.Module | None, metadata: Any) -> Callable[[], None]:
    """Check that ``folder`` loads into ``obj``, changing nothing; the function that loads it, in place.

    The check raises CheckpointError when the checkpoint does not fit ``obj``: DCP's planning and
    every non-tensor item. Called once every file is verified, the function then meets nothing to
    refuse: it reads verified bytes into the live tensors, as ``dcp.load`` does, on the plan the
    check made. It reads this rank's shards without DCP's collectives (a load's global plan is
    every rank's own plan), so the caller shares its outcome between the ranks, once for every
    object. ``metadata`` is the folder's, as :func:`read_metadata` read it: both use it, neither
    reads it again.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if isinstance(obj, nn.Module):
        module, optimizer = obj, None
    elif owner is not None:
        module, optimizer = owner, torch_optimizer(obj)
    else:
        raise TypeError(f"{type(obj).__qualname__} is loaded from DCP: pass the module it optimizes (optimizer_owner)")
    fresh = optimizer is not None and not optimizer.state
    failed = f"{folder} could not be loaded into {type(obj).__qualname__}"
    target: Any  # the state dict of get_model_state_dict or get_optimizer_state_dict
    try:
        if optimizer is None:
            target = get_model_state_dict(module)  # the live tensors
        else:
            target = get_optimizer_state_dict(module, optimizer)  # initialises a fresh optimizer's state
        planner, plan = _plan(folder, target, metadata)
    except Exception as exc:
        if fresh and optimizer is not None:
            optimizer.state.clear()  # as it was
        raise CheckpointError(f"{failed} (nothing was changed): {_dcp_failure(exc)}") from exc

    def apply() -> None:
        # The rest of dcp.load for one process (no_dist), on the plan made above: planned once.
        try:
            (central,) = planner.create_global_plan([plan])
            read_items(folder, metadata, planner, planner.finish_plan(central))
        except Exception as exc:
            raise CheckpointError(f"{failed}: {_first_line(exc)}") from exc
        if optimizer is None:
            set_model_state_dict(module, target)
        else:
            set_optimizer_state_dict(module, optimizer, target)

    return apply


def read_items(folder: Path, metadata: Any, planner: Any, plan: Any) -> None:
    """What DCP's ``FileSystemReader.read_data`` does, with each tensor copied once.

    DCP stores every tensor as a ``torch.save`` archive, and its reader loads each into a new
    tensor before copying that into the target. Here each file is mapped, an archive's layout
    is read without its data (``map_location="meta"``), and the target copies straight from
    the mapped bytes. An archive laid out otherwise (another byte order, a compressed record)
    is loaded as DCP loads it.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list[Any]] = {}
    for item in plan.items:
        per_file.setdefault(str(metadata.storage_data[item.storage_index].relative_path), []).append(item)
    for name, items in per_file.items():
        path = folder / name
        mapped = torch.UntypedStorage.from_file(str(path), False, path.stat().st_size)
        with open(path, "rb") as f:
            for item in items:
                info = metadata.storage_data[item.storage_index]
                if item.type == LoadItemType.BYTE_IO:
                    f.seek(info.offset)
                    planner.load_bytes(item, io.BytesIO(f.read(info.length)))
                    continue
                source = _mapped_tensor(f, mapped, info.offset, info.length)
                if source is None:  # loaded as DCP loads it
                    archive: Any = _Slice(f, info.offset, info.length)
                    source = torch.load(archive, map_location="cpu", weights_only=True)
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    source = source.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise ValueError(
                        f"{item.storage_index.fqn} in {name} is {tuple(source.size())}, not {tuple(target.size())}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)


def _mapped_tensor(f: Any, mapped: Any, offset: int, length: int) -> torch.Tensor | None:
    """The tensor ``torch.save`` archived at ``offset`` in ``f``, over ``mapped`` (the file, mapped); None when
    its archive is not one plain, uncompressed record in this host's byte order."""
    archive: Any = _Slice(f, offset, length)  # a file of its own, to torch.load and zipfile
    layout = torch.load(archive, map_location="meta", weights_only=True)  # reads no data
    archive.seek(0)
    with zipfile.ZipFile(archive) as zipped:  # its records' CRC-32 is not written (checksummed as a whole)
        records = {info.filename.partition("/")[2]: info for info in zipped.infolist()}
    data = [info for name, info in records.items() if name.startswith("data/")]
    if not isinstance(layout, torch.Tensor) or len(data) != 1 or data[0].file_size != layout.untyped_storage().nbytes():
        return None
    start, order = _record_start(archive, data[0]), records.get("byteorder")  # none: native, as torch reads it
    if order is not None:
        at = _record_start(archive, order)
        archive.seek(at or 0)
        if at is None or archive.read(order.file_size) != sys.byteorder.encode():
            return None
    if start is None:
        return None
    storage = mapped[offset + start : offset + start + data[0].file_size]
    return torch.empty(0, dtype=layout.dtype).set_(storage, layout.storage_offset(), layout.size(), layout.stride())


def _record_start(archive: Any, record: zipfile.ZipInfo) -> int | None:
    """Where the bytes of ``record`` start in ``archive``; None unless they are stored as they are, inside it."""
    archive.seek(record.header_offset)
    header = archive.read(30)  # the record's local header; its name and extra field follow
    if record.compress_type != zipfile.ZIP_STORED or len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    start = record.header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
    return start if start + record.file_size <= archive.seek(0, io.SEEK_END) else None


class _Slice(io.RawIOBase):
    """``length`` bytes of the open file ``f`` from ``offset``, as a file of their own (one DCP item)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._offset, self._length, self._at = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, at: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, base + at)
        return self._at

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view:
            wanted = max(0, min(len(view), self._length - self._at))
            self._f.seek(self._offset + self._at)
            got = self._f.readinto(view[:wanted])
        self._at += got
        return int(got)
