"""The manifest that makes a checkpoint directory a committed checkpoint.

``manifest.json`` is written last, into the temporary directory, just before it is
renamed into place: a directory with a valid manifest is whole. The manifest lists every
file with its size and the XXH3-128 of each of its pieces (:mod:`accelkit._checksum`), and
carries the XXH3-128 of its own body; its bytes must be exactly those it was written with, so
that a damaged manifest (a byte changed, bytes appended) is told apart from a different checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from .._options import is_int
from .._safe_io import CheckpointError, FileRecord
from .._version import __version__

__all__ = ["MANIFEST", "build", "committed", "read", "version_change"]

MANIFEST = "manifest.json"
FORMAT = "accelkit-checkpoint"
VERSION = 3  # 3: XXH3-128 of each piece; 2 (sum64) and 1 (CRC-32) were never released and are refused
_MAX_BYTES = 64 << 20  # a manifest is small; refuse to parse a huge file as one


def _body_checksum(body: dict[str, Any]) -> str:
    from .._checksum import digest

    return f"xxh3_128:{digest(json.dumps(body, sort_keys=True, separators=(',', ':')).encode())}"


def _render(body: dict[str, Any]) -> bytes:
    """The manifest's bytes for ``body``: what :func:`build` writes and :func:`read` expects, byte for byte."""
    return json.dumps({"checksum": _body_checksum(body), "body": body}, indent=1).encode()


def build(
    files: dict[str, FileRecord],
    objects: list[str],
    values: dict[str, Any],
    world_size: int,
    sharded: list[str] | None = None,
    facts: dict[str, str] | None = None,
    *,
    full: list[str] | None = None,
    tensor_values: list[str] | None = None,
) -> bytes:
    """The manifest's bytes for a checkpoint of ``files``; ``sharded`` objects are DCP folders (``NAME.dcp/``).

    ``facts`` are the job's versions and options, as the ranks compared them when their group formed;
    ``full`` objects hold a full state in DCP's format (optimizers keyed by parameter names);
    ``tensor_values`` are the values kept in ``tensor-values.pt`` instead of ``values``.
    """
    step = values.get("step")
    body = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        "step": step if is_int(step) else None,
        "created_ns": time.time_ns(),
        "accelkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "job": facts or {},
        "objects": objects,
        "sharded": sharded or [],
        "full": full or [],
        "values": values,
        "tensor_values": tensor_values or [],
        "files": files,
    }
    return _render(body)


def read(directory: Path, dir_fd: int | None = None) -> dict[str, Any]:
    """The manifest body of the checkpoint in ``directory``; CheckpointError if it is not one.

    ``dir_fd``: the directory, open (the manifest is read from that directory even if it was renamed).
    """
    path = directory / MANIFEST
    try:
        with open(os.open(MANIFEST if dir_fd is not None else path, os.O_RDONLY, dir_fd=dir_fd), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > _MAX_BYTES:
                raise CheckpointError(f"{path} is {size} bytes, too large to be a manifest")
            data = f.read()
        raw = json.loads(data)
    except (FileNotFoundError, NotADirectoryError):
        if not directory.exists():
            hint = "does not exist (never saved, or removed: keep_last prunes the oldest checkpoints beside a save)"
        elif not directory.is_dir():
            hint = "is not a directory"
        else:
            hint = "has no manifest.json (not a committed checkpoint)"
        raise CheckpointError(
            f"{directory} {hint}; pass a directory written by ak.save_state, e.g. ak.latest_checkpoint(root)"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the manifest is damaged") from None
    body = raw.get("body") if isinstance(raw, dict) else None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an accelkit checkpoint manifest (no format {FORMAT!r})")
    if body.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has format version {body.get('version')!r} (accelkit {body.get('accelkit')!r} wrote it); this "
            f"accelkit ({__version__}) reads version {VERSION} only: load it with the accelkit that wrote it and save "
            f"it again with this one"
        )
    if raw.get("checksum") != _body_checksum(body):
        raise CheckpointError(f"{path} has a wrong checksum: the manifest's content was changed or damaged")
    if data != _render(body):
        raise CheckpointError(
            f"{path} holds {len(data)} bytes, not the {len(_render(body))} its content was written as: bytes were "
            f"added or changed outside what its checksum covers; the manifest is damaged"
        )
    _check_files(path, body.get("files"))
    for key in ("sharded", "full"):  # absent from checkpoints of earlier versions
        names = body.setdefault(key, [])
        if not (isinstance(names, list) and set(names) <= set(body.get("objects") or [])):
            raise CheckpointError(f"{path}: {key!r} is {names!r}, expected a list of its objects")
    names = body.setdefault("tensor_values", [])
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"{path}: 'tensor_values' is {names!r}, expected a list of names")
    if not isinstance(body.get("values"), dict):
        raise CheckpointError(f"{path}: 'values' is {body.get('values')!r:.60}, expected a mapping")
    return body


