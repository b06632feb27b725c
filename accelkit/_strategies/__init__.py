"""Parallelism strategies: how ``ak.prepare`` wraps a model, and how a training step runs under it.

One small protocol, one module per strategy (single process, DDP, FSDP2, DeepSpeed), chosen
once when the process state is built (:func:`select_strategy`, from ``options.strategy`` and
the world size). Training, ``ak.prepare`` and checkpoints ask ``ak.state().strategy``; they
never branch on the strategy's name. What a strategy learns about the user's objects (which
parameters became shards, a model's no-sync depth, the DeepSpeed engine) it keeps itself,
in weak maps, instead of stamping attributes on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._protocol import Setup, Skipped, Strategy

if TYPE_CHECKING:
    import torch

    from .._options import Options

__all__ = ["Setup", "Skipped", "Strategy", "select_strategy"]


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
