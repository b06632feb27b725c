"""Checksums of checkpoint files: XXH3-128 (the ``xxhash`` package) of each fixed-size piece of a file.

A file is cut into pieces of :data:`PIECE` bytes (the last one shorter), and each piece gets the
128-bit XXH3 hash of its bytes. XXH3 is a maintained, widely used non-cryptographic hash (it passes
SMHasher), which streams at 10-30 GB/s per core; at 128 bits, a change of any kind (bit flips
that would cancel in a sum, words swapped or moved, a sector copied over another, a range zeroed)
goes unseen with a chance of about 2**-128. Pieces are hashed while the file is written, and
verified apart, on several threads, and a mismatch names the piece (its byte range). The size of
the file is recorded beside them: a file cut short or grown is told by its size alone.

A file's record in a manifest is ``{"size": N, "xxh3_128": ["<32 hex digits>", ...]}``, one digest
a piece, in order; an empty file has none.
"""

from __future__ import annotations

from typing import Any

import xxhash

__all__ = ["KEY", "PIECE", "PieceHasher", "digest", "piece_ranges"]

KEY = "xxh3_128"  # the record's key: the kind of checksum and the list of piece digests in one
PIECE = 64 << 20  # bytes a piece


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
        self._filled = 0
        self._done: list[str] = []
        self._hash = xxhash.xxh3_128()

    def update(self, view: memoryview) -> None:
        """Add the bytes of ``view`` (a byte-format memoryview), which follow those added before."""
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
