"""A 2 x 2 mesh of process groups on 4 processes, for the tests of collectives over a group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_MESHES: dict[Any, dict[str, Any]] = {}


def row_and_column() -> dict[str, Any]:
    """This rank's groups: its row ({0, 1} or {2, 3}) and its column ({0, 2} or {1, 3}). Made once per process
    group, every group on every rank in the same order (as torch asks)."""
    world = dist.group.WORLD
    found = _MESHES.get(world)
    if found is None:
        made = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
        rank = dist.get_rank()
        found = _MESHES[world] = {"row": made[(0, 1) if rank < 2 else (2, 3)],
                                  "column": made[(0, 2) if rank % 2 == 0 else (1, 3)]}  # fmt: skip
    return found
