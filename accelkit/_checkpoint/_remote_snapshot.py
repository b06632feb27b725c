"""A checkpoint on an object store held for one load: its manifest read once, its pieces read once, each verified.

The manifest names the folder of the save's files, which no save writes again (a new save writes
a new folder), and one listing of it gives every file's size. Each piece of a file (64 MiB) is read
with one ranged request, on the verifier's threads (several at once: the network's time, not the
CPU's) or when a reader first needs it, checked against the manifest's digest as it arrives, and
kept in memory until the load ends: what ``torch.load`` and DCP read is what was verified. A piece
that is gone (the checkpoint replaced or pruned meanwhile) fails the load, saying so; a changed one
names its byte range. Nothing is applied before every piece this rank reads was verified.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import IO, TYPE_CHECKING, Any

from ..errors import CheckpointError
from . import _integrity

if TYPE_CHECKING:
    from ._remote import RemoteStorage

__all__ = ["RemoteSnapshot"]

_PARALLEL = 8  # pieces read at once


class RemoteSnapshot:
    """The checkpoint of ``storage`` as its manifest (``body``) was when read: the folder it names, read in pieces."""

    checks_on_read = True  # every piece is checked as it arrives
    parallel = _PARALLEL

    def __init__(self, storage: RemoteStorage, body: dict[str, Any], sizes: dict[str, int]) -> None:
        folder = body.get("folder", "")  # none: the files beside the manifest (a local checkpoint copied there)
        self.storage, self.body, self.where, self._sizes = storage, body, storage.url, sizes
        self._base = f"{storage.path}/{folder}".rstrip("/")
        self._shown = f"{storage.url}/{folder}".rstrip("/")
        self._pieces: dict[tuple[str, int], Future[bytes]] = {}
        self._lock = threading.Lock()

    @classmethod
    def take(cls, storage: RemoteStorage) -> RemoteSnapshot:
        """Read the manifest of ``storage`` and list its folder; CheckpointError if it is not a checkpoint."""
        body = storage.manifest()
        try:
            sizes = storage.listing(body.get("folder", ""))
        except FileNotFoundError:
            sizes = {}
        absent = next((name for name in body["files"] if name not in sizes), None)
        if absent is not None and not _still(storage, body):  # a save or a prune removes the manifest first
            raise _gone(storage.url, absent)
        return cls(storage, body, sizes)

    def missing(self, name: str) -> bool:
        return name not in self._sizes

    def size(self, name: str) -> int:
        if name not in self._sizes:
            raise FileNotFoundError(2, "No such file or directory", f"{self._shown}/{name}")
        return self._sizes[name]

    def _read(self, name: str, index: int) -> bytes:
        """Piece ``index`` of ``name``, read once, verified (Damaged if it is not what the manifest says)."""
        key = (name, index)
        with self._lock:
            future, mine = self._pieces.get(key), False
            if future is None:
                future = self._pieces[key] = Future()
                mine = True
        if mine:
            try:
                future.set_result(self._fetch(name, index))
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    def _fetch(self, name: str, index: int) -> bytes:
        record = self.body["files"][name]
        at, length = _integrity.pieces(record)[index]
        try:
            data = self.storage.fs.cat_file(f"{self._base}/{name}", start=at, end=at + length)
        except FileNotFoundError:
            raise _gone(self.where, name) from None
        if len(data) != length:
            problem: str | None = (
                f"is shorter than the manifest says (piece {index + 1} has {len(data)} of {length} bytes)"
            )
        else:
            problem = _integrity.piece_problem(record, index, data)
        if problem is not None:
            raise _integrity.Damaged(f"{self._shown}/{name} {problem}; the checkpoint is damaged", problem)
        return bytes(data)

    @contextlib.contextmanager
    def piece(self, name: str, index: int) -> Iterator[bytes]:
        yield self._read(name, index)

    def to_verify(self, names: list[str], reads: list[str], rank: int, world_size: int) -> tuple[list[str], list[str]]:
        """What this rank reads, whole (each rank checks its own bytes: the network gave each its own copy); of the
        others, their sizes (one listing gave them)."""
        return reads, [name for name in names if name not in reads]

    def reading(self, name: str, offset: int, length: int) -> list[int]:
        record = self.body["files"].get(name)
        if record is None or not length:
            return []
        piece = record["piece"]
        return list(range(offset // piece, (offset + length - 1) // piece + 1))

    def opener(self, name: str) -> IO[bytes]:
        return io.BufferedReader(_Reader(self, name), buffer_size=1 << 20)

    def check_same(self, name: str) -> None:
        pass  # the folder's objects are written once: the pieces read were verified

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[IO[bytes]]:
        with self.opener(name) as stream:
            yield stream

    def pread(self, name: str, length: int, offset: int) -> bytes:
        out = bytearray(length)
        _Reader(self, name).readinto_at(offset, memoryview(out))
        return bytes(out)

    def read_bytes(self, name: str) -> bytes:
        return self.pread(name, self.size(name), 0)

    def close(self) -> None:
        self._pieces = {}


class _Reader(io.RawIOBase):
    """A file of a remote snapshot, read from its verified pieces (``readinto`` copies straight into the caller's
    memory: ``torch.load`` reads tensors' bytes so)."""

    def __init__(self, snapshot: RemoteSnapshot, name: str) -> None:
        super().__init__()
        self._snapshot, self._name, self._at = snapshot, name, 0
        self._record = snapshot.body["files"][name]
        self._size = int(self._record["size"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence] + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer).cast("B") as view:
            n = self.readinto_at(self._at, view)
        self._at += n
        return n

    def readinto_at(self, at: int, view: memoryview) -> int:
        """Copy the bytes from ``at`` on into ``view`` (up to the end of the file); how many."""
        end, piece, done = min(self._size, at + len(view)), int(self._record["piece"]), 0
        while at < end:
            index, start = divmod(at, piece)
            with memoryview(self._snapshot._read(self._name, index)) as data:
                take = min(end - at, len(data) - start)
                view[done : done + take] = data[start : start + take]
            at, done = at + take, done + take
        return done


def _still(storage: RemoteStorage, body: dict[str, Any]) -> bool:
    """Whether ``body`` is still the manifest of ``storage``."""
    try:
        return storage.manifest() == body
    except CheckpointError:
        return False


def _gone(where: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"{where} was replaced or removed while it was being loaded ({name} is gone: a save into the same "
        f"directory, or keep_last pruning it); nothing was changed: load it again"
    )
