"""Parallelism strategies: how ``ak.prepare`` wraps a model, and how a training step runs under it.

One small protocol, one module per strategy (single process, DDP, FSDP2, DeepSpeed), chosen
once when the process state is built (:func:`select_strategy`, from ``options.strategy`` and
the world size). Training, ``ak.prepare`` and checkpoints ask ``ak.state().strategy``; they
never branch on the strategy's name. What a strategy learns about the user's objects (which
parameters became shards, a model's no-sync depth, the DeepSpeed engine) it keeps itself,
in weak maps, instead of stamping attributes on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .._options import Options

__all__ = ["Setup", "Skipped", "Strategy", "select_strategy"]

# What Strategy.setup returns: the models, optimizers and schedulers to hand back (in order).
Setup = tuple[list[Any], list[Any], list[Any]]
# Whether a real optimizer step was skipped (fp16 overflow): known (a bool), or still on the device
# (a tensor, nonzero when skipped: read it only when asked); None on accumulation micro-steps.
Skipped: TypeAlias = "bool | torch.Tensor | None"


class Strategy(Protocol):
    """What ``ak.prepare``, the training step and checkpoints need from a parallelism strategy."""

    name: str
    owns_schedulers: bool  # the strategy steps LR schedulers itself (their step() does nothing)

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        *,
        micro_batch_size: int | None,
        model_options: Mapping[str, Any],
    ) -> Setup:
        """Place and wrap models (``model_options``: DDP's), fit optimizers and schedulers to them."""
        ...

    def grad_scaler(self) -> Any:
        """A new fp16 gradient scaler for this strategy (None: the strategy scales itself)."""
        ...

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """A region whose backward passes do not synchronise ``model``'s gradients."""
        ...

    def backward(self, loss: torch.Tensor, *, divide_by: int, scaler: Any, boundary: bool, **kwargs: Any) -> None:
        """``loss.backward()``: divided by the accumulation steps, scaled for fp16."""
        ...

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, scaler: Any, closure: Callable[[], float] | None, *, boundary: bool
    ) -> tuple[float | None, Skipped]:
        """Step ``optimizer`` (on a boundary); the closure's loss and whether the step was skipped.

        Adds no host-device synchronisation: a skip still decided on the device comes back as a tensor.
        """
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool, *, boundary: bool) -> None: ...

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without this strategy's (and torch's) wrappers."""
        ...

    def shards_state(self, obj: Any) -> bool:
        """Whether ``obj``'s state is sharded across ranks (saved and loaded per rank, with DCP)."""
        ...

    def release(self, model: nn.Module) -> None:
        """At interpreter exit: drop ``model``'s references to the process group, so that it goes first."""
        ...


def select_strategy(options: Options, world_size: int, device: torch.device) -> Strategy:
    """The strategy for these options: DeepSpeed when asked for; one process: no wrapping; else DDP or FSDP2."""
    if options.strategy == "deepspeed":
        from .deepspeed import DeepSpeed

        return DeepSpeed(options, device, world_size)
    if world_size == 1:
        from .single import SingleProcess

        return SingleProcess(options, device)
    if options.strategy == "fsdp":
        from .fsdp import FSDP

        return FSDP(options, device, world_size)
    from .ddp import DDP

    return DDP(options, device)
