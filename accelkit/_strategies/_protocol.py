"""The parallelism strategy protocol: what training, ``ak.prepare`` and checkpoints ask of a strategy."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

    from .._options import Options

__all__ = ["Setup", "Skipped", "Strategy"]

# What Strategy.setup returns: the models, optimizers and schedulers to hand back (in order).
Setup = tuple[list[Any], list[Any], list[Any]]
# Whether a real optimizer step was skipped (fp16 overflow): known (a bool), or still on the device
# (a tensor, nonzero when skipped: read it only when asked); None on accumulation micro-steps.
Skipped: TypeAlias = "bool | torch.Tensor | None"


class Strategy(Protocol):
    """What ``ak.prepare``, the training step and checkpoints need from a parallelism strategy."""

    name: str
    options: Options  # the process state's options, read on the step path (an attribute, where ak.state() is a call)
    owns_schedulers: bool  # the strategy steps LR schedulers itself (their step() does nothing)
    steps_on_micro_steps: bool  # optimizer_step runs on accumulation micro-steps too (else only on boundaries)
    # backward, optimizer_step and zero_grad are torch's own (``loss.backward()``, ``optimizer.step()``,
    # ``optimizer.zero_grad()``) while ``scaler`` is None: the step path then calls torch directly.
    torch_step: bool
    scaler: Any  # the fp16 gradient scaler, or None

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        *,
        micro_batch_size: int | None,
        model_options: Mapping[str, Any],
    ) -> Setup:
        """Place and wrap models (``model_options``: DDP's), fit optimizers and schedulers to them.

        Under fp16 the first optimizer prepared brings the strategy's gradient scaler, which
        ``backward`` and ``optimizer_step`` then use (none where the strategy scales itself).
        """
        ...

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """A region whose backward passes do not synchronise ``model``'s gradients."""
        ...

    def backward(self, loss: torch.Tensor, *, divide_by: int, boundary: bool, **kwargs: Any) -> None:
        """``loss.backward()``: divided by the accumulation steps, scaled for fp16."""
        ...

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None, *, boundary: bool
    ) -> tuple[float | None, Skipped]:
        """Step ``optimizer`` (on a boundary); the closure's loss and whether the step was skipped.

        Asked on accumulation micro-steps too (``boundary`` False) where ``steps_on_micro_steps``.

        Adds no host-device synchronisation: a skip still decided on the device comes back as a tensor.
        """
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        """Zero ``optimizer``'s gradients; asked on boundaries only (micro-steps keep accumulating)."""
        ...

    def unscale(self) -> None:
        """Divide the fp16 gradients of the prepared optimizers by the scale, once per step (before clipping)."""
        ...

    def gradient_scale(self) -> torch.Tensor | float | None:
        """What the fp16 gradients are multiplied by now (a device tensor where it is one); None: not scaled."""
        ...

    def scaler_state_dict(self) -> dict[str, Any] | None:
        """The fp16 gradient scaler's state, for a checkpoint; None without a scaler."""
        ...

    def load_scaler_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the fp16 gradient scaler's state (this strategy has one: ``scaler_state_dict()`` is not None)."""
        ...

    def keep_from(self, previous: Strategy) -> None:
        """Take over what ``previous`` (this process's strategy before an option changed) holds for the
        objects it prepared: their gradient scaler and optimizers."""
        ...

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without this strategy's (and torch's) wrappers."""
        ...

    def shards_state(self, obj: Any) -> bool:
        """Whether ``obj``'s state is sharded across ranks (saved and loaded per rank, with DCP)."""
        ...

    def release(self, model: nn.Module) -> None:
        """At interpreter exit: drop ``model``'s references to the process group, so that it goes first."""
        ...

    def process_group(self, name: str) -> ProcessGroup | None:
        """The process group of the mesh dimension ``name`` ("dp": the data-parallel ranks; "dp_replicate",
        "dp_shard", "tp", "cp" on a mesh); None: the whole world."""
        ...
