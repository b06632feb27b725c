"""One checkpoint file in, one out, at the speed of the disk: one pass over the bytes each way.

Writing, the bytes are checksummed as they pass to the file (:func:`accelkit._safe_io.write_file`);
``torch.save``'s own CRC-32 of every zip record is turned off for our files, since the manifest's
checksums already cover each byte (hashing twice was a third of the save's time); an older torch (2.4)
has no such setting (``torch.utils.serialization``), and computes it. ``torch.load`` reads such
files as any other. Reading, files are mapped (``torch.load(mmap=True)``)
instead of copied into fresh memory: a module's ``load_state_dict`` copies straight from the page
cache into its parameters. What other objects keep (an optimizer keeps the tensors it is given) is
copied out of the mapping first, so that nothing handed over lives on in a checkpoint's file.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _safe_io, _tree

__all__ = ["load_torch", "no_zip_crc", "owned", "write_bytes", "write_torch"]

_zip_crc = threading.RLock()  # our writers, each turning torch.save's record CRC off for its own files


@contextlib.contextmanager
def no_zip_crc() -> Iterator[None]:
    """``torch.save`` computes no record CRC-32 in the block (DCP's writes: the manifest's covers every byte).

    The setting is process-wide: a ``torch.save`` of another thread in the block writes no record
    CRC either (its file loads all the same).
    """
    config = _serialization_config()
    if config is None:
        yield
        return
    with _zip_crc:
        before, config.save.compute_crc32 = config.save.compute_crc32, False
        try:
            yield
        finally:
            config.save.compute_crc32 = before


def write_torch(path: Path, state: Any, flusher: _safe_io.Flusher | None = None) -> _safe_io.FileRecord:
    """``torch.save(state)`` into the new file ``path``, checksummed while written, fsynced (by ``flusher``)."""
    config = _serialization_config()
    if config is None:
        return _safe_io.write_file(path, lambda f: torch.save(state, f), flusher=flusher)
    with _zip_crc:
        before = config.save.compute_crc32
        restored = False

        def restore() -> None:  # torch.save reads the setting once, when it opens the file: at its first byte
            nonlocal restored  # it is on again for everyone else's torch.save
            if not restored:
                config.save.compute_crc32, restored = before, True

        config.save.compute_crc32 = False
        try:
            return _safe_io.write_file(path, lambda f: torch.save(state, f), restore, flusher)
        finally:
            restore()


def _serialization_config() -> Any:
    """torch's serialization settings (``torch.utils.serialization.config``), or None on an older torch (2.4)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return None
    return config


def write_bytes(path: Path, data: bytes, flusher: _safe_io.Flusher | None = None) -> _safe_io.FileRecord:
    """``data`` into the new file ``path``, checksummed, fsynced (by ``flusher``)."""
    return _safe_io.write_file(path, lambda f: f.write(data), flusher=flusher)


def load_torch(path: str | Path) -> Any:
    """What ``path`` holds, through ``torch.load(weights_only=True)``, its tensors mapped from the file."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def owned(tree: Any) -> Any:
    """``tree`` with every tensor copied out of the file it is mapped from (containers rebuilt alike)."""
    return _tree.apply_to_tensors(torch.Tensor.clone, tree)
