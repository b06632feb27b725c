"""One checkpoint file in, one out, at the speed of the storage: one pass over the bytes each way.

Writing, the bytes are checksummed as they pass to the file (``_storage.HashingWriter``);
``torch.save``'s own CRC-32 of every zip record is turned off for our files, since the manifest's
checksums already cover each byte (hashing twice was a third of the save's time); an older torch (2.4)
has no such setting (``torch.utils.serialization``), and computes it. ``torch.load`` reads such
files as any other. Reading a local file, it is mapped (``torch.load(mmap=True)``) instead of copied
into fresh memory: a module's ``load_state_dict`` copies straight from the page cache into its
parameters. What other objects keep (an optimizer keeps the tensors it is given) is copied out of
the mapping first, so that nothing handed over lives on in a checkpoint's file. A file read from an
object store is read into memory of its own (nothing to copy out).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any, cast

import torch

from .. import _tree
from . import _integrity
from ._storage import Snapshot, Staging

__all__ = ["load_torch", "no_zip_crc", "owned", "write_bytes", "write_torch"]

_zip_crc = threading.RLock()  # our writers, each turning torch.save's record CRC off for its own files


@contextlib.contextmanager
def _crc_off() -> Iterator[Callable[[], None]]:
    """``torch.save`` computes no record CRC-32 until the function yielded is called, or the block ends.

    The setting is process-wide: a ``torch.save`` of another thread meanwhile writes no record CRC
    either (its file loads all the same). torch.save reads it once, when it opens the file.
    """
    config = _serialization_config()
    if config is None:
        yield lambda: None
        return
    with _zip_crc:
        before, restored = config.save.compute_crc32, False

        def restore() -> None:
            nonlocal restored
            if not restored:
                config.save.compute_crc32, restored = before, True

        config.save.compute_crc32 = False
        try:
            yield restore
        finally:
            restore()


@contextlib.contextmanager
def no_zip_crc() -> Iterator[None]:
    """``torch.save`` computes no record CRC-32 in the block (DCP's writes: the manifest's covers every byte)."""
    with _crc_off():
        yield


def write_torch(staging: Staging, name: str, state: Any) -> _integrity.FileRecord:
    """``torch.save(state)`` into the new file ``name`` of ``staging``, checksummed while written.

    The CRC is on again for everyone else's ``torch.save`` from this file's first byte on.
    """
    with _crc_off() as restore, staging.create(name, restore) as f:
        torch.save(state, cast(IO[bytes], f))  # a file-like object: what torch.save writes to
    return f.record()


def _serialization_config() -> Any:
    """torch's serialization settings (``torch.utils.serialization.config``), or None on an older torch (2.4)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return None
    return config


def write_bytes(staging: Staging, name: str, data: bytes) -> _integrity.FileRecord:
    """``data`` into the new file ``name`` of ``staging``, checksummed."""
    with staging.create(name) as f:
        f.write(data)
    return f.record()


def load_torch(snapshot: Snapshot, name: str) -> tuple[Any, bool]:
    """What the file ``name`` holds, through ``torch.load(weights_only=True)``; and whether its tensors are mapped
    from the file (a local file is; one read from an object store is not)."""
    source = snapshot.opener(name)
    mapped = isinstance(source, str)
    return torch.load(source, map_location="cpu", weights_only=True, mmap=mapped), mapped


def owned(tree: Any) -> Any:
    """``tree`` with every tensor copied out of the file it is mapped from (containers rebuilt alike)."""
    return _tree.apply_to_tensors(torch.Tensor.clone, tree)
