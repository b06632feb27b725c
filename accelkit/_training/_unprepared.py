"""A loss with no prepared model in the run: with several processes, said once, at the run's first backward.

``ak.prepare(model)`` is what synchronises a model's gradients across processes (DDP, FSDP). A script that
trains a model it never prepared trains each process's copy on its own data alone, and the processes'
weights drift apart, silently. A warning, not an error: a model wrapped by hand (``DistributedDataParallel``,
``fully_shard``) synchronises itself, and nothing public tells it apart from the loss alone; one whose
prepared optimizer holds DTensor shards (sharded by hand) is recognised, and passes in silence.
"""

from __future__ import annotations

import warnings

import torch

from .. import _frames, _state

__all__ = ["check_prepared"]


def check_prepared(loss: torch.Tensor) -> None:
    """Warn, once a run, when with several processes ``loss`` trains something and no model was prepared."""
    st = _state.peek()
    training = _state.training
    if st is None or not st.distributed or not getattr(loss, "requires_grad", False) or len(training.models):
        return
    strategy = st.strategy
    if strategy is not None and any(strategy.shards_state(o) for o in list(training.optimizers)):
        return  # a model sharded by hand: its optimizer holds its shards
    if "unprepared" in training.warned:  # once a run
        return
    training.warned.add("unprepared")
    frame = _frames.user_frame()
    warnings.warn_explicit(
        f"ak.backward(loss) on process {st.rank} of {st.world_size}: no model was prepared, so accelkit "
        f"synchronises no gradients, and each process's weights drift apart (unless the model synchronises them "
        f"itself: DistributedDataParallel or fully_shard applied by hand). Prepare the model before the loop, "
        f"`model = ak.prepare(model)` (or with its optimizer: `model, optimizer = ak.prepare(model, optimizer)`), "
        f"and compute the loss with the model ak.prepare returned.",
        UserWarning,
        frame.f_code.co_filename if frame is not None else "<unknown>",
        frame.f_lineno if frame is not None else 0,
    )
