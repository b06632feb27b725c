"""Collectives over trees of tensors: gather, reduce, broadcast, pad, and Python objects, over any process group."""

from ._api import (
    REDUCE_OPS,
    Group,
    ReduceOp,
    any_rank,
    barrier,
    broadcast,
    broadcast_object,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from ._checked import settle
from ._exchange import exchange_objects

__all__ = ["REDUCE_OPS", "Group", "ReduceOp", "any_rank", "barrier", "broadcast", "broadcast_object",
           "exchange_objects", "gather", "gather_object", "pad_across_processes", "reduce", "settle"]  # fmt: skip
