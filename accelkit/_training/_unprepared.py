"""A loss with no prepared model in the run: with several processes, refused at the run's first backward.

``ak.prepare(model)`` is what synchronises a model's gradients across processes (DDP, FSDP). A script that
trains a model it never prepared trains each process's copy on its own data alone, and the processes'
weights drift apart, silently. A model sharded by hand with ``fully_shard`` (whose prepared optimizer holds
its DTensor shards) synchronises itself, and passes.
"""

from __future__ import annotations

import torch

from .. import _state
from ..errors import StateError

__all__ = ["check_prepared"]


def check_prepared(loss: torch.Tensor) -> None:
    """Raise :class:`StateError` when, with several processes, ``loss`` trains something and no model was prepared."""
    st = _state.peek()
    training = _state.training
    if st is None or not st.distributed or not getattr(loss, "requires_grad", False) or len(training.models):
        return
    strategy = st.strategy
    if strategy is not None and any(strategy.shards_state(o) for o in list(training.optimizers)):
        return  # a model sharded by hand: its optimizer holds its shards
    raise StateError(
        f"ak.backward(loss) on process {st.rank} of {st.world_size}: no model was prepared, so nothing synchronises "
        f"the gradients, and each process's weights would drift apart. Prepare the model before the loop, "
        f"`model = ak.prepare(model)` (or with its optimizer: `model, optimizer = ak.prepare(model, optimizer)`), "
        f"and compute the loss with the model ak.prepare returned."
    )
