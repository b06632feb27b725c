"""A loss that trains parameters of no prepared model: with several processes, refused at a run's first backward.

``ak.prepare(model)`` is what synchronises a model's gradients across processes (DDP, FSDP). A loss whose
gradients flow into parameters of a model that was never prepared trains each process's copy on its own
data alone, and the processes' weights drift apart, silently. The first ``ak.backward`` of a run walks the
loss's graph once to find the parameters it trains (torch's public ``get_gradient_edge`` names each
parameter's node in that graph) and refuses such a loss, naming the fix.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import Node, get_gradient_edge

from .. import _state
from ..errors import StateError

__all__ = ["check_prepared"]

_ACCUMULATE = "torch::autograd::AccumulateGrad"  # the node that adds a gradient into a parameter's .grad


def check_prepared(loss: torch.Tensor) -> None:
    """Raise :class:`StateError` when, with several processes, ``loss`` trains a parameter of no prepared model."""
    st = _state.peek()
    if st is None or not st.distributed or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return
    trained = _trained_nodes(loss)
    if not trained:
        return
    prepared = {
        get_gradient_edge(p).node for m in list(_state.training.models) for p in m.parameters() if p.requires_grad
    }
    unprepared = [node for node in trained if node not in prepared]
    if not unprepared:
        return
    what = "no model was prepared" if not prepared else f"{len(unprepared)} of the {len(trained)} it trains are not"
    raise StateError(
        f"ak.backward(loss) on process {st.rank} of {st.world_size}: the loss trains parameters of a model that "
        f"ak.prepare never saw ({what}): their gradients would not be synchronised, and each process's weights "
        f"would drift apart. Prepare every trained model before the loop, `model = ak.prepare(model)` (or with "
        f"its optimizer: `model, optimizer = ak.prepare(model, optimizer)`), and compute the loss with the "
        f"model ak.prepare returned."
    )


def _trained_nodes(loss: torch.Tensor) -> list[Node]:
    """The gradient accumulators (one per trained parameter) that ``loss``'s graph reaches."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() == _ACCUMULATE:
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
