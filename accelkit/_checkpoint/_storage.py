"""Where checkpoints live: the seam between the commit protocol and the place that holds the bytes.

Two kinds serve it: a local folder (``_local``: directory descriptors, fsync, an atomic rename,
loads through the files held open) and an object store through fsspec (``_remote``: ``s3://``,
``gs://``, ``az://``, ``memory://``, any protocol fsspec has a driver for; each save writes its
files into a folder of its own and the manifest, written last, is the commit). ``_where`` picks
one from what the user passed, before any work.

The save's steps call :func:`crash_point` at the moments tests break into (``before-file:NAME``,
``mid-file:NAME``, ``after-file:NAME``, ``before-manifest``, then ``before-rename`` and
``after-rename`` locally or ``after-manifest`` on an object store, and ``prune:NAME``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

from . import _integrity

__all__ = [
    "Flusher",
    "HashingWriter",
    "Snapshot",
    "Staging",
    "Storage",
    "crash_point",
]

# Tests set this to raise or to kill the process at a named moment of a save (see the module's docstring).
crash_hook: Callable[[str], None] | None = None


def crash_point(label: str) -> None:
    if crash_hook is not None:
        crash_hook(label)


def _write(f: Any, data: Any) -> Any:
    """One write to an open file (a seam: tests replace it to simulate a full disk)."""
    return f.write(data)


class HashingWriter:
    """A file-like object that checksums and counts what passes through it to ``f`` (a fresh file)."""

    def __init__(self, f: Any, label: str, on_first_write: Callable[[], None] | None = None) -> None:
        self._f, self._label, self._on_first_write = f, label, on_first_write
        self._hash, self._started = _integrity.PieceHasher(), False

    @property
    def size(self) -> int:
        return self._hash.size

    def write(self, data: Any) -> int:
        first = self._on_first_write
        if first is not None:
            self._on_first_write = None
            first()
        view = memoryview(data).cast("B")
        n = _write(self._f, view)
        self._hash.update(view)
        if not self._started:
            self._started = True
            self._f.flush()  # so that a crash here really leaves a partial file
            crash_point(f"mid-file:{self._label}")
        return int(n) if n is not None else view.nbytes

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size  # the file was created empty and is only appended to

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        """Flush only: the storage finishes the file (fsync or upload) when its block ends."""
        self._f.flush()

    def record(self) -> _integrity.FileRecord:
        return self._hash.record()


class Flusher:
    """Finishes files on threads of their own (an fsync, an upload), at the same time as each other and the next writes.

    :meth:`wait` (or the end of a ``with`` block) waits for all of them and raises the first
    failure: past it, everything given to the flusher is durable.
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def submit(self, finish: Callable[[], None]) -> None:
        def run() -> None:
            try:
                finish()
            except BaseException as exc:  # raised by wait(), on the thread that saves
                self._errors.append(exc)

        thread = threading.Thread(target=run, name="accelkit-fsync")
        thread.start()
        self._threads.append(thread)

    def wait(self) -> None:
        """Wait for every file given so far; raise the first failure."""
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


class Snapshot(_integrity.Pieces, Protocol):
    """A committed checkpoint held for one load: its manifest (``body``) and the files it lists.

    What is read through it is the checkpoint whose manifest was read, or an error saying it was
    replaced or removed meanwhile: never a mix.
    """

    @property
    def where(self) -> str:
        """The checkpoint, for messages: a path or a URL."""
        ...

    @property
    def storage(self) -> Storage: ...

    def to_verify(self, names: list[str], reads: list[str], rank: int, world_size: int) -> tuple[list[str], list[str]]:
        """Of a checkpoint's files ``names``, those ``rank`` checks whole and those whose size alone it checks
        (``reads``: the files it reads whole)."""
        ...

    def reading(self, name: str, offset: int, length: int) -> list[int]:
        """The pieces of ``name`` to check before ``length`` bytes at ``offset`` are read in place (after the check)."""
        ...

    def opener(self, name: str) -> str | IO[bytes]:
        """What ``torch.load`` reads the file ``name`` from: a path to map, or a file object."""
        ...

    def check_same(self, name: str) -> None: ...
    def read_bytes(self, name: str) -> bytes: ...
    def pread(self, name: str, length: int, offset: int) -> bytes: ...
    def stream(self, name: str) -> AbstractContextManager[IO[bytes]]: ...
    def close(self) -> None: ...


class Staging(Protocol):
    """One save's files before its commit: every rank writes its own, no load sees them until :meth:`commit`."""

    @property
    def where(self) -> str: ...

    @property
    def what(self) -> str:
        """The save's files, as messages name them ("the temporary directory .accelkit-tmp-...")."""
        ...

    @property
    def folder(self) -> str | None:
        """The manifest's name for the folder of the files, where they are not beside it."""
        ...

    def create(
        self, name: str, on_first_write: Callable[[], None] | None = None
    ) -> AbstractContextManager[HashingWriter]:
        """A new file ``name``, checksummed while written; durable once :meth:`wait` has returned.

        ``on_first_write`` runs once, before its first byte.
        """
        ...

    def mkdir(self, name: str) -> None: ...
    def exists(self, name: str) -> bool: ...
    def rename(self, name: str, new_name: str) -> None: ...
    def remove(self, name: str) -> None: ...
    def listdir(self, name: str) -> list[str]: ...
    def finish_folder(self, name: str) -> None: ...

    def wait(self) -> None:
        """Every file created so far is durable (fsynced, uploaded); raise the first failure."""
        ...

    def commit(self, manifest: bytes) -> None:
        """Main process: write the manifest, the commit; the checkpoint is whole from then on."""
        ...

    def discard(self) -> None:
        """Main process: remove what a failed save wrote."""
        ...

    def __enter__(self) -> Staging: ...
    def __exit__(self, *exc: object) -> None: ...


class Storage(Protocol):
    """A place for checkpoints: a checkpoint's own (``ckpt/step-1``) or the root that holds several."""

    @property
    def name(self) -> str: ...

    @property
    def verify_tries(self) -> int:
        """Whole checkpoints verified, newest first, to name one to load instead of a damaged one."""
        ...

    def location(self) -> Path | str:
        """What the user is given back: a local path, or the URL."""
        ...

    def absolute(self) -> Storage:
        """The same place, named absolutely (what a save agrees on between ranks)."""
        ...

    def parent(self) -> Storage: ...
    def child(self, name: str) -> Storage: ...
    def same(self, other: Storage) -> bool: ...
    def children(self) -> Sequence[Storage]: ...
    def has_manifest(self) -> bool: ...

    def manifest(self) -> dict[str, Any]:
        """The manifest's body; CheckpointError if this is not a committed checkpoint (saying what is there)."""
        ...

    def missing_or_cut(self, body: dict[str, Any]) -> str:
        """The first listed file missing or not of its size ("" when none): a cheap check, no byte read."""
        ...

    def snapshot(self) -> Snapshot: ...

    def check_access(self) -> None:
        """Raise, saying why, when this place cannot be written (no bucket, no credentials): before any work."""
        ...

    def begin(self, token: str) -> Staging:
        """Main process: check the target, remove what crashed saves left beside it, and open the save's files."""
        ...

    def staging(self, token: str) -> Staging:
        """Every other rank: the save's files that :meth:`begin` opened on the main process."""
        ...

    def remove(self) -> None:
        """Delete this committed checkpoint, never leaving part of it that looks whole."""
        ...

    def write_whole(self, name: str, data: bytes | Callable[[IO[bytes]], object]) -> Path | str:
        """Replace the file ``name`` with ``data`` (or what the function writes; ``f.name`` is a path) at once."""
        ...
