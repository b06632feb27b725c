"""Checkpoints on an object store, through fsspec (``s3://``, ``gs://``, ``az://``, ``memory://``, ...).

An object store has no rename, so a save never moves anything: each writes its files into a folder
of its own inside the checkpoint, ``.accelkit-data-TOKEN/`` (every rank its files, each checksummed
while written and uploaded whole, while the next is written), and once every rank's files are
uploaded the main process writes ``manifest.json``, which names that folder: one object written in
one request, the commit. Until it is there no load sees the save; a save killed at any moment leaves
the previous checkpoint the latest, and its folder is removed by the next save (one listing of the
checkpoints' root). A save into a committed checkpoint replaces its manifest, then removes the
folder the old one named; pruning removes the manifest first, then the files. A load reads the
manifest once and only the folder it names, whose objects no save writes again: a checkpoint
replaced or pruned while it is loaded gives the old one whole, or an error saying it is gone.

fsspec and the store's driver are imported with the first URL (``pip install "accelkit[fsspec]"``:
fsspec and s3fs); credentials and endpoints are the driver's own (for S3: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, profiles, instance roles), or fsspec's config.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from ..errors import CheckpointError
from . import _layout, _manifest
from ._storage import Flusher, HashingWriter, crash_point

__all__ = ["RemoteStaging", "RemoteStorage"]

INSTALL = 'pip install "accelkit[fsspec]"'  # fsspec and s3fs
_DRIVERS = {"gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}


class RemoteStorage:
    """A place on an object store: a checkpoint's prefix, or the root of several."""

    verify_tries = 1  # verifying another checkpoint downloads it whole: only the newest is tried

    def __init__(self, fs: Any, url: str, path: str) -> None:
        self.fs, self.url, self.path = fs, url.rstrip("/"), path.rstrip("/")
        self.name = self.path.rsplit("/", 1)[-1]

    @classmethod
    def open(cls, call: str, url: str, scheme: str) -> RemoteStorage:
        """The place ``url`` names; ImportError or ValueError, before any work, when nothing here serves it."""
        try:
            import fsspec  # type: ignore[import-untyped, import-not-found, unused-ignore]
        except ImportError:
            raise ImportError(
                f"{call}: {url!r} is a URL ({scheme}://): accelkit keeps checkpoints on object stores through fsspec, "
                f"which is not installed: {INSTALL} (or pass a local directory)"
            ) from None
        if scheme not in fsspec.available_protocols():
            raise ValueError(
                f"{call}: {url!r} is a URL ({scheme}://), not a local directory, and no fsspec driver serves "
                f"{scheme}://: nothing was read or written. Pass a local directory, or a URL fsspec serves (s3://, "
                f"gs://, az://, memory://, ...)"
            )
        try:
            fs, path = fsspec.core.url_to_fs(url)
        except ImportError as exc:
            driver = _DRIVERS.get(scheme)
            install = f"pip install {driver}" if driver else INSTALL
            raise ImportError(f"{call}: {url!r} needs fsspec's driver for {scheme}://: {exc}; {install}") from None
        return cls(fs, url, path)

    def __str__(self) -> str:
        return self.url

    def location(self) -> str:
        return self.url

    def absolute(self) -> RemoteStorage:
        return self

    def parent(self) -> RemoteStorage:
        return RemoteStorage(self.fs, self.url.rsplit("/", 1)[0], self.path.rsplit("/", 1)[0])

    def child(self, name: str) -> RemoteStorage:
        return RemoteStorage(self.fs, f"{self.url}/{name}", f"{self.path}/{name}")

    def same(self, other: object) -> bool:
        return isinstance(other, RemoteStorage) and (other.fs, other.path) == (self.fs, self.path)

    def children(self) -> list[RemoteStorage]:
        self.fs.invalidate_cache(self.path)
        try:
            entries = self.fs.ls(self.path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            self.check_access()  # a missing bucket is an error, not a root without checkpoints
            return []
        except Exception:
            self.check_access()  # says so when credentials are the cause
            raise
        names = [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"]
        return [self.child(name) for name in names if not name.startswith(".")]

    def has_manifest(self) -> bool:
        return bool(self.fs.exists(f"{self.path}/{_layout.MANIFEST}"))

    def manifest(self) -> dict[str, Any]:
        where = f"{self.url}/{_layout.MANIFEST}"
        try:
            data = self.fs.cat_file(f"{self.path}/{_layout.MANIFEST}")
        except (FileNotFoundError, NotADirectoryError):
            self.check_access()  # a missing bucket says so
            self.fs.invalidate_cache(self.path)
            if self.fs.isfile(self.path):
                hint = "is an object, not a folder of objects"
            elif self.fs.exists(self.path):
                hint = f"has no {_layout.MANIFEST} (not a committed checkpoint)"
            else:
                hint = "does not exist (never saved, or removed: keep_last prunes the oldest checkpoints beside a save)"
            raise CheckpointError(_manifest.not_a_checkpoint(self.url, hint)) from None
        except Exception:
            self.check_access()  # says so when credentials are the cause
            raise
        return _manifest.parse(data, where)

    def listing(self, folder: str) -> dict[str, int]:
        """The size of every object in ``folder`` of this checkpoint, by its name relative to the folder."""
        base = f"{self.path}/{folder}".rstrip("/")
        self.fs.invalidate_cache(base)
        found = self.fs.find(base, detail=True)
        return {path[len(base) + 1 :]: int(info["size"]) for path, info in found.items() if info["type"] == "file"}

    def missing_or_cut(self, body: dict[str, Any]) -> str:
        folder = body.get("folder", "")
        sizes = self.listing(folder)
        for name, record in body["files"].items():
            where = f"{self.url}/{folder}/{name}" if folder else f"{self.url}/{name}"
            if name not in sizes:
                return f"{where} is missing"
            if sizes[name] != record["size"]:
                return f"{where} is {sizes[name]} bytes, not {record['size']}"
        return ""

    def snapshot(self) -> Any:
        from ._remote_snapshot import RemoteSnapshot

        return RemoteSnapshot.take(self)

    def check_access(self) -> None:
        """The bucket (or container) exists and answers this process's credentials."""
        if self.fs.root_marker:  # a filesystem without buckets (memory://): nothing to reach
            return
        bucket = self.path.split("/", 1)[0]
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.url}: the bucket {bucket!r} does not exist (or these credentials may not see it): nothing "
                f"was read or written; create it, or pass a URL in a bucket that exists"
            ) from None
        except Exception as exc:
            raise CheckpointError(
                f"{self.url}: the bucket {bucket!r} cannot be reached ({type(exc).__name__}: {exc}): nothing was read "
                f"or written; give this process credentials that reach it, as the store's driver reads them (for "
                f"s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile or an instance role; "
                f"AWS_ENDPOINT_URL_S3 for another S3 server), or fsspec's configuration"
            ) from None

    def begin(self, token: str) -> RemoteStaging:
        self.fs.invalidate_cache(self.path)
        if self.fs.isfile(self.path):
            raise CheckpointError(f"{self.url} exists and is an object, not a checkpoint; save elsewhere or remove it")
        ours = (_layout.MANIFEST, _layout.DATA)
        others = [name for name in self._names(self.path) if not name.startswith(ours)]
        if others or (self.has_manifest() and not _is_checkpoint(self)):
            raise CheckpointError(f"{self.url} exists and is not an accelkit checkpoint; save elsewhere or remove it")
        self._remove_leftovers()
        return self.staging(token)

    def _names(self, path: str) -> list[str]:
        try:
            return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _remove_leftovers(self) -> None:
        """Remove the folders of saves that never committed, and of checkpoints replaced, beside this one."""
        root = self.parent()
        self.fs.invalidate_cache(root.path)
        try:
            found = self.fs.find(root.path)
        except FileNotFoundError:
            return
        folders: dict[str, set[str]] = {}  # checkpoint -> its data folders
        committed: set[str] = set()
        for path in found:
            parts = path[len(root.path) + 1 :].split("/")
            if len(parts) >= 3 and parts[1].startswith(_layout.DATA):
                folders.setdefault(parts[0], set()).add(parts[1])
            elif parts[1:] == [_layout.MANIFEST]:
                committed.add(parts[0])
        for name, data in folders.items():
            keep: set[str] = set()
            if name in committed:
                try:
                    keep = {root.child(name).manifest().get("folder", "")}
                except CheckpointError:
                    continue  # a damaged manifest: its files are left as they are
            for folder in sorted(data - keep):
                self.fs.rm(f"{root.path}/{name}/{folder}", recursive=True)

    def staging(self, token: str) -> RemoteStaging:
        return RemoteStaging(self, _layout.data_folder(token))

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.path}/{_layout.MANIFEST}")  # no longer committed: then its files go
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path, recursive=True)

    def write_whole(self, name: str, data: bytes | Callable[[IO[bytes]], object]) -> str:
        """One object, uploaded whole (a reader sees the old one or the new one)."""
        if isinstance(data, (bytes, bytearray)):
            self.fs.pipe_file(f"{self.path}/{name}", data)
            return f"{self.url}/{name}"
        with tempfile.TemporaryDirectory(prefix="accelkit-upload-") as folder:
            local = os.path.join(folder, name)
            with open(local, "wb") as f:  # f.name: the path, for writers that only take one
                data(f)
            self.fs.put_file(local, f"{self.path}/{name}")
        return f"{self.url}/{name}"


