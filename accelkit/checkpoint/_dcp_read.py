"""Reading a DCP checkpoint's files into live tensors, each tensor copied once (the end of a sharded load)."""

from __future__ import annotations

import io
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["read_items"]


def read_items(folder: Path, metadata: Any, planner: Any, plan: Any) -> None:
    """What DCP's ``FileSystemReader.read_data`` does, with each tensor copied once.

    DCP stores every tensor as a ``torch.save`` archive, and its reader loads each into a new
    tensor before copying that into the target. Here each file is mapped, an archive's layout
    is read without its data (``map_location="meta"``), and the target copies straight from
    the mapped bytes. An archive laid out otherwise (another byte order, a compressed record)
    is loaded as DCP loads it.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list[Any]] = {}
    for item in plan.items:
        per_file.setdefault(str(metadata.storage_data[item.storage_index].relative_path), []).append(item)
    for name, items in per_file.items():
        path = folder / name
        mapped = torch.UntypedStorage.from_file(str(path), False, path.stat().st_size)
        with open(path, "rb") as f:
            for item in items:
                info = metadata.storage_data[item.storage_index]
                if item.type == LoadItemType.BYTE_IO:
                    f.seek(info.offset)
                    planner.load_bytes(item, io.BytesIO(f.read(info.length)))
                    continue
                source = _mapped_tensor(f, mapped, info.offset, info.length)
                if source is None:  # loaded as DCP loads it
                    archive: Any = _Slice(f, info.offset, info.length)
                    source = torch.load(archive, map_location="cpu", weights_only=True)
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    source = source.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise ValueError(
                        f"{item.storage_index.fqn} in {name} is {tuple(source.size())}, not {tuple(target.size())}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)


def _mapped_tensor(f: Any, mapped: Any, offset: int, length: int) -> torch.Tensor | None:
    """The tensor ``torch.save`` archived at ``offset`` in ``f``, over ``mapped`` (the file, mapped); None when
    its archive is not one plain, uncompressed record in this host's byte order."""
    archive: Any = _Slice(f, offset, length)  # a file of its own, to torch.load and zipfile
    layout = torch.load(archive, map_location="meta", weights_only=True)  # reads no data
    archive.seek(0)
    with zipfile.ZipFile(archive) as zipped:  # its records' CRC-32 is not written (checksummed as a whole)
        records = {info.filename.partition("/")[2]: info for info in zipped.infolist()}
    data = [info for name, info in records.items() if name.startswith("data/")]
    if not isinstance(layout, torch.Tensor) or len(data) != 1 or data[0].file_size != layout.untyped_storage().nbytes():
        return None
    order = records.get("byteorder")  # none: the host's order, as torch reads it
    if order is not None:
        at = _record_start(archive, order)
        if at is None:
            return None
        archive.seek(at)
        if archive.read(order.file_size) != sys.byteorder.encode():
            return None
    start = _record_start(archive, data[0])
    if start is None:
        return None
    storage = mapped[offset + start : offset + start + data[0].file_size]
    return torch.empty(0, dtype=layout.dtype).set_(storage, layout.storage_offset(), layout.size(), layout.stride())


def _record_start(archive: Any, record: zipfile.ZipInfo) -> int | None:
    """Where the bytes of ``record`` start in ``archive``; None unless they are stored as they are, inside it."""
    archive.seek(record.header_offset)
    header = archive.read(30)  # the record's local header; its name and extra field follow
    if record.compress_type != zipfile.ZIP_STORED or len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    start = record.header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
    return start if start + record.file_size <= archive.seek(0, io.SEEK_END) else None


class _Slice(io.RawIOBase):
    """``length`` bytes of the open file ``f`` from ``offset``, as a file of their own (one DCP item)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._offset, self._length, self._at = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, at: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, base + at)
        return self._at

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view:
            wanted = max(0, min(len(view), self._length - self._at))
            self._f.seek(self._offset + self._at)
            got = self._f.readinto(view[:wanted])
        self._at += got
        return int(got)
