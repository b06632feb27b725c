"""The commit protocol of ``ak.save_state``, main-process steps.

1. :func:`begin`: remove what crashed saves left beside the target (``.accelkit-tmp-*``,
   ``.accelkit-trash-*``), create the temporary directory (every rank then writes and
   fsyncs its files in it, and the ranks agree that all succeeded).
2. :func:`commit`: write the manifest into it, fsync it, the directory and what is still
   being fsynced of the other files (at the same time), then rename it into place in one
   step (an atomic exchange when the target exists), fsync the parent.
3. :func:`prune`: only after that, remove the oldest committed checkpoints beyond ``keep_last``.

A crash before the rename leaves only a hidden temporary directory; after it, the new
checkpoint is whole. Deletions rename first, so that no half-deleted checkpoint looks whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._safe_io import CheckpointError, Flusher, crash_point, fsync_dir, remove_tree, swap, write_file
from . import _manifest
from ._manifest import committed

__all__ = ["TMP", "begin", "commit", "is_checkpoint", "prune"]

TMP = ".accelkit-tmp-"
_STALE = (TMP, ".accelkit-trash-")


def begin(target: Path, tmp: Path) -> None:
    """Main process: clean up what crashed saves left beside ``target``, and create ``tmp``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not (target.is_dir() and (not any(target.iterdir()) or is_checkpoint(target))):
        raise CheckpointError(f"{target} exists and is not an accelkit checkpoint; save elsewhere or remove it")
    for entry in os.scandir(target.parent):
        if entry.name.startswith(_STALE) and entry.is_dir(follow_symlinks=False):
            remove_tree(Path(entry.path))
    tmp.mkdir()


def is_checkpoint(path: Path) -> bool:
    try:
        _manifest.read(path)
    except CheckpointError:
        return False
    return True


def commit(tmp: Path, target: Path, manifest: bytes, flusher: Flusher | None = None) -> None:
    """Main process: write the manifest, then move ``tmp`` into place in one rename.

    ``flusher`` may still be fsyncing files of ``tmp``: the manifest and the directory are
    fsynced beside them, and all are durable before the rename.
    """
    crash_point("before-manifest")
    flusher = flusher or Flusher()
    write_file(tmp / _manifest.MANIFEST, lambda f: f.write(manifest), flusher=flusher)
    fsync_dir(tmp, flusher)
    flusher.wait()
    crash_point("before-rename")
    if target.exists() and swap(tmp, target):
        fsync_dir(target.parent)
        crash_point("after-rename")
        remove_tree(tmp)  # now the previous checkpoint
        return
    if target.exists():  # no atomic exchange here: empty or replaced in two renames
        os.rename(target, target.with_name(f".accelkit-trash-{target.name}-{os.getpid()}"))
    os.rename(tmp, target)
    fsync_dir(target.parent)
    crash_point("after-rename")


def prune(target: Path, keep_last: int) -> None:
    found = [path for _, path in committed(target.parent) if path != target]
    for path in found[: max(0, len(found) - (keep_last - 1))]:
        crash_point(f"prune:{path.name}")
        remove_tree(path)
