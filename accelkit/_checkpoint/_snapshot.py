"""A checkpoint held open while it loads: its manifest and every file it lists, each opened once.

``ak.load_state`` opens the checkpoint's directory, reads the manifest from it and opens every
file the manifest lists, at once. From then on every read goes through those open files: the
checksums are computed over them (mapped), and ``torch.load``, JSON and DCP read the same files
(through ``/proc/self/fd/N``, which opens the file a descriptor holds, not the path). So the bytes
verified are the bytes loaded: a save that replaces the checkpoint (it exchanges the directory
with the new one, then deletes the old one) or ``keep_last`` pruning it cannot mix another
checkpoint's bytes into a load. When the directory is replaced between the manifest and the
last file opened, the snapshot is taken again; when it is gone, the load fails saying so.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

from .. import _safe_io
from ..errors import CheckpointError
from . import _manifest

METADATA = ".metadata"  # DCP's metadata file, in each sharded object's folder (opened with the manifest)

__all__ = ["Snapshot"]

_TRIES = 3  # snapshots taken before a checkpoint replaced each time is given up on
# Files opened with the manifest, at most: beyond, DCP's shard files (one per saving rank and object) are
# opened when first read, through the directory held open (still this checkpoint's, or gone; never another's),
# so that a job of many ranks does not hold world-size descriptors per object on every rank.
_EAGER = 64


@functools.cache
def _fd_folder() -> str | None:
    """Where this system names the file an open descriptor holds (Linux: /proc/self/fd), or None."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return folder
    return None


class _Replaced(Exception):
    """The directory changed while the snapshot was taken."""


class Snapshot:
    """The checkpoint in ``path``: its manifest (``body``) and its listed files, open.

    Files the manifest lists that are not in the directory are left out (:meth:`missing`):
    verifying names them. Close it (or use it in a ``with`` block) when the load is over.
    """

    def __init__(self, path: Path, body: dict[str, Any], dir_fd: int, fds: dict[str, int], absent: set[str]) -> None:
        self.path, self.body, self._dir_fd, self._fds, self._absent = path, body, dir_fd, fds, absent
        self._lock = threading.Lock()  # the verifying thread opens files too

    @classmethod
    def take(cls, path: Path) -> Snapshot:
        """Open the checkpoint in ``path``; CheckpointError if it is not one, or was replaced on every try."""
        for attempt in range(_TRIES):
            try:
                dir_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except (FileNotFoundError, NotADirectoryError):
                if attempt:  # it was there a moment ago
                    break
                _manifest.read(path)  # says what is there instead
                raise
            try:
                return cls._open_files(path, dir_fd)
            except _Replaced:
                os.close(dir_fd)
            except BaseException:
                os.close(dir_fd)
                raise
        where = "replaced" if path.is_dir() else "removed"
        raise CheckpointError(
            f"{path} was {where} while it was being loaded, {_TRIES} times (a save into the same directory, or "
            f"keep_last pruning it); nothing was changed: load it again once the saves are done"
        )

    @classmethod
    def _open_files(cls, path: Path, dir_fd: int) -> Snapshot:
        try:
            body = _manifest.read(path, dir_fd)
        except CheckpointError:
            if not _same_file(path, dir_fd):  # its manifest deleted with the rest of it, after a new one took its name
                raise _Replaced() from None
            raise
        names = list(body["files"])
        if len(names) > _EAGER:
            names = [n for n in names if "/" not in n or n.endswith(f"/{METADATA}")]
        fds: dict[str, int] = {}
        absent: set[str] = set()
        try:
            for name in names:
                try:
                    fds[name] = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
                except FileNotFoundError:
                    if not _same_file(path, dir_fd):
                        raise _Replaced() from None
                    absent.add(name)  # missing from the checkpoint itself: the verification names it
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(path, body, dir_fd, fds, absent)

    def _open(self, name: str) -> int | None:
        """The open file of the listed ``name`` (opened now if it was not with the manifest), or None if missing."""
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None or name in self._absent:
                return fd
            try:
                fd = self._fds[name] = os.open(name, os.O_RDONLY, dir_fd=self._dir_fd)
            except FileNotFoundError:
                if not _same_file(self.path, self._dir_fd):
                    raise CheckpointError(
                        f"{self.path} was replaced or removed while it was being loaded ({name} is gone: a save "
                        f"into the same directory, or keep_last pruning it); load it again"
                    ) from None
                self._absent.add(name)
            return fd

    def missing(self, name: str) -> bool:
        """Whether the listed file ``name`` is not in the checkpoint."""
        return self._open(name) is None

    def fd(self, name: str) -> int:
        """The open file of ``name``; FileNotFoundError naming it if it is missing."""
        fd = self._open(name)
        if fd is None:
            raise FileNotFoundError(2, "No such file or directory", str(self.path / name))
        return fd

    def opener(self, name: str) -> str:
        """A path that opens the file of this snapshot (not whatever ``path/name`` names now)."""
        folder = _fd_folder()
        if folder is None:  # no such folder on this system: the path, checked to be the same file afterwards
            return str(self.path / name)
        return f"{folder}/{self.fd(name)}"

    def check_same(self, name: str) -> None:
        """Where :meth:`opener` had to give the path: CheckpointError if it now names another file."""
        if _fd_folder() is None and not _same_file(self.path / name, self.fd(name)):
            raise CheckpointError(f"{self.path / name} was replaced while it was being loaded; load it again")

    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name`` (small files: rank state, DCP's metadata)."""
        fd, chunks, at = self.fd(name), [], 0
        while chunk := os.pread(fd, 1 << 20, at):
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks)

    def problem(self, name: str) -> str | None:
        """What is wrong with the listed file ``name`` (missing, its size, a piece's checksum), or None."""
        if self.missing(name):
            return "is missing"
        return _safe_io.check_open(self.fd(name), self.body["files"][name])

    def size(self, name: str) -> int:
        return os.fstat(self.fd(name)).st_size

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_file(path: Path, fd: int) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
