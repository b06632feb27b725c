"""How a call's token travels with the data, and how every rank reads the verdict from it.

- **Bits**, for reductions: the token's 64 bits as elements of the message's dtype, reduced along
  with the data. A sum adds bits (0 or 1): each comes out 0 or the world size exactly when every
  rank sent the same token. Max, min and product (booleans are reduced as bytes with max or min)
  carry each bit and its complement: a pair comes out as two different values exactly when every
  rank agrees ((1, 1) or (0, 0) otherwise). On the host, each rank compares the bits' bytes with its
  own token's times the world size (or once, with complements): any disagreement leaves a bit
  strictly between 0 and the world size (or a pair alike), which no rank's expectation holds, so
  every rank reads the same verdict.
- **Headers**, for gathers and broadcasts: the call's 64-byte header after the data; every rank
  (a broadcast: every receiver) compares the headers it received with its own.
- **The check**, on its own: the bits as int32 in a small all-reduce (exact at any world size).

The host wire reads the verdict from host values at once; the device wire compares on the device
(the ``_on_device`` forms) and reads the result later (see :mod:`._wire`).
"""

import functools

import torch

from ._signature import AGREE

__all__ = ["EXACT", "bits", "bits_agree_on_device", "bits_bytes", "check_tensor", "headers_agree_on_device",
           "logic", "tables", "token_bytes"]  # fmt: skip

BITS = 64
Tables = tuple[tuple[bytes, ...], tuple[bytes, ...]]  # per byte value: its bits' bytes, and them times a count
# The largest world size whose count of ones each dtype holds exactly (a bit's sum reaches it).
EXACT = {torch.float16: 2048, torch.bfloat16: 256, torch.float32: 1 << 24, torch.float64: 1 << 53,
         torch.complex64: 1 << 24, torch.complex128: 1 << 53, torch.uint8: 255, torch.int8: 127,
         torch.int32: (1 << 31) - 1, torch.int64: 1 << 62}  # fmt: skip


def logic(wire: str) -> bool:
    """Whether the bits travel with their complements (a max, min or product: anything but a sum)."""
    return wire != "sum"


def bits(token: int, dtype: torch.dtype, device: torch.device, with_complements: bool) -> list[torch.Tensor]:
    """The token as 64 (or 128) elements of ``dtype``, in 8 tensors: one concatenation writes them."""
    rows = _rows(dtype, device, with_complements)
    return [rows[b] for b in token.to_bytes(8, "little")]


def bits_bytes(token: int, dtype: torch.dtype, with_complements: bool, times: int) -> tuple[bytes, bytes]:
    """The bytes of :func:`bits`, and of each of them times ``times``: what a host message carries, and what
    every rank finds after a sum of ``times`` ranks' bits (or, with complements and ``times`` 1, after their max,
    min or product) exactly when they all sent this token."""
    return token_bytes(token, tables(dtype, with_complements, times))


def tables(dtype: torch.dtype, with_complements: bool, times: int) -> Tables:
    """For each byte value of a token: the bytes of its bits (as :func:`bits` has them), and of them times
    ``times``: what :func:`token_bytes` reads (a caller that makes many calls of one kind keeps them)."""
    key = (dtype, with_complements, times)
    return _ROW_BYTES.get(key) or _row_bytes(key)


def token_bytes(token: int, found: Tables) -> tuple[bytes, bytes]:
    """:func:`bits_bytes` from the tables of its dtype, complements and count."""
    t, u = found
    # Each of the 8 bytes looked up by name, without a loop or map: a third of the instructions.
    a, b, c, d, e, f, g, h = token.to_bytes(8, "little")
    return (b"".join((t[a], t[b], t[c], t[d], t[e], t[f], t[g], t[h])),
            b"".join((u[a], u[b], u[c], u[d], u[e], u[f], u[g], u[h])))  # fmt: skip


def check_tensor(token: int, device: torch.device) -> torch.Tensor:
    """The check on its own: the token's bits as int32, for a sum over the ranks."""
    return torch.cat(bits(token, torch.int32, device, False))


def bits_agree_on_device(values: torch.Tensor, world: int, with_complements: bool) -> torch.Tensor:
    """Whether the reduced bits say that every one of ``world`` ranks sent the same token, as a tensor on their
    device (a 0-d bool)."""
    if not with_complements:
        return ((values == 0) | (values == world)).all()
    pairs = values.view(-1, 2, 8)
    return (pairs[:, 0] != pairs[:, 1]).all()


def headers_agree_on_device(
    gathered: torch.Tensor, ranks: int, width: int, at: int, mine: torch.Tensor
) -> torch.Tensor:
    """Whether each of ``ranks`` messages of ``width`` bytes in ``gathered`` holds ``mine``'s agreed bytes at ``at``,
    as a tensor on their device (a 0-d bool)."""
    theirs = gathered.as_strided((ranks, AGREE), (width, 1), gathered.storage_offset() + at)
    return (theirs == mine[:AGREE]).all()


@functools.lru_cache(maxsize=64)
def _rows(dtype: torch.dtype, device: torch.device, with_complements: bool) -> list[torch.Tensor]:
    """For each byte value: its 8 bits (least first) as elements of ``dtype``, then their 8 complements."""
    table = [[(v >> j) & 1 for j in range(8)] for v in range(256)]
    if with_complements:
        table = [row + [1 - b for b in row] for row in table]
    values = torch.tensor(table, dtype=torch.int64).to(dtype).to(device)
    return list(values.unbind(0))


_ROW_BYTES: dict[tuple[torch.dtype, bool, int], Tables] = {}


def _row_bytes(key: tuple[torch.dtype, bool, int]) -> Tables:
    """For each byte value: the bytes of its bits as :func:`_rows` has them, and of each of them times ``times``."""
    dtype, with_complements, times = key
    if len(_ROW_BYTES) >= 256:
        _ROW_BYTES.clear()
    rows = _rows(dtype, torch.device("cpu"), with_complements)
    mine, times_that = (tuple(bytes((row * k).view(torch.uint8).tolist()) for row in rows) for k in (1, times))
    found = _ROW_BYTES[key] = (mine, times_that)
    return found
