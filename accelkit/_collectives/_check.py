"""How a call's token travels with the data, and how every rank reads the verdict from it.

- **Bits**, for reductions: the token's 64 bits as elements of the message's dtype, reduced along
  with the data. A sum adds bits (0 or 1): each comes out 0 or the world size exactly when every
  rank sent the same token. Max, min and product (and booleans, whose sum is a logical or) carry
  each bit and its complement: a pair comes out as two different values exactly when every rank
  agrees ((1, 1) or (0, 0) otherwise).
- **Headers**, for gathers and broadcasts: the call's 64-byte header after the data; every rank
  (a broadcast: every receiver) compares the headers it received with its own.
- **The check**, on its own: the bits as int32 in a small all-reduce (exact at any world size).

The host wire reads the verdict from host values at once; the device wire compares on the device
(the ``_on_device`` forms) and reads the result later (see :mod:`._wire`).
"""

import functools
from typing import Any

import torch

from ._signature import AGREE

__all__ = ["EXACT", "bits", "bits_agree", "bits_agree_on_device", "check_tensor", "headers_agree_on_device",
           "logic"]  # fmt: skip

BITS = 64
# The largest world size whose count of ones each dtype holds exactly (a bit's sum reaches it).
EXACT = {torch.float16: 2048, torch.bfloat16: 256, torch.float32: 1 << 24, torch.float64: 1 << 53,
         torch.complex64: 1 << 24, torch.complex128: 1 << 53, torch.uint8: 255, torch.int8: 127,
         torch.int32: (1 << 31) - 1, torch.int64: 1 << 62}  # fmt: skip


def logic(dtype: torch.dtype, wire: str) -> bool:
    """Whether the bits travel with their complements (max, min, product, or booleans)."""
    return wire != "sum" or dtype == torch.bool


def bits(token: int, dtype: torch.dtype, device: torch.device, with_complements: bool) -> list[torch.Tensor]:
    """The token as 64 (or 128) elements of ``dtype``, in 8 tensors: one concatenation writes them."""
    rows = _rows(dtype, device, with_complements)
    return [rows[b] for b in token.to_bytes(8, "little")]


def check_tensor(token: int, device: torch.device) -> torch.Tensor:
    """The check on its own: the token's bits as int32, for a sum over the ranks."""
    return torch.cat(bits(token, torch.int32, device, False))


def bits_agree(values: list[Any], world: int, with_complements: bool) -> bool:
    """From the reduced bits (host values): whether every rank sent the same token."""
    if not with_complements:
        kind = type(values[0])  # int, float or complex: counted fastest as the values' own type
        return values.count(kind(0)) + values.count(kind(world)) == len(values)
    return all(values[i] != values[i + 8] for row in range(0, len(values), 16) for i in range(row, row + 8))


def bits_agree_on_device(values: torch.Tensor, world: int, with_complements: bool) -> torch.Tensor:
    """:func:`bits_agree` as a tensor on the bits' device (a 0-d bool)."""
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
