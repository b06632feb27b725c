"""Sharded (DTensor) state in checkpoints, through ``torch.distributed.checkpoint`` (DCP): loading.

Loading reads ``.metadata`` with a restricted unpickler, runs DCP's planning and unpickles every
non-tensor item with ``torch.load(weights_only=True)`` first (:func:`load`); once every file (or,
from an object store, every range the plan reads) is verified, the function it returns reads the
shards into the live tensors with ``dcp.load``, through a ``FileSystemReader`` of ours that reads
the checkpoint's snapshot (the bytes that were verified) and hands DCP the metadata read before,
and a load planner of ours that refuses non-tensor items needing code to unpickle. DCP reshards on
load: a checkpoint saved by N processes loads on M, sharded or not.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import PurePosixPath
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from .. import _torch_private
from ..errors import CheckpointError
from ._sharded import dcp_failure, first_line, relative_filesystem, single_process_is_meant, torch_optimizer
from ._storage import Snapshot

__all__ = ["Sharded", "load", "read_metadata", "referenced_files"]


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


def read_metadata(snapshot: Snapshot, name: str) -> Any:
    """DCP's ``Metadata`` from the file ``name`` of ``snapshot``, unpickled without running code; CheckpointError
    if refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = f"{snapshot.where}/{name}"
    try:
        found = _MetadataUnpickler(io.BytesIO(snapshot.read_bytes(name))).load()
    except Exception as exc:
        raise CheckpointError(f"{path} was refused: {first_line(exc)}") from None
    if not isinstance(found, Metadata):
        raise CheckpointError(f"{path} was refused: it holds a {type(found).__qualname__}, not DCP metadata")
    return found


def referenced_files(metadata: Any) -> set[str]:
    """The file names (relative to its folder) that ``metadata`` reads data from."""
    return {_torch_private.storage_item(metadata, index)[0] for index in metadata.storage_data or {}}


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
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class _SnapshotFileSystem(relative_filesystem()):  # type: ignore[misc]
        """Opens a checkpoint's files as its snapshot holds them (the verified ones), never by their path now."""

        def __init__(self, snapshot: Snapshot) -> None:
            super().__init__()
            self.snapshot = snapshot

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "r" not in mode or "+" in mode:
                raise PermissionError(f"{path}: a checkpoint is read, not written, when it is loaded")
            with self.snapshot.stream(str(path)) as stream:
                yield stream

    class _SnapshotReader(FileSystemReader):
        """DCP's reader of a checkpoint's folder, over its snapshot, with the metadata read (restricted) before."""

        def __init__(self, snapshot: Snapshot, folder: str, metadata: Any) -> None:
            super().__init__(folder)
            _torch_private.use_filesystem(self, _SnapshotFileSystem(snapshot), PurePosixPath(folder))
            self.metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.metadata

    return _SnapshotReader


class Sharded(NamedTuple):
    """A sharded object checked against the checkpoint: the ranges DCP will read, and the function that loads them."""

    ranges: list[tuple[str, int, int]]  # (file, offset, length) this rank's plan reads
    apply: Callable[[], None]


def _plan(
    snapshot: Snapshot, folder: str, state: dict[str, Any], metadata: Any
) -> tuple[Any, list[tuple[str, int, int]]]:
    """DCP's planner for loading ``state`` from ``folder``, its plan checked; what DCP would refuse, raised now.

    DCP's own planning (keys, sizes) runs here, and every non-tensor item it would read is
    unpickled as ``torch.load(weights_only=True)`` does, so that the load that follows meets
    nothing it refuses once it has begun. The planner keeps those items' bytes: the same bytes
    read again need no second check. Also returns the byte ranges the plan reads.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    planner = _planner_type()()
    planner.set_up_planner(state, metadata, False)
    plan = planner.create_local_plan()
    ranges = []
    for item in plan.items:
        relative, offset, length, transforms = _torch_private.storage_item(metadata, item.storage_index)
        name = f"{folder}/{relative}"
        ranges.append((name, offset, length))
        if item.type != LoadItemType.BYTE_IO:
            continue
        where = f"the item {item.storage_index.fqn} in {relative}"
        if transforms:  # accelkit writes none
            raise ValueError(f"{where} is stored transformed ({transforms}): accelkit refuses it")
        data = snapshot.pread(name, length, offset)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise ValueError(f"{where} was refused: {first_line(exc)}") from None
        planner.checked.add(data)
    return planner, ranges


def load(snapshot: Snapshot, folder: str, obj: Any, owner: nn.Module | None, metadata: Any) -> Sharded:
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
    failed = f"{snapshot.where}/{folder} could not be loaded into {type(obj).__qualname__}"
    target: Any  # the state dict of get_model_state_dict or get_optimizer_state_dict
    try:
        if optimizer is None:
            target = get_model_state_dict(module)  # the live tensors
        else:
            target = get_optimizer_state_dict(module, optimizer)  # initialises a fresh optimizer's state
        planner, ranges = _plan(snapshot, folder, target, metadata)
    except Exception as exc:
        if fresh and optimizer is not None:
            optimizer.state.clear()  # as it was
        raise CheckpointError(f"{failed} (nothing was changed): {dcp_failure(exc)}") from exc

    def apply() -> None:
        reader = _reader_type()(snapshot, folder, metadata)
        try:
            with single_process_is_meant():
                dcp_load(target, storage_reader=reader, planner=planner, **_local(dcp_load))
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointError(f"{failed}: {dcp_failure(exc, local=True)}") from exc
        if optimizer is None:
            set_model_state_dict(module, target)
        else:
            set_optimizer_state_dict(module, optimizer, target)

    return Sharded(ranges, apply)
