"""Every name in a checkpoint, in one place: its files, its folders, and what a save leaves beside it.

A committed checkpoint holds ``NAME.pt`` per named object (its ``state_dict()``, written by the
main process) or ``NAME.dcp/`` for a sharded one (each rank's shards, DCP's files and its
``.metadata``), ``tensor-values.pt`` for values holding tensors, ``rank-R.json`` per rank (RNG
states, grad scaler, prepared-dataloader positions) and ``manifest.json``, written last. On an
object store the files sit in a folder of their own, ``.accelkit-data-TOKEN/``, which the manifest
names (there is no rename: each save writes a new folder, the manifest commits it).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DATA",
    "MANIFEST",
    "METADATA",
    "SHARDED",
    "STALE",
    "TMP",
    "TRASH",
    "VALUES",
    "data_folder",
    "expected",
    "object_file",
    "rank_file",
    "sharded_folder",
    "tmp_name",
    "trash_name",
]

MANIFEST = "manifest.json"  # the commit: a folder holding a valid one is a whole checkpoint
VALUES = "tensor-values.pt"  # object files are NAME.pt with NAME an identifier: no clash
SHARDED = ".dcp"  # a sharded object's folder: NAME.dcp/
METADATA = ".metadata"  # DCP's metadata file, in each sharded object's folder
TMP = ".accelkit-tmp-"  # a save's temporary directory beside its target (local)
TRASH = ".accelkit-trash-"  # a checkpoint being deleted, renamed out of sight first (local)
STALE = (TMP, TRASH)  # what crashed saves leave beside a target: the next save removes it
DATA = ".accelkit-data-"  # a save's files on an object store, in the checkpoint's folder


def object_file(name: str) -> str:
    """The file of a named object's state (``model.pt``)."""
    return f"{name}.pt"


def sharded_folder(name: str) -> str:
    """The folder of a sharded object's DCP files (``model.dcp``)."""
    return f"{name}{SHARDED}"


def rank_file(rank: int) -> str:
    """The per-rank state of ``rank`` (``rank-0.json``)."""
    return f"rank-{rank}.json"


def tmp_name(target: str, token: str) -> str:
    """The temporary directory of a save to ``target`` (local)."""
    return f"{TMP}{target}-{token}"


def trash_name(name: str, pid: int) -> str:
    """Where a checkpoint ``name`` goes to be deleted (local)."""
    return f"{TRASH}{name}-{pid}"


def data_folder(token: str) -> str:
    """The folder of one save's files on an object store."""
    return f"{DATA}{token}"


def expected(body: dict[str, Any]) -> list[str]:
    """The files the checkpoint of the manifest ``body`` must hold: each object's file (a sharded one's
    ``.metadata``), each rank's state and the tensor values."""
    found = [f"{sharded_folder(n)}/{METADATA}" if n in body["sharded"] else object_file(n) for n in body["objects"]]
    found += [rank_file(r) for r in range(body["world_size"])]
    return found + ([VALUES] if body["tensor_values"] else [])
