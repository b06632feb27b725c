"""``ak.read_checkpoint``: what a checkpoint holds, read before the model exists, changing nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _state
from ..errors import CheckpointError
from ._where import storage_for

__all__ = ["CheckpointInfo", "read_checkpoint"]


_FIELDS = ("path", "step", "world_size", "objects", "sharded", "full", "created_ns", "versions", "_values")


class CheckpointInfo(Mapping[str, Any]):
    """A committed checkpoint's saved values (read it as a dict of them) and its manifest.

    ``info["name"]``, ``dict(info)``: the plain values passed to ``save_state`` (tensors among
    them on the CPU), as ``load_state`` returns them.

    Attributes:
        path: the checkpoint's directory (its URL for one on an object store).
        step: the ``step`` value when it was an integer, else None.
        world_size: the number of processes that saved it.
        objects: the names of the objects with state (``model``, ``optimizer``, ...).
        sharded: those saved per rank (DCP).
        full: those gathered with ``full_state=True``.
        created_ns: the commit time, in ns since the epoch.
        versions: the accelkit, torch and Python versions that saved it.
        values: the plain values, as ``info["name"]`` reads them.
    """

    __slots__ = _FIELDS
    path: Path | str
    step: int | None
    world_size: int
    objects: list[str]
    sharded: list[str]
    full: list[str]
    created_ns: int
    versions: dict[str, str]
    _values: dict[str, Any]

    # A plain read-only class, not a frozen dataclass: building one of those cost ~1 ms of every import.
    def __init__(self, path: Path | str, step: int | None, world_size: int, objects: list[str], sharded: list[str],
                 full: list[str], created_ns: int, versions: dict[str, str], values: dict[str, Any],
                 ) -> None:  # fmt: skip
        given = (path, step, world_size, objects, sharded, full, created_ns, versions, values)
        for name, value in zip(_FIELDS, given, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"CheckpointInfo is read-only (it describes a committed checkpoint); cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(
            f"CheckpointInfo is read-only (it describes a committed checkpoint); cannot delete {name!r}"
        )

    def __reduce__(self) -> tuple[type[CheckpointInfo], tuple[Any, ...]]:
        return CheckpointInfo, tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not CheckpointInfo:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # its lists and dicts are not hashable

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS[:-1])
        return f"CheckpointInfo({shown})"

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"{self.path} holds no value {name!r}; it holds {sorted(self._values)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def read_checkpoint(directory: str | os.PathLike[str]) -> CheckpointInfo:
    """The saved values and manifest of the checkpoint in ``directory``, with no side effect.

    For what must be known before the objects to restore exist (the arguments the model is
    built from): nothing is restored (no RNG, no dataloader position), no process state or group
    is created, no warning is given, and any process may call it alone. The manifest's checksum
    is verified, and so is the file of tensor values; the other files are verified by
    ``load_state``. A save in flight in this process (``blocking=False``) is waited for first.

    Args:
        directory: the checkpoint's directory.

    Example:
        >>> import accelkit as ak
        >>> info = ak.read_checkpoint("ckpt/step-10")  # doctest: +SKIP
        >>> model = GPT(**info["model_args"]); info.step  # doctest: +SKIP
        10
    """
    storage = storage_for(f"accelkit.read_checkpoint({os.fspath(directory)!r})", directory)  # before any work
    saving = _state.training.saving
    if saving is not None and saving.thread is not None:
        saving.thread.join()  # its outcome is left for the next save_state, wait_for_checkpoint or end_training
    from . import _integrity, _layout, _load, _manifest  # with the first call (see _save_load)

    snapshot = storage.snapshot()
    try:
        body = snapshot.body
        if body["tensor_values"]:
            problem = _integrity.verify(snapshot, [_layout.VALUES])
            if problem:
                damaged = f"{snapshot.where}/{problem[0]} {problem[1]}; the checkpoint is damaged"
                raise CheckpointError(f"{damaged}: {_manifest.instead(storage)}")
        values = {**body["values"], **_load.tensor_values(snapshot)}
    finally:
        snapshot.close()
    step = body.get("step")
    created = body.get("created_ns")
    return CheckpointInfo(
        path=storage.location(),
        step=step if isinstance(step, int) else None,
        world_size=int(body.get("world_size") or 0),
        objects=list(body.get("objects") or []),
        sharded=list(body["sharded"]),
        full=list(body["full"]),
        created_ns=created if isinstance(created, int) else 0,
        versions={k: str(body.get(k)) for k in ("accelkit", "torch", "python")},
        values=values,
    )
