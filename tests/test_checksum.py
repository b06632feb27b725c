"""``sum64``, the checkpoint files' checksum, against a plain-Python reading of its definition.

The reference here is written from the definition in ``accelkit._checksum``'s docstring, word by
word with Python integers; accelkit computes it with torch reductions, in writes of any size
and in pieces on several threads, which must all agree with it (tests the CPU).
"""

from __future__ import annotations

import itertools
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as hs

from accelkit import _checksum

MASK = (1 << 64) - 1


def reference(data: bytes) -> str:
    """sum64 by its definition: zero-padded 512-byte sectors of little-endian words, weighted sums mod 2**64."""
    data += bytes(-len(data) % 512)
    total = 0
    for i in range(len(data) // 512):
        sector = sum(struct.unpack("<64Q", data[i * 512 : (i + 1) * 512])) & MASK
        weight = ((i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & MASK) | 1
        total = (total + sector * weight) & MASK
    return f"sum64:{total:016x}"


def of_bytes(data: bytes) -> str:
    """accelkit's sum64 of ``data``, written in one piece."""
    hasher = _checksum.Sum64()
    hasher.update(memoryview(data))
    return hasher.hexdigest()


def _cuts(draw_sizes: list[int], n: int) -> list[int]:
    """Split points of ``n`` bytes from drawn sizes (the rest in a last part)."""
    cuts, at = [], 0
    for size in draw_sizes:
        at += size
        if at >= n:
            break
        cuts.append(at)
    return [0, *cuts, n]


@settings(max_examples=60, deadline=None)
@given(data=hs.binary(min_size=0, max_size=3000), sizes=hs.lists(hs.integers(1, 900), max_size=8))
def test_sum64_written_in_any_writes_is_its_definition(data: bytes, sizes: list[int]) -> None:
    hasher = _checksum.Sum64()
    cuts = _cuts(sizes, len(data))
    for start, end in itertools.pairwise(cuts):
        hasher.update(memoryview(data[start:end]))
    assert hasher.hexdigest() == reference(data) == of_bytes(data)


def test_large_writes_are_summed_in_place_and_agree_with_the_definition() -> None:
    rng = random.Random(0)
    data = rng.randbytes(300_000)
    hasher = _checksum.Sum64()
    for start, end in ((0, 7), (7, 100_007), (100_007, 100_100), (100_100, 300_000)):  # small, large, small, large
        hasher.update(memoryview(data)[start:end])
    assert hasher.hexdigest() == reference(data)


@settings(max_examples=40, deadline=None)
@given(data=hs.binary(min_size=1, max_size=5000), sectors=hs.lists(hs.integers(1, 4), max_size=6), seed=hs.integers())
def test_pieces_in_any_order_give_the_whole_files_checksum(data: bytes, sectors: list[int], seed: int) -> None:
    cuts = _cuts([s * 512 for s in sectors], len(data))
    parts = list(itertools.pairwise(cuts))
    random.Random(seed).shuffle(parts)  # as the verifying threads finish them
    for recorded in (reference(data), f"crc32:{zlib.crc32(data):08x}"):
        pieces = _checksum.pieces_for(recorded)
        assert pieces is not None
        for start, end in parts:
            pieces.add(memoryview(data)[start:end], start)
        assert pieces.hexdigest() == recorded


@settings(max_examples=60, deadline=None)
@given(data=hs.binary(min_size=1, max_size=2048), bit=hs.integers(min_value=0))
def test_every_single_bit_flip_changes_the_checksum(data: bytes, bit: int) -> None:
    bit %= len(data) * 8
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert of_bytes(bytes(flipped)) != of_bytes(data)


def test_moved_zeroed_and_replaced_sectors_change_the_checksum() -> None:
    rng = random.Random(1)
    data = rng.randbytes(8 * 512)
    sector = [data[i * 512 : (i + 1) * 512] for i in range(8)]
    swapped = b"".join([sector[1], sector[0], *sector[2:]])
    zeroed = b"".join([*sector[:3], bytes(512), *sector[4:]])
    stale = b"".join([*sector[:5], rng.randbytes(512), *sector[6:]])
    seen = {of_bytes(d) for d in (data, swapped, zeroed, stale)}
    assert len(seen) == 4


def test_a_checksum_of_an_unknown_kind_is_not_computed() -> None:
    assert _checksum.pieces_for("sha256:00") is None


def test_checksumming_read_only_memory_warns_nothing(tmp_path: Path) -> None:
    """torch warns when a tensor views read-only memory (the bytes torch.save writes, a mapped file)."""
    script = (
        "import warnings, torch, accelkit as ak\n"
        "warnings.simplefilter('error')\n"
        f"ak.save_state({str(tmp_path / 'c')!r}, model=torch.nn.Linear(300, 300), step=1)\n"
        f"assert ak.load_state({str(tmp_path / 'c')!r}, model=torch.nn.Linear(300, 300)) == {{'step': 1}}\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
