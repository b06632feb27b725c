"""Durable, verifiable files: checksummed fsynced writes, atomic replacement and swaps.

Every byte a checkpoint writes goes through :func:`write_file`, which checksums (XXH3-128 of each
piece, :mod:`accelkit._checksum`) while writing and fsyncs before returning, or, given a :class:`Flusher`, on a helper
thread while the next file is written, at the same time as the other fsyncs of the save;
:func:`check_file` verifies a file against its recorded size and checksums.
:func:`crash_point` marks the moments tests break into.
Smaller files (the config file, a worker's failure record, exported weights) are replaced
whole with :func:`write_atomic`: readers see the old file or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from .errors import CheckpointError

__all__ = [
    "CheckpointError",
    "FileRecord",
    "Flusher",
    "HashingWriter",
    "check_file",
    "check_open",
    "crash_point",
    "fsync_dir",
    "open_hashed",
    "swap",
    "write_atomic",
    "write_file",
]

FileRecord = dict[str, Any]  # {"size": int, "piece": int, "xxh3_128": [digest of each piece, ...]}

# Tests set this to raise or to kill the process at a named moment of a save
# ("before-file:NAME", "mid-file:NAME", "after-file:NAME", "before-manifest", "before-rename", ...).
crash_hook: Callable[[str], None] | None = None


def crash_point(label: str) -> None:
    if crash_hook is not None:
        crash_hook(label)


def _write(f: IO[bytes], data: Any) -> int:
    """One write to an open file (a seam: tests replace it to simulate a full disk)."""
    return f.write(data)


class Flusher:
    """Fsyncs files and directories on threads of their own, at the same time as each other and the next writes.

    An fsync mostly waits for the disk; several at once share the filesystem's journal
    commits. :meth:`wait` (or the end of a ``with`` block) waits for all of them and raises
    the first failure: past it, everything given to the flusher is durable.
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def submit(self, sync: Callable[[], None]) -> None:
        def run() -> None:
            try:
                sync()
            except BaseException as exc:  # raised by wait(), on the thread that saves
                self._errors.append(exc)

        thread = threading.Thread(target=run, name="accelkit-fsync")
        thread.start()
        self._threads.append(thread)

    def wait(self) -> None:
        """Wait for every fsync given so far; raise the first failure."""
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def __enter__(self) -> Flusher:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self.wait()
            return
        with contextlib.suppress(BaseException):  # the error on its way out says what went wrong first
            self.wait()


class HashingWriter:
    """A file-like object that checksums and counts what passes through it (to a fresh file)."""

    def __init__(self, f: IO[bytes], label: str, on_first_write: Callable[[], None] | None = None) -> None:
        from . import _checksum

        self._f, self._label, self._on_first_write = f, label, on_first_write
        self._hash, self.size, self._started = _checksum.PieceHasher(), 0, False

    def write(self, data: Any) -> int:
        first = self._on_first_write
        if first is not None:
            self._on_first_write = None
            first()
        view = memoryview(data).cast("B")
        n = _write(self._f, view)
        self._hash.update(view)
        self.size += view.nbytes
        if not self._started:
            self._started = True
            self._f.flush()  # so that a crash here really leaves a partial file
            crash_point(f"mid-file:{self._label}")
        return n

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size  # the file was created empty and is only appended to

    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        """Flush only: :func:`open_hashed` fsyncs and closes the file when its block ends."""
        self._f.flush()

    def record(self) -> FileRecord:
        from ._checksum import KEY

        return {"size": self.size, "piece": self._hash.piece, KEY: self._hash.digests()}


def write_file(
    path: Path,
    produce: Callable[[Any], object],
    on_first_write: Callable[[], None] | None = None,
    flusher: Flusher | None = None,
) -> FileRecord:
    """Create ``path`` (it must not exist) with what ``produce(file)`` writes; fsynced.

    Returns its size and checksum for the manifest. ``on_first_write`` runs once, before the first byte.
    With ``flusher``, the fsync runs on its threads: the file is durable once ``flusher.wait()`` has returned.
    """
    with open_hashed(path, on_first_write, flusher) as writer:
        produce(writer)
    return writer.record()


