"""``ak.local_sgd``: each process trains on its own; the parameters are averaged every few optimizer steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .. import _state, _torch_private
from .._collectives import reduce
from .._options import is_int
from ._precision import MixedPrecisionModule
from ._step import no_sync, unwrap

__all__ = ["LocalSGD", "local_sgd"]


class LocalSGD:
    """The handle ``with ak.local_sgd(model, steps=K) as sync:`` gives: ``sync.step()`` after each optimizer step.

    ``num_steps`` counts the real optimizer steps seen (accumulation micro-steps do not count),
    ``num_averages`` the averages taken; ``enabled`` is False with one process or
    ``enabled=False``, where nothing is averaged.
    """

    def __init__(self, model: nn.Module, steps: int, enabled: bool) -> None:
        self.model = model
        self.steps = steps
        self.enabled = enabled
        self.num_steps = 0
        self.num_averages = 0
        self._pending = 0  # real steps since the parameters were last averaged

    def step(self) -> None:
        """Count one optimizer step; on every ``steps``-th, average the parameters across processes.

        Call it after ``optimizer.step()`` on every batch, on every rank. Inside ``ak.accumulate``
        a micro-step (``ak.sync_gradients()`` false: the optimizer did not step) is not counted.
        """
        if not _state.training.sync_gradients:
            return
        self.num_steps += 1
        self._pending += 1
        if self._pending >= self.steps:
            self.average()

    def average(self) -> None:
        """Average the parameters across processes now (every rank must call it)."""
        self._pending = 0
        if not self.enabled:
            return
        self.num_averages += 1
        params = list(unwrap(self.model).parameters())
        with torch.no_grad():
            means = reduce([p.detach() for p in params], op="mean")
            for param, mean in zip(params, means, strict=True):
                param.copy_(mean)

    def finish(self) -> None:
        """The final average, when steps were taken since the last one (on leaving the ``with`` block)."""
        if self._pending:
            self.average()


@contextlib.contextmanager
def local_sgd(model: nn.Module, *, steps: int, enabled: bool = True) -> Iterator[LocalSGD]:
    """Local SGD: gradients stay on each process, parameters are averaged every ``steps`` optimizer steps.

    In the body the prepared (DDP) model's gradients are not synchronised (``ak.no_sync``);
    ``sync.step()`` after each real ``optimizer.step()`` averages the parameters across
    processes on every ``steps``-th call, and leaving the block averages them once more when
    steps were taken since (not when the body raised: the others would wait for this process).
    Every rank must call ``sync.step()`` equally often. With one process (or
    ``enabled=False``) nothing is averaged and gradients sync as usual.

    Args:
        model: the prepared model.
        steps: optimizer steps between two averages of the parameters.
        enabled: ``False``: plain training (gradients sync as usual, nothing is averaged).

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> model, opt = ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with ak.local_sgd(model, steps=8) as sync:
        ...     for _ in range(3):
        ...         ak.backward(model(torch.ones(1, 2)).sum())
        ...         opt.step(); opt.zero_grad(); sync.step()
        >>> sync.num_steps
        3
    """
    if not is_int(steps) or steps < 1:
        raise ValueError(
            f"accelkit.local_sgd(steps={steps!r}): expected an integer >= 1, the optimizer steps between "
            f"two averages of the parameters, e.g. steps=8"
        )
    if not isinstance(enabled, bool):
        raise TypeError(f"accelkit.local_sgd(enabled={enabled!r}): expected True or False")
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"accelkit.local_sgd() takes the prepared model first, got {type(model).__name__}: "
            f"with ak.local_sgd(model, steps={steps}) as sync: ..."
        )
    active = enabled and _state.get().distributed
    if active and not _is_ddp(model):
        raise ValueError(
            f"accelkit.local_sgd(): the model is a {type(model).__name__}, not a model that ak.prepare wrapped in "
            f"DistributedDataParallel. Local SGD averages whole parameters and needs strategy='ddp' (the "
            f"default): prepare the model first, model = ak.prepare(model), and do not shard it (FSDP, DeepSpeed)"
        )
    sync = LocalSGD(model, steps, active)
    with no_sync(model) if active else contextlib.nullcontext():
        yield sync
        sync.finish()


def _is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` is DDP under accelkit's precision wrapper and ``torch.compile``'s, if any."""
    if isinstance(model, MixedPrecisionModule):
        model = model.forward_module
    model = _torch_private.compiled_inner(model) or model
    return isinstance(model, nn.parallel.DistributedDataParallel)
