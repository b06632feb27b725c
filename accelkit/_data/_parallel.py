"""This rank's place among the data-parallel ranks, as the strategy says: what loaders shard by.

On a device mesh with tensor parallelism the ranks of a ``tp`` group share their batches: the
loaders shard by the data-parallel rank and size, and ``ak.gather_for_metrics`` gathers over the
data-parallel group (``group="dp"``), so each sample comes once. The strategy owns the group
(``process_group("dp")``); nothing here forms one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _state
from .._state import ProcessState

__all__ = ["DataParallel", "data_parallel"]


class DataParallel(NamedTuple):
    """This rank's data-parallel rank among ``size``; ``group`` None: every process (then ``ranks`` is empty)."""

    rank: int
    size: int
    group: Any = None
    ranks: tuple[int, ...] = ()  # the global ranks of this rank's data-parallel group, in its order


def data_parallel(st: ProcessState) -> DataParallel:
    """This rank's place among the data-parallel ranks (every rank must call it the first time)."""
    if not st.distributed:
        return DataParallel(st.rank, st.world_size)
    group = _state.strategy().process_group("dp")
    if group is None:
        return DataParallel(st.rank, st.world_size)
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    return DataParallel(ranks.index(st.rank), len(ranks), group, ranks)
