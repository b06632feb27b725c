"""The integrity of a checkpoint's files: their record in the manifest, the hash, and one verifier.

A file is cut into pieces of :data:`PIECE` bytes (the last one shorter), and each piece gets the
128-bit XXH3 hash of its bytes (the ``xxhash`` package). XXH3 is a maintained, widely used
non-cryptographic hash (it passes SMHasher), which streams at 10-30 GB/s per core; at 128 bits, a
change of any kind (bit flips that would cancel in a sum, words swapped or moved, a sector copied over
another, a range zeroed) goes unseen with a chance of about 2**-128. Pieces are hashed while the file
is written (:class:`PieceHasher`), and verified apart, on a pool of threads (:class:`Verifier`), and a
mismatch names the piece (its byte range). The size of the file is recorded beside them: a file cut
short or grown is told by its size alone.

A file's record in a manifest is ``{"size": N, "piece": P, "xxh3_128": ["<32 hex digits>", ...]}``,
one digest a piece, in order; an empty file has none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, cast

import xxhash

from ..errors import CheckpointError

__all__ = [
    "KEY",
    "PIECE",
    "Damaged",
    "FileRecord",
    "PieceHasher",
    "Pieces",
    "Verifier",
    "digest",
    "piece_problem",
    "piece_ranges",
    "pieces",
    "share",
    "size_problem",
    "verify",
    "workers",
]

KEY = "xxh3_128"  # the record's key: the kind of checksum and the list of piece digests in one
PIECE = 64 << 20  # bytes a piece
FileRecord = dict[str, Any]  # {"size": int, "piece": int, "xxh3_128": [digest of each piece, ...]}
T = TypeVar("T")


def digest(data: Any) -> str:
    """The XXH3-128 of ``data`` (bytes-like) as 32 hex digits.

    Example:
        >>> digest(b"checksum")
        'f7ebbc702775a286e58dee8cd3da7d5a'
    """
    return xxhash.xxh3_128_hexdigest(data)


def piece_ranges(size: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a file of ``size`` bytes.

    Example:
        >>> piece_ranges(10, piece=4)
        [(0, 4), (4, 4), (8, 2)]
    """
    return [(at, min(piece, size - at)) for at in range(0, size, piece)]


class PieceHasher:
    """The piece digests of bytes written in order, in writes of any size.

    Example:
        >>> h = PieceHasher(piece=4); h.update(memoryview(b"check")); h.update(memoryview(b"sum")); h.digests()
        ['557532b2d9ad09fad9d3799edc385049', '4dd18c04dd50da9c5b60c615fa837725']
    """

    def __init__(self, piece: int | None = None) -> None:
        self.piece = piece or PIECE  # the module's setting when the hasher is made (tests make it smaller)
        self.size = 0
        self._filled = 0
        self._done: list[str] = []
        self._hash = xxhash.xxh3_128()

    def update(self, view: memoryview) -> None:
        """Add the bytes of ``view`` (a byte-format memoryview), which follow those added before."""
        self.size += view.nbytes
        while len(view):
            take = min(len(view), self.piece - self._filled)
            with view[:take] as part:
                self._hash.update(part)
            self._filled += take
            view = view[take:]
            if self._filled == self.piece:
                self._done.append(self._hash.hexdigest())
                self._hash.reset()
                self._filled = 0

    def digests(self) -> list[str]:
        """One digest a piece of everything added so far (a last, partial piece included)."""
        return self._done + ([self._hash.hexdigest()] if self._filled else [])

    def record(self) -> FileRecord:
        """The manifest's record of the bytes added: their size and the digest of each piece."""
        return {"size": self.size, "piece": self.piece, KEY: self.digests()}


def size_problem(size: int, record: FileRecord) -> str | None:
    """Why a file of ``size`` bytes is not the file of ``record`` (truncated, grown), or None."""
    if size != record["size"]:
        return f"is {size} bytes but the manifest says {record['size']} (truncated, grown or overwritten)"
    return None


def pieces(record: FileRecord) -> list[tuple[int, int]]:
    """(offset, length) of each checksummed piece of the file of ``record``."""
    return piece_ranges(record["size"], record["piece"])


def piece_problem(record: FileRecord, index: int, data: Any) -> str | None:
    """Why ``data``, read as piece ``index`` of the file of ``record``, is not that piece, or None."""
    found, expected = digest(data), record[KEY][index]
    if found == expected:
        return None
    at, length = pieces(record)[index]
    return (
        f"has changed bytes in piece {index + 1} of {len(record[KEY])} (bytes {at} to {at + length - 1}): its "
        f"XXH3-128 is {found} but the manifest says {expected}"
    )


