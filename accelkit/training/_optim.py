"""What ``ak.prepare`` wraps optimizers and LR schedulers in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _state


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only on real steps and through the fp16 grad scaler.

    ``step()`` and ``zero_grad()`` do nothing on gradient-accumulation micro-steps;
    ``step()`` is skipped (``step_was_skipped``) when fp16 gradients overflowed.
    Everything else (``param_groups``, ``state``, ``state_dict``) is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__: a view
        self.optimizer = optimizer
        self.step_was_skipped = False

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        training = _state.training
        strategy = _state.strategy()
        loss, skipped = strategy.optimizer_step(
            self.optimizer, training.scaler, closure, boundary=training.sync_gradients
        )
        if skipped is not None:  # a real step (or its fp16 skip): the step's outcome
            self.step_was_skipped = skipped
            training.unscaled = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        _state.strategy().zero_grad(self.optimizer, set_to_none, boundary=_state.training.sync_gradients)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """The user's LR scheduler, stepping once per real optimizer step.

    It does nothing on accumulation micro-steps and when the optimizer skipped its step
    (fp16 overflow), so size schedules in optimizer steps: from the *prepared* loader's
    ``len()`` divided by the accumulation steps.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        training = _state.training
        if not training.sync_gradients or _state.strategy().owns_schedulers:
            return
        target = self.scheduler.optimizer  # the user's optimizer or its prepared wrapper
        for opt in training.optimizers:
            if (opt is target or opt.optimizer is target) and opt.step_was_skipped:
                return
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # get_last_lr(), last_epoch, optimizer, ...: the wrapped scheduler's
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"