@contextlib.contextmanager
def open_hashed(
    path: Path, on_first_write: Callable[[], None] | None = None, flusher: Flusher | None = None
) -> Iterator[HashingWriter]:
    """Create ``path`` (it must not exist) and yield a checksumming writer to it; fsynced at the end.

    ``writer.record()`` then gives its size and checksum for the manifest. With ``flusher``,
    the file is fsynced and closed on the flusher's thread instead.
    """
    crash_point(f"before-file:{path.name}")
    with _naming(path):
        f = open(path, "xb")  # closed below on failure, else by _finish
        try:
            yield HashingWriter(f, path.name, on_first_write)
            f.flush()
        except BaseException:
            f.close()
            raise
    if flusher is None:
        _finish(path, f)
    else:
        flusher.submit(lambda: _finish(path, f))


def _finish(path: Path, f: IO[bytes]) -> None:
    with _naming(path):
        try:
            os.fsync(f.fileno())
        finally:
            f.close()
    crash_point(f"after-file:{path.name}")


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError raised in the block names ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc  # name the file in the error
    except RuntimeError as exc:  # torch.save reports a failed write as a RuntimeError
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror, str(path)) from exc
        raise


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


def check_file(path: Path, record: FileRecord) -> str | None:
    """What is wrong with ``path`` against its manifest ``record``, or None if nothing."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return "is missing"
    with f:
        return check_open(f.fileno(), record)


def check_open(fd: int, record: FileRecord) -> str | None:
    """What is wrong with the open file ``fd`` against its manifest ``record``, or None if nothing."""
    size = os.fstat(fd).st_size
    problem = size_problem(size, record)
    if problem is not None or not size:
        return problem
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m, memoryview(m) as whole:
        for index, (at, length) in enumerate(pieces(record)):
            with whole[at : at + length] as view:
                problem = piece_problem(record, index, view)
            if problem is not None:
                return problem
    return None


def size_problem(size: int, record: FileRecord) -> str | None:
    """Why a file of ``size`` bytes is not the file of ``record`` (truncated, grown), or None."""
    if size != record["size"]:
        return f"is {size} bytes but the manifest says {record['size']} (truncated, grown or overwritten)"
    return None


def pieces(record: FileRecord) -> list[tuple[int, int]]:
    """(offset, length) of each checksummed piece of the file of ``record``."""
    from ._checksum import piece_ranges

    return piece_ranges(record["size"], record["piece"])


def piece_problem(record: FileRecord, index: int, data: Any) -> str | None:
    """Why ``data``, read as piece ``index`` of the file of ``record``, is not that piece, or None."""
    from ._checksum import KEY, digest

    found, expected = digest(data), record[KEY][index]
    if found == expected:
        return None
    at, length = pieces(record)[index]
    return (
        f"has changed bytes in piece {index + 1} of {len(record[KEY])} (bytes {at} to {at + length - 1}): its "
        f"XXH3-128 is {found} but the manifest says {expected}"
    )


def fsync_dir(path: Path, flusher: Flusher | None = None) -> None:
    """Make the entries of directory ``path`` (created, renamed files) durable (by ``flusher``)."""
    if flusher is not None:
        flusher.submit(lambda: fsync_dir(path))
        return
    if os.name != "posix":  # Windows cannot open directories; NTFS journals metadata
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap(a: Path, b: Path) -> bool:
    """Exchange directories ``a`` and ``b`` atomically (Linux ``renameat2``); False if unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. a filesystem without exchange
        return False
    raise OSError(err, os.strerror(err), str(a), str(b))


def remove_tree(path: Path) -> None:
    """Delete ``path`` after renaming it out of sight, so that no half-deleted copy looks whole."""
    hidden = path.with_name(f".accelkit-trash-{path.name}-{os.getpid()}")
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    shutil.rmtree(hidden, ignore_errors=True)