def _is_checkpoint(storage: RemoteStorage) -> bool:
    try:
        storage.manifest()
    except CheckpointError:
        return False
    return True


class _Buffer:
    """A file in memory, uploaded whole once written (the store's driver uploads its parts at once)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: Any) -> int:
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass


class RemoteStaging:
    """One save's folder of files on an object store, committed by the manifest written beside it."""

    def __init__(self, storage: RemoteStorage, folder: str) -> None:
        self.storage, self.folder, self.where = storage, folder, f"{storage.url}/{folder}"
        self.what = f"the save's folder {folder}"
        self._base, self._written, self._flusher = f"{storage.path}/{folder}", set[str](), Flusher()

    @contextlib.contextmanager
    def create(self, name: str, on_first_write: Callable[[], None] | None = None) -> Iterator[HashingWriter]:
        label = name.rsplit("/", 1)[-1]
        crash_point(f"before-file:{label}")
        buffer = _Buffer()
        yield HashingWriter(buffer, label, on_first_write)
        self._written.add(name)

        def upload() -> None:
            self.storage.fs.pipe_file(f"{self._base}/{name}", buffer.data)
            crash_point(f"after-file:{label}")

        self._flusher.submit(upload)

    def mkdir(self, name: str) -> None:
        pass  # an object store has no folders: a name with slashes is enough

    def exists(self, name: str) -> bool:
        return name in self._written  # the folder is this save's alone

    def rename(self, name: str, new_name: str) -> None:
        self._flusher.wait()
        self.storage.fs.mv(f"{self._base}/{name}", f"{self._base}/{new_name}")
        self._written = (self._written - {name}) | {new_name}

    def remove(self, name: str) -> None:
        self._flusher.wait()
        self.storage.fs.rm_file(f"{self._base}/{name}")
        self._written.discard(name)

    def listdir(self, name: str) -> list[str]:
        self._flusher.wait()
        return self.storage._names(f"{self._base}/{name}")

    def finish_folder(self, name: str) -> None:
        pass

    def wait(self) -> None:
        self._flusher.wait()

    def commit(self, manifest: bytes) -> None:
        """Upload the manifest once every file is uploaded: the commit. Then the folder it replaced goes."""
        storage = self.storage
        crash_point("before-manifest")
        self._flusher.wait()
        try:
            before = storage.manifest().get("folder") if storage.has_manifest() else None
        except CheckpointError:
            before = None
        storage.fs.pipe_file(f"{storage.path}/{_layout.MANIFEST}", manifest)
        crash_point("after-manifest")
        if before and before != self.folder:
            with contextlib.suppress(Exception):  # committed already: a folder left behind, the next save removes it
                storage.fs.rm(f"{storage.path}/{before}", recursive=True)

    def discard(self) -> None:
        """Remove this save's folder, unless its manifest made it the checkpoint (a failure after the commit)."""
        with contextlib.suppress(CheckpointError):
            if self.storage.manifest().get("folder") == self.folder:
                return
        with contextlib.suppress(FileNotFoundError):
            self.storage.fs.rm(self._base, recursive=True)

    def __enter__(self) -> RemoteStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self._flusher.__exit__(*exc)  # type: ignore[arg-type]
