"""Checkpoints in a local folder: fsynced files, a temporary directory renamed into place, loads through open files.

A save (the main process's steps; every rank writes its files into the temporary directory):

1. :meth:`LocalStorage.begin`: remove what crashed saves left beside the target (``.accelkit-tmp-*``,
   ``.accelkit-trash-*``), create the temporary directory.
2. Each file is checksummed while written and fsynced on a thread of its own, at the same time as
   the next file is written (:class:`LocalStaging`).
3. :meth:`LocalStaging.commit`: write the manifest into it, fsync it, the directory and what is still
   being fsynced of the other files (at the same time), then rename it into place in one step (an
   atomic exchange when the target exists), fsync the parent.

A crash before the rename leaves only a hidden temporary directory; after it, the new checkpoint is
whole. Deletions rename first, so that no half-deleted checkpoint looks whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .. import _safe_io
from ..errors import CheckpointError
from . import _layout, _manifest
from ._storage import Flusher, HashingWriter, crash_point

__all__ = ["LocalStaging", "LocalStorage"]


class LocalStorage:
    """A local folder: a checkpoint's, or the root of several."""

    verify_tries = 3

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, path.name

    def __str__(self) -> str:
        return str(self.path)

    def location(self) -> Path:
        return self.path

    def absolute(self) -> LocalStorage:
        return LocalStorage(self.path.absolute())

    def parent(self) -> LocalStorage:
        return LocalStorage(self.path.parent)

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self.path / name)

    def same(self, other: object) -> bool:
        return isinstance(other, LocalStorage) and self.path.resolve() == other.path.resolve()

    def children(self) -> list[LocalStorage]:
        try:
            entries = list(os.scandir(self.path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [self.child(e.name) for e in entries if not e.name.startswith(".") and e.is_dir()]

    def has_manifest(self) -> bool:
        return (self.path / _layout.MANIFEST).is_file()

    def manifest(self, dir_fd: int | None = None) -> dict[str, Any]:
        """The manifest's body (``dir_fd``: the directory, open: read from there even if it was renamed)."""
        where = self.path / _layout.MANIFEST
        try:
            opened = os.open(_layout.MANIFEST if dir_fd is not None else where, os.O_RDONLY, dir_fd=dir_fd)
            with open(opened, "rb") as f:
                data = _manifest.read_capped(f, os.fstat(f.fileno()).st_size, str(where))
        except (FileNotFoundError, NotADirectoryError):
            if not self.path.exists():
                hint = "does not exist (never saved, or removed: keep_last prunes the oldest checkpoints beside a save)"
            elif not self.path.is_dir():
                hint = "is not a directory"
            else:
                hint = f"has no {_layout.MANIFEST} (not a committed checkpoint)"
            raise CheckpointError(_manifest.not_a_checkpoint(str(self.path), hint)) from None
        return _manifest.parse(data, str(where))

    def missing_or_cut(self, body: dict[str, Any]) -> str:
        folder = self.path / body.get("folder", "")  # a checkpoint saved on an object store has one
        for name, record in body["files"].items():
            try:
                size = (folder / name).stat().st_size
            except OSError:
                return f"{folder / name} is missing"
            if size != record["size"]:
                return f"{folder / name} is {size} bytes, not {record['size']}"
        return ""

    def snapshot(self) -> Any:
        from ._snapshot import LocalSnapshot

        return LocalSnapshot.take(self)

    def check_access(self) -> None:
        pass  # a local folder that cannot be written says so, naming it, when the save creates its files

    def begin(self, token: str) -> LocalStaging:
        target = self.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and not (target.is_dir() and (not any(target.iterdir()) or _is_checkpoint(self))):
            raise CheckpointError(f"{target} exists and is not an accelkit checkpoint; save elsewhere or remove it")
        for entry in os.scandir(target.parent):
            if entry.name.startswith(_layout.STALE) and entry.is_dir(follow_symlinks=False):
                remove_tree(Path(entry.path))
        staging = self.staging(token)
        staging.tmp.mkdir()
        return staging

    def staging(self, token: str) -> LocalStaging:
        return LocalStaging(self.path, self.path.with_name(_layout.tmp_name(self.name, token)))

    def remove(self) -> None:
        remove_tree(self.path)

    def write_whole(self, name: str, data: bytes | Callable[[IO[bytes]], object]) -> Path:
        _safe_io.write_atomic(self.path / name, data)
        return self.path / name


def _is_checkpoint(storage: LocalStorage) -> bool:
    try:
        storage.manifest()
    except CheckpointError:
        return False
    return True


class LocalStaging:
    """A save's temporary directory beside its target; its files fsynced by a :class:`Flusher` while the next is
    written, the manifest last, then one rename."""

    def __init__(self, target: Path, tmp: Path) -> None:
        self.target, self.tmp, self.where, self.folder = target, tmp, str(tmp), None
        self.what = f"the temporary directory {tmp.name}"
        self._flusher = Flusher()

    @contextlib.contextmanager
    def create(self, name: str, on_first_write: Callable[[], None] | None = None) -> Iterator[HashingWriter]:
        path = self.tmp / name
        crash_point(f"before-file:{path.name}")
        with naming(path):
            f = open(path, "xb")  # closed below on failure, else once fsynced
            try:
                yield HashingWriter(f, path.name, on_first_write)
                f.flush()
            except BaseException:
                f.close()
                raise
        self._flusher.submit(lambda: _finish(path, f))

    def mkdir(self, name: str) -> None:
        (self.tmp / name).mkdir(parents=True, exist_ok=True)

    def exists(self, name: str) -> bool:
        return (self.tmp / name).exists()

    def rename(self, name: str, new_name: str) -> None:
        os.rename(self.tmp / name, self.tmp / new_name)

    def remove(self, name: str) -> None:
        os.unlink(self.tmp / name)

    def listdir(self, name: str) -> list[str]:
        return sorted(os.listdir(self.tmp / name))

    def finish_folder(self, name: str) -> None:
        _safe_io.fsync_dir(self.tmp / name, self._flusher.submit)

    def wait(self) -> None:
        self._flusher.wait()

    def commit(self, manifest: bytes) -> None:
        """Write the manifest, then move the temporary directory into place in one rename.

        The files still being fsynced, the manifest and the directory are fsynced at the same time,
        and all are durable before the rename.
        """
        tmp, target = self.tmp, self.target
        crash_point("before-manifest")
        with self.create(_layout.MANIFEST) as f:
            f.write(manifest)
        _safe_io.fsync_dir(tmp, self._flusher.submit)
        self._flusher.wait()
        crash_point("before-rename")
        if target.exists() and swap(tmp, target):
            _safe_io.fsync_dir(target.parent)
            crash_point("after-rename")
            remove_tree(tmp)  # now the previous checkpoint
            return
        if target.exists():  # no atomic exchange here: empty or replaced in two renames
            os.rename(target, target.with_name(_layout.trash_name(target.name, os.getpid())))
        os.rename(tmp, target)
        _safe_io.fsync_dir(target.parent)
        crash_point("after-rename")

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # renamed into place before the failure
            shutil.rmtree(self.tmp)

    def __enter__(self) -> LocalStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self._flusher.__exit__(*exc)  # type: ignore[arg-type]


def _finish(path: Path, f: IO[bytes]) -> None:
    with naming(path):
        try:
            os.fsync(f.fileno())
        finally:
            f.close()
    crash_point(f"after-file:{path.name}")


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
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
    hidden = path.with_name(_layout.trash_name(path.name, os.getpid()))
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    shutil.rmtree(hidden, ignore_errors=True)