class Damaged(CheckpointError):
    """A file read from a snapshot that checks what it reads is not what the manifest says (``problem``)."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


class Pieces(Protocol):
    """What the verifier reads: a checkpoint's files, as a snapshot holds them (see ``_storage.Snapshot``)."""

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def parallel(self) -> int:
        """Pieces read and checked at once."""
        ...

    @property
    def checks_on_read(self) -> bool:
        """Whether piece() itself checks what it reads (raising Damaged): nothing is left to hash here."""
        ...

    def missing(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def piece(self, name: str, index: int) -> AbstractContextManager[Any]: ...


class Verifier:
    """Checks files of a snapshot against the manifest on a pool of threads, while the caller goes on.

    ``names``: files checked whole (size, then every piece); ``sized``: files whose size alone is
    checked. :meth:`add` checks more pieces (a sharded load's ranges, once planned). The first
    problem, in the order the files were given, is the verdict: :meth:`check` raises the error
    ``damaged(name, problem)`` makes of it.
    """

    def __init__(
        self,
        snapshot: Pieces,
        names: Iterable[str],
        sized: Iterable[str] = (),
        damaged: Callable[[str, str], Exception] = lambda name, problem: CheckpointError(f"{name} {problem}"),
    ) -> None:
        self._snapshot, self._files, self._damaged = snapshot, snapshot.body["files"], damaged
        self._order: dict[str, int] = {}
        self._problems: dict[str, tuple[int, str]] = {}  # name -> (first piece found wrong, -1 for its size; what)
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(max(1, snapshot.parallel), thread_name_prefix="accelkit-verify")
        self._done, self.problem = False, cast("tuple[str, str] | None", None)
        self._gone: CheckpointError | None = None  # the checkpoint went away while it was read
        for name in names:
            if self._sized(name):
                self.add(name, range(len(self._files[name][KEY])))
        for name in sized:
            self._sized(name)

    def _sized(self, name: str) -> bool:
        """Check ``name``'s presence and size; whether its pieces are worth reading."""
        self._order.setdefault(name, len(self._order))
        problem: str | None
        try:
            if name not in self._files:
                problem = "is missing from the manifest"
            elif self._snapshot.missing(name):
                problem = "is missing"
            else:
                problem = size_problem(self._snapshot.size(name), self._files[name])
        except OSError as exc:
            problem = f"cannot be read ({exc.strerror or exc})"
        except CheckpointError as exc:  # not damage: the checkpoint was replaced or removed meanwhile
            self._gone = self._gone or exc
            return False
        if problem:
            self._note(name, -1, problem)
        return problem is None

    def add(self, name: str, indices: Iterable[int]) -> None:
        """Check pieces ``indices`` of ``name`` too."""
        self._order.setdefault(name, len(self._order))
        self._futures += [self._pool.submit(self._piece, name, index) for index in indices]

    def _piece(self, name: str, index: int) -> None:
        try:
            with self._snapshot.piece(name, index) as view:
                problem = None if self._snapshot.checks_on_read else piece_problem(self._files[name], index, view)
        except Damaged as exc:
            problem = exc.problem
        except OSError as exc:
            problem = f"cannot be read ({exc.strerror or exc})"
        except CheckpointError as exc:  # not damage: the checkpoint was replaced or removed meanwhile
            self._gone = self._gone or exc
            return
        if problem is not None:
            self._note(name, index, problem)

    def _note(self, name: str, index: int, problem: str) -> None:
        with self._lock:  # the first piece of the file that is wrong
            if self._problems.get(name, (index + 1,))[0] > index:
                self._problems[name] = (index, problem)

    def join(self) -> tuple[str, str] | None:
        """Wait for every check given so far; the first damaged file and what is wrong with it, or None."""
        if not self._done:
            for future in self._futures:
                future.result()
            self._pool.shutdown()
            self._done = True
            bad = sorted(self._problems, key=self._order.__getitem__)
            self.problem = (bad[0], self._problems[bad[0]][1]) if bad else None
        return self.problem

    def check(self) -> None:
        """Wait for the check; raise the error ``damaged`` makes of the first damaged file, if any (or the
        snapshot's error when the checkpoint went away while it was read)."""
        problem = self.join()
        if self._gone is not None:
            raise self._gone
        if problem is not None:
            raise self._damaged(*problem)

    def first(self, step: Callable[[], T]) -> T:
        """``step()``; when it fails, a damaged file this check finds is given as the reason instead."""
        try:
            return step()
        except Exception:
            self.check()
            raise


def verify(snapshot: Pieces, names: Iterable[str]) -> tuple[str, str] | None:
    """The first damaged file of ``names`` in ``snapshot`` and what is wrong with it; None when all verify."""
    return Verifier(snapshot, names).join()


def share(names: list[str], files: dict[str, FileRecord], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` verifies: every listed file goes to one rank, largest first to the least loaded.

    Unlisted names (expected but missing from the manifest) go to every rank. The ranks agree
    on the outcome before anything is applied, so each file is read once in the whole job.
    """
    load, mine = [0] * world_size, []
    for name in sorted((n for n in names if n in files), key=lambda n: (-int(files[n]["size"]), n)):
        least = load.index(min(load))
        load[least] += int(files[name]["size"]) + 1
        if least == rank:
            mine.append(name)
    return [n for n in names if n not in files] + mine


def workers() -> int:
    """Threads a local verification hashes on: the cores, up to 4 (hashing is bound by memory past that)."""
    return max(1, min(4, os.cpu_count() or 1))
