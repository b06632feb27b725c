"""Files replaced whole: readers see the old file or the new one, never a part.

Small files (the config file, a worker's failure record, a tracker's table, exported weights) are
written with :func:`write_atomic`: beside the target, fsynced, renamed over it, the directory
fsynced. Checkpoints have their own commit protocol (``accelkit._checkpoint``), over the same calls.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["fsync_dir", "write_atomic"]


def write_atomic(path: Path, data: bytes | Callable[[IO[bytes]], object], mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (bytes, or a function that writes to the file) in one rename.

    The new file is written beside it, fsynced, given ``mode`` and renamed over ``path``, and
    the directory is fsynced: a crash leaves the old file or the new one, never a partial file.
    A function may also write to the new file by its path, ``f.name`` (for libraries that take a path).

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "note.txt"
        >>> write_atomic(target, b"hello"); target.read_bytes()
        b'hello'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with open(tmp, "wb") as f:  # f.name: the path, for writers that only take one
            if isinstance(data, (bytes, bytearray)):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp's 0600 would hide the file from other users of a shared setup
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path, submit: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Make the entries of directory ``path`` (created, renamed files) durable (on a thread ``submit`` runs)."""
    if submit is not None:
        submit(lambda: fsync_dir(path))
        return
    if os.name != "posix":  # Windows cannot open directories; NTFS journals metadata
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
