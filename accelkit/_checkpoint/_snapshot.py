"""A local checkpoint held open while it loads: its manifest and every file it lists, each opened once.

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

import contextlib
import functools
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import CheckpointError
from . import _integrity, _layout

if TYPE_CHECKING:
    from ._local import LocalStorage

__all__ = ["LocalSnapshot"]

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


class LocalSnapshot:
    """The checkpoint in ``path``: its manifest (``body``) and its listed files, open.

    Files the manifest lists that are not in the directory are left out (:meth:`missing`):
    verifying names them. Close it (or use it in a ``with`` block) when the load is over.
    """

    checks_on_read = False  # the verifier checksums the files, mapped; one rank's check covers every rank's read

    def __init__(
        self, storage: LocalStorage, body: dict[str, Any], dir_fd: int, fds: dict[str, int], absent: set[str]
    ) -> None:
        self.path, self.body, self._dir_fd, self._fds, self._absent = storage.path, body, dir_fd, fds, absent
        self.storage, self.where, self.parallel = storage, str(storage.path), _integrity.workers()
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()  # the verifying threads open and map files too

    @classmethod
    def take(cls, storage: LocalStorage) -> LocalSnapshot:
        """Open the checkpoint in ``storage``; CheckpointError if it is not one, or was replaced on every try."""
        path = storage.path
        for attempt in range(_TRIES):
            try:
                dir_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except (FileNotFoundError, NotADirectoryError):
                if attempt:  # it was there a moment ago
                    break
                storage.manifest()  # says what is there instead
                raise
            try:
                return cls._open_files(storage, dir_fd)
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
    def _open_files(cls, storage: LocalStorage, dir_fd: int) -> LocalSnapshot:
        path = storage.path
        try:
            body = storage.manifest(dir_fd)
        except CheckpointError:
            if not _same_file(path, dir_fd):  # its manifest deleted with the rest of it, after a new one took its name
                raise _Replaced() from None
            raise
        names = list(body["files"])
        if len(names) > _EAGER:
            names = [n for n in names if "/" not in n or n.endswith(f"/{_layout.METADATA}")]
        fds: dict[str, int] = {}
        absent: set[str] = set()
        try:
            for name in names:
                try:
                    fds[name] = os.open(_in_folder(body, name), os.O_RDONLY, dir_fd=dir_fd)
                except FileNotFoundError:
                    if not _same_file(path, dir_fd):
                        raise _Replaced() from None
                    absent.add(name)  # missing from the checkpoint itself: the verification names it
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(storage, body, dir_fd, fds, absent)

    def _open(self, name: str) -> int | None:
        """The open file of the listed ``name`` (opened now if it was not with the manifest), or None if missing."""
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None or name in self._absent:
                return fd
            try:
                fd = self._fds[name] = os.open(_in_folder(self.body, name), os.O_RDONLY, dir_fd=self._dir_fd)
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
        """A path that opens the file of this snapshot (not whatever ``path/name`` names now): torch.load maps it."""
        folder = _fd_folder()
        if folder is None:  # no such folder on this system: the path, checked to be the same file afterwards
            return str(self.path / _in_folder(self.body, name))
        return f"{folder}/{self.fd(name)}"

    def check_same(self, name: str) -> None:
        """Where :meth:`opener` had to give the path: CheckpointError if it now names another file."""
        if _fd_folder() is None and not _same_file(self.path / _in_folder(self.body, name), self.fd(name)):
            raise CheckpointError(f"{self.path / name} was replaced while it was being loaded; load it again")

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[IO[bytes]]:
        """The file ``name`` of this snapshot, open for reading (DCP reads its shards through it)."""
        with open(self.opener(name), "rb") as stream:
            yield stream
        self.check_same(name)

    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name`` (small files: rank state, DCP's metadata)."""
        fd, chunks, at = self.fd(name), [], 0
        while chunk := os.pread(fd, 1 << 20, at):
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks)

    def pread(self, name: str, length: int, offset: int) -> bytes:
        return os.pread(self.fd(name), length, offset)

    def size(self, name: str) -> int:
        return os.fstat(self.fd(name)).st_size

    @contextlib.contextmanager
    def piece(self, name: str, index: int) -> Iterator[memoryview]:
        """Piece ``index`` of the file ``name``, mapped (the verifier checksums it)."""
        at, length = _integrity.pieces(self.body["files"][name])[index]
        fd = self.fd(name)
        with self._lock:
            mapping = self._maps.get(name)
            if mapping is None:
                mapping = self._maps[name] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        with memoryview(mapping) as whole, whole[at : at + length] as view:
            yield view

    def to_verify(self, names: list[str], reads: list[str], rank: int, world_size: int) -> tuple[list[str], list[str]]:
        """This rank's share of every file: one file's check covers every rank's read of it (the same bytes)."""
        return _integrity.share(names, self.body["files"], rank, world_size), []

    def reading(self, name: str, offset: int, length: int) -> list[int]:
        return []  # every file is checked whole by one rank

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps = {}
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> LocalSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_folder(body: dict[str, Any], name: str) -> str:
    """Where the listed file ``name`` is in the checkpoint: beside the manifest, or in the folder it names (a
    checkpoint saved on an object store, then copied here)."""
    folder = body.get("folder")
    return f"{folder}/{name}" if folder else name


def _same_file(path: Path, fd: int) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
