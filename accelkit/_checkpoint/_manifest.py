"""The manifest that makes a checkpoint a committed checkpoint.

``manifest.json`` is written last: locally into the temporary directory, just before it is renamed
into place; on an object store beside the save's folder of files, which it names (``folder``). A
checkpoint with a valid manifest is whole. The manifest lists every file with its size and the
XXH3-128 of each of its pieces (``_integrity``), and carries the XXH3-128 of its own body; its bytes
must be exactly those it was written with, so that a damaged manifest (a byte changed, bytes
appended) is told apart from a different checkpoint.
"""

from __future__ import annotations

import json
import platform
import re
import time
from typing import IO, TYPE_CHECKING, Any

import torch

from .._options import is_int
from .._version import __version__
from ..errors import CheckpointError
from . import _integrity, _layout

if TYPE_CHECKING:
    from ._storage import Storage

__all__ = ["build", "committed", "damage", "instead", "not_a_checkpoint", "parse", "read_capped", "version_change"]

FORMAT = "accelkit-checkpoint"
VERSION = 3  # 3: XXH3-128 of each piece; 2 (sum64) and 1 (CRC-32) were never released and are refused
_MAX_BYTES = 64 << 20  # a manifest is small; refuse to parse a huge file as one


def _body_checksum(body: dict[str, Any]) -> str:
    return f"xxh3_128:{_integrity.digest(json.dumps(body, sort_keys=True, separators=(',', ':')).encode())}"


def _render(body: dict[str, Any]) -> bytes:
    """The manifest's bytes for ``body``: what :func:`build` writes and :func:`read` expects, byte for byte."""
    return json.dumps({"checksum": _body_checksum(body), "body": body}, indent=1).encode()


def build(
    files: dict[str, _integrity.FileRecord],
    objects: list[str],
    values: dict[str, Any],
    world_size: int,
    sharded: list[str] | None = None,
    facts: dict[str, str] | None = None,
    *,
    full: list[str] | None = None,
    tensor_values: list[str] | None = None,
    folder: str | None = None,
) -> bytes:
    """The manifest's bytes for a checkpoint of ``files``; ``sharded`` objects are DCP folders (``NAME.dcp/``).

    ``facts`` are the job's versions and options, as the ranks compared them when their group formed;
    ``full`` objects hold a full state in DCP's format (optimizers keyed by parameter names);
    ``tensor_values`` are the values kept in ``tensor-values.pt`` instead of ``values``; ``folder``
    is the save's folder of files on an object store (None: the files are beside the manifest).
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
    if folder is not None:
        body["folder"] = folder
    return _render(body)


def read_capped(f: IO[bytes], size: int, where: str) -> bytes:
    """The bytes of the manifest file ``f`` of ``size`` bytes; CheckpointError if it is too large to be one."""
    if size > _MAX_BYTES:
        raise CheckpointError(f"{where} is {size} bytes, too large to be a manifest")
    return f.read()


def not_a_checkpoint(where: str, hint: str) -> str:
    """The message for ``where``, which is no committed checkpoint (``hint``: what is there instead)."""
    return f"{where} {hint}; pass a directory written by ak.save_state, e.g. ak.latest_checkpoint(root)"


def parse(data: bytes, path: str) -> dict[str, Any]:
    """The body of the manifest ``data`` read from ``path``; CheckpointError if it is not a valid one."""
    try:
        raw = json.loads(data)
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
    folder = body.get("folder")
    if folder is not None and not (isinstance(folder, str) and re.fullmatch(rf"{re.escape(_layout.DATA)}\w+", folder)):
        raise CheckpointError(f"{path}: 'folder' is {folder!r:.80}, expected a name {_layout.DATA}TOKEN")
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


def _check_files(path: str, files: Any) -> None:
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' is {type(files).__name__}, expected a mapping")
    for name, rec in files.items():
        if not _is_plain(name):
            raise CheckpointError(f"{path}: file name {name!r} is not a plain file name (or FOLDER/NAME)")
        size, piece, digests = (
            (rec.get(k) for k in ("size", "piece", _integrity.KEY)) if isinstance(rec, dict) else (None,) * 3
        )
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


def committed(root: Storage, *, whole: bool = False) -> list[tuple[int, Storage]]:
    """The committed checkpoints directly under ``root``: (commit time in ns, checkpoint), oldest first.

    ``whole``: only those whose files are all there at the sizes the manifest says (a cheap check,
    no file is read; the checksums are checked when one is loaded).
    """
    found = []
    for child in root.children():
        try:
            body = child.manifest()
        except CheckpointError:
            continue
        if whole and child.missing_or_cut(body):
            continue
        created = body.get("created_ns")
        found.append((created if isinstance(created, int) else 0, child))
    return sorted(found, key=lambda entry: (entry[0], entry[1].name))


def instead(damaged: Storage) -> str:
    """Whether another checkpoint beside ``damaged`` verifies (every byte read): the newest that does, to load instead.

    Up to ``damaged.verify_tries`` of the newest whole ones are verified, newest first.
    """
    where, tries = damaged.parent(), damaged.verify_tries
    others = [other for _, other in committed(where, whole=True) if not other.same(damaged)]
    for other in reversed(others[-tries:]):
        if not damage(other):
            return f"{other} verifies: load it instead, ak.load_state({str(other)!r}, ...)"
    if not others:
        return f"no other checkpoint in {where} verifies (no other is whole)"
    checked = min(tries, len(others))
    return f"no other checkpoint in {where} verifies ({len(others)} there; the newest {checked} checked)"


def damage(checkpoint: Storage) -> str:
    """The first damaged file of ``checkpoint`` and what is wrong with it; "" when it verifies."""
    try:
        snapshot = checkpoint.snapshot()
    except CheckpointError as exc:
        return str(exc)
    try:
        problem = _integrity.verify(snapshot, list(snapshot.body["files"]))
    finally:
        snapshot.close()
    return f"{snapshot.where}/{problem[0]} {problem[1]}" if problem else ""