def version_change(body: dict[str, Any]) -> str:
    """How the versions that saved the checkpoint of ``body`` differ from this process's, or ""."""
    here = {"accelkit": __version__, "torch": torch.__version__, "python": platform.python_version()}
    names = {"accelkit": "accelkit", "torch": "torch", "python": "Python"}
    changed = [name for name in here if body.get(name) not in (None, here[name])]
    if not changed:
        return ""
    then = ", ".join(f"{names[n]} {body[n]}" for n in changed)
    now = ", ".join(f"{names[n]} {here[n]}" for n in changed)
    return f"it was saved with {then}; this process runs {now}"


def _check_files(path: Path, files: Any) -> None:
    from .._checksum import KEY

    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' is {type(files).__name__}, expected a mapping")
    for name, rec in files.items():
        if not _is_plain(name):
            raise CheckpointError(f"{path}: file name {name!r} is not a plain file name (or FOLDER/NAME)")
        size, piece, digests = (rec.get(k) for k in ("size", "piece", KEY)) if isinstance(rec, dict) else (None,) * 3
        if not (
            is_int(size)
            and is_int(piece)
            and size >= 0
            and piece > 0
            and isinstance(digests, list)
            and len(digests) == -(-size // piece)
            and all(isinstance(d, str) for d in digests)
        ):
            raise CheckpointError(
                f"{path}: the entry of {name!r} is {rec!r:.200}, expected its size, piece size and a digest a piece"
            )


def _is_plain(name: Any) -> bool:
    """A file directly in the checkpoint, or in one of its folders (``model.dcp/.metadata``): nothing outside."""
    if not isinstance(name, str) or not name or name.startswith(".") or "\\" in name or "\0" in name:
        return False
    parts = name.split("/")
    return len(parts) <= 2 and all(part not in ("", ".", "..") for part in parts)


def committed(root: Path, *, whole: bool = False) -> list[tuple[int, Path]]:
    """The committed checkpoints directly under ``root``: (commit time in ns, directory), oldest first.

    ``whole``: only those whose files are all there at the sizes the manifest says (a cheap check,
    no file is read; the checksums are checked when one is loaded).
    """
    found = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            body = read(Path(entry.path))
        except CheckpointError:
            continue
        if whole and missing_or_cut(Path(entry.path), body):
            continue
        created = body.get("created_ns")
        found.append((created if isinstance(created, int) else 0, Path(entry.path)))
    return sorted(found)


def missing_or_cut(directory: Path, body: dict[str, Any]) -> str:
    """The first file of the checkpoint that is missing or not the size its manifest says; "" when none."""
    for name, record in body["files"].items():
        try:
            size = (directory / name).stat().st_size
        except OSError:
            return f"{directory / name} is missing"
        if size != record["size"]:
            return f"{directory / name} is {size} bytes, not {record['size']}"
    return ""


def instead(damaged: Path, tries: int = 3) -> str:
    """Whether another checkpoint beside ``damaged`` verifies (every byte read): the newest that does, to load instead.

    Up to ``tries`` of the newest whole ones are verified, newest first.
    """
    others = [path for _, path in committed(damaged.parent, whole=True) if path.resolve() != damaged.resolve()]
    for other in reversed(others[-tries:]):
        if not damage(other):
            return f"{other} verifies: load it instead, ak.load_state({str(other)!r}, ...)"
    if not others:
        return f"no other checkpoint in {damaged.parent} verifies (no other is whole)"
    checked = min(tries, len(others))
    return f"no other checkpoint in {damaged.parent} verifies ({len(others)} there; the newest {checked} checked)"


def damage(directory: Path) -> str:
    """The first damaged file of the checkpoint in ``directory`` and what is wrong with it; "" when it verifies."""
    from .._safe_io import check_file

    try:
        body = read(directory)
    except CheckpointError as exc:
        return str(exc)
    for name, record in body["files"].items():
        problem = check_file(directory / name, record)
        if problem:
            return f"{directory / name} {problem}"
    return ""
