"""Checksums of checkpoint files: ``sum64``, computed by torch at memory speed, and CRC-32 of older files.

``sum64`` reads a file's bytes, zero-padded to whole 512-byte sectors, as little-endian 64-bit
words. It sums each sector's words, then adds up the sums, each times an odd multiplier that
depends on the sector's position, all modulo 2**64. Any change of one bit changes it, and so
does a sector overwritten with other bytes, a sector of zeros or a sector moved elsewhere,
except with a chance of about 2**-64. The file's size is recorded and checked beside it. What it
trades for speed: changes that cancel inside one sector (words swapped within it, or the same
bit set in one word and cleared in another) leave it as it was, where CRC-32 sees them.

Two reductions of torch's (a sum per sector, then a weighted sum of those) make ``sum64`` run at
15-20 GB/s on one core; zlib's CRC-32 runs at about 4. It can be computed over any split of a
file into whole sectors and the parts added, so a file is checksummed while it is written and
verified in pieces on several threads.

A record's checksum names its kind (``"sum64:..."``). Checkpoints written before ``sum64``
carry ``"crc32:..."`` and are verified with CRC-32, in pieces too (:func:`crc32_combine`).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from typing import Any

__all__ = ["SECTOR", "Pieces", "Sum64", "crc32_combine", "pieces_for", "sectors_sum"]

SECTOR = 512
_MASK = (1 << 64) - 1
_GATHER = 64 << 10  # writes smaller than this are gathered before torch sums them
_BLOCK = 1 << 18  # sectors summed at a time (128 MB): 2 MB of sums and as many weights
_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / golden ratio, as torch's signed int64
_OFFSET = 0x632BE59BD9B4E019


@functools.cache
def _quiet_frombuffer() -> None:
    """torch warns (once) when a tensor views read-only memory: the tensors here only read it.

    One narrow filter, added once: ``catch_warnings`` would save and restore the whole filter
    list, which races with other threads (these sums run on a checkpoint's threads).
    """
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def sectors_sum(data: Any, first: int) -> int:
    """``sum64``'s part for ``data`` (bytes-like, whole sectors) that starts at sector ``first`` of its file."""
    import torch

    _quiet_frombuffer()
    if not len(data):
        return 0
    sectors = torch.frombuffer(data, dtype=torch.int64).view(-1, SECTOR // 8)  # viewed, not copied
    total = 0
    for start in range(0, len(sectors), _BLOCK):  # a write may be one whole tensor: bounded temporaries
        sums = sectors[start : start + _BLOCK].sum(1)
        at = first + start
        weights = torch.arange(at, at + len(sums), dtype=torch.int64).mul_(_MULTIPLIER).add_(_OFFSET)
        total += int(sums.mul_(weights.bitwise_or_(1)).sum())
    del sectors  # lets go of the caller's buffer
    return total & _MASK


def _padded(data: Any, first: int) -> int:
    """:func:`sectors_sum` of ``data`` of any length: its last, partial sector zero-padded."""
    view = memoryview(data).cast("B")
    whole = len(view) - len(view) % SECTOR
    with view[:whole] as head:
        value = sectors_sum(head, first)
    if whole == len(view):
        return value
    tail = bytes(view[whole:]) + bytes(SECTOR - (len(view) - whole))
    return (value + sectors_sum(tail, first + whole // SECTOR)) & _MASK


def _text(value: int) -> str:
    return f"sum64:{value:016x}"


class Sum64:
    """``sum64`` of bytes written in order, in writes of any size (gathered to whole sectors).

    Example:
        >>> h = Sum64(); h.update(memoryview(b"check")); h.update(memoryview(b"sum")); h.hexdigest()
        'sum64:5aa0d82fc0d9d1ab'
    """

    def __init__(self) -> None:
        self._value, self._sectors, self._pending = 0, 0, bytearray()

    def update(self, view: memoryview) -> None:
        """Add the bytes of ``view`` (a byte-format memoryview), which follow those added before."""
        pending = self._pending
        if len(view) < _GATHER:
            pending += view
            if len(pending) >= _GATHER:
                self._flush()
            return
        head = -len(pending) % SECTOR
        pending += view[:head]
        self._flush()
        whole = head + (len(view) - head) // SECTOR * SECTOR
        with view[head:whole] as middle:
            self._add(middle)
        pending += view[whole:]

    def _flush(self) -> None:
        whole = len(self._pending) // SECTOR * SECTOR
        if whole:
            with memoryview(self._pending) as view, view[:whole] as head:
                self._add(head)
            del self._pending[:whole]

    def _add(self, whole_sectors: memoryview) -> None:
        self._value = (self._value + sectors_sum(whole_sectors, self._sectors)) & _MASK
        self._sectors += len(whole_sectors) // SECTOR

    def hexdigest(self) -> str:
        """The checksum of everything added so far, as a manifest records it."""
        return _text((self._value + _padded(self._pending, self._sectors)) & _MASK)


class Pieces:
    """A file's checksum from pieces computed apart (any order, any thread), of the kind ``recorded`` names."""

    def __init__(self, recorded: str) -> None:
        self.crc32 = recorded.startswith("crc32:")
        self._parts: dict[int, tuple[int, int]] = {}  # offset -> (length, value)

    def add(self, data: Any, offset: int) -> None:
        """Checksum the piece ``data`` found at ``offset`` (a multiple of SECTOR) of the file."""
        value = zlib.crc32(data) if self.crc32 else _padded(data, offset // SECTOR)
        self._parts[offset] = (len(data), value)

    def hexdigest(self) -> str:
        """The checksum of the whole file, once every piece of it is added."""
        total = 0
        for offset in sorted(self._parts):
            length, value = self._parts[offset]
            total = crc32_combine(total, value, length) if self.crc32 else (total + value) & _MASK
        return f"crc32:{total:08x}" if self.crc32 else _text(total)


def pieces_for(recorded: str) -> Pieces | None:
    """Pieces that checksum a file the way ``recorded`` was made, or None for a kind not known here."""
    return Pieces(recorded) if recorded.startswith(("sum64:", "crc32:")) else None


_POLY = 0xEDB88320  # CRC-32's polynomial, in zlib's reflected bit order


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo CRC-32's polynomial (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n() -> list[int]:
    table = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length (zlib's ``crc32_combine``).

    Example:
        >>> crc32_combine(zlib.crc32(b"check"), zlib.crc32(b"sum"), 3) == zlib.crc32(b"checksum")
        True
    """
    n, k, x = len2, 3, 1 << 31  # x^(8 * len2): a shift of crc1 past B's bytes
    while n:
        if n & 1:
            x = _multmodp(_X2N[k & 31], x)
        n, k = n >> 1, k + 1
    return _multmodp(x, crc1) ^ crc2
