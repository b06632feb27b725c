"""What ``ak.prepare`` wraps optimizers and LR schedulers in.

Whether an fp16 step was skipped is never read from the device on the step path. A plain
optimizer's skip is known on the host (GradScaler did not call its ``step()``); an optimizer that
skips on the device (fused Adam/AdamW/SGD) leaves a device flag, read only when asked:
``step_was_skipped`` reads it at once (the host waits for the device). A prepared scheduler
reads it at once where that costs no wait (the CPU: host memory); on a GPU it reads it at the
next optimizer step, through a copy the device makes after this step, so that the host waits
for this step's flag at most, never for the work queued after it. Until then that scheduler's
step is pending: the next ``optimizer.step()``, and reading the scheduler or the prepared
optimizer's ``param_groups`` / ``state_dict()``, apply it first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .. import _state
from ._schedule_check import watch


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only on real steps and through the fp16 grad scaler.

    ``step()`` and ``zero_grad()`` do nothing on gradient-accumulation micro-steps;
    ``step()`` is skipped (``step_was_skipped``) when fp16 gradients overflowed.
    Everything else (``param_groups``, ``state``, ``state_dict``, and any attribute or method this
    wrapper does not define, such as a schedule-free optimizer's ``train()`` / ``eval()``) is the
    wrapped optimizer's, ``self.optimizer``. It is a ``torch.optim.Optimizer``, not an instance of
    the wrapped optimizer's class: test ``isinstance(opt.optimizer, MyOptimizer)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__: a view
        self.optimizer = optimizer
        self._skipped: bool | torch.Tensor = False  # the last real step's outcome; a tensor: still on the device
        self._pending: list[Callable[[], None]] = []  # scheduler steps waiting for that outcome

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last real step was skipped (fp16 overflow).

        With an optimizer that skips on the device (fused) the first read after a step waits
        for the device to finish that step: read it when you need it, not on every step.
        """
        if isinstance(self._skipped, torch.Tensor):
            self._skipped = bool(self._skipped.any())
        return self._skipped

    def _outcome(self) -> bool | torch.Tensor:
        """The last real step's skip, as it stands: a bool, or a device flag not read yet."""
        return self._skipped

    def _defer(self, apply: Callable[[], None]) -> None:
        """Run ``apply`` before this optimizer's next step, or before its state is next read."""
        self._pending.append(apply)

    def _apply_pending(self) -> None:
        """Apply the scheduler steps that wait for the last step's outcome (reads that flag)."""
        pending, self._pending = self._pending, []
        for apply in pending:
            apply()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self._pending:
            self._apply_pending()  # the learning rates of this step depend on them
        training = _state.training
        if training.whole_regions > 1:  # micro-steps in a loop of ak.accumulate(model) without steps=
            from ._step import warn_whole_regions

            warn_whole_regions(training.whole_regions)
        training.whole_regions = 0
        boundary = training.sync_gradients
        strategy = None if training.torch_step else _state.own_step()
        if strategy is None:  # torch's own step: nothing is skipped
            if not boundary:
                return None  # an accumulation micro-step: the gradients are not complete yet
            self._skipped = False
            return self.optimizer.step(closure)
        if not boundary and not strategy.steps_on_micro_steps:
            return None
        loss, skipped = strategy.optimizer_step(self.optimizer, closure, boundary=boundary)
        if skipped is not None:  # a real step (or its fp16 skip): the step's outcome
            self._skipped = skipped
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        training = _state.training
        if training.sync_gradients:  # not on accumulation micro-steps: their gradients add up
            strategy = None if training.torch_step else _state.own_step()
            if strategy is None or strategy.torch_step:  # under fp16 too: the scaler does not zero
                self.optimizer.zero_grad(set_to_none)
            else:
                strategy.zero_grad(self.optimizer, set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        if self._pending:
            self._apply_pending()  # so that the learning rates read are the scheduled ones
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
        self._apply_pending()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._apply_pending()  # then the loaded state replaces what they changed
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._apply_pending()
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Only for names not found on the wrapper: the wrapped optimizer's (optimizer.train(), ...).
        # Also what Optimizer's own methods read (register_step_pre_hook's hook dicts): the hooks
        # then go on the wrapped optimizer, and run when it really steps.
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:  # still being built or unpickled
            raise AttributeError(f"'PreparedOptimizer' object has no attribute {name!r}")
        return getattr(optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        # Not Optimizer's: it would drop the wrapped optimizer, and its __setstate__ patches this class's step().
        self._apply_pending()
        return {"optimizer": self.optimizer, "_skipped": self.step_was_skipped, "_pending": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


_PREPARED = itertools.count()  # schedulers prepared so far in this process


class PreparedScheduler:
    """The user's LR scheduler, stepping once per real optimizer step.

    It does nothing on accumulation micro-steps and when the optimizer skipped its step
    (fp16 overflow), so size schedules in optimizer steps: from the *prepared* loader's
    ``len()`` divided by the accumulation steps. When the optimizer skips on a GPU (fused,
    fp16), ``step()`` is applied at the optimizer's next step instead (or when the scheduler
    or the prepared optimizer's ``param_groups`` is read first), so that it never makes the
    host wait for the device.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._pending: tuple[Callable[[], bool], tuple[Any, ...], dict[str, Any]] | None = None
        st = _state.get()
        hardware = st.hardware  # this process's, for as long as its optimizer is prepared
        self._read_later: Callable[[torch.Tensor], bool | Callable[[], bool]] = (
            hardware.read_later if hardware is not None else _read_now
        )
        self._order = next(_PREPARED)  # check_schedules speaks of them in the order they were prepared
        _state.training.schedulers.add(self)  # ak.end_training checks its length (check_schedules)
        # ... and its end, where ak.end_training is never called: judged once, on the main process.
        several = st.world_size > 1 and st.is_main_process
        self._end_check = watch(self, scheduler, st.world_size) if several else None

    def step(self, *args: Any, **kwargs: Any) -> None:
        training = _state.training
        if not training.sync_gradients or (training.strategy or _state.strategy()).owns_schedulers:
            return
        if self._pending is not None:
            self._apply_pending()
        target = self.scheduler.optimizer  # the user's optimizer or its prepared wrapper
        for opt in training.optimizers:
            if opt is target or opt.optimizer is target:
                outcome = opt._outcome()
                if isinstance(outcome, torch.Tensor):  # decided on the device
                    read = self._read_later(outcome)
                    if not isinstance(read, bool):  # reading it now would wait for the device: later
                        self._pending = (read, args, kwargs)
                        opt._defer(self._apply_pending)
                        return
                    outcome = opt._skipped = read
                if outcome:
                    return
        self.scheduler.step(*args, **kwargs)

    def _apply_pending(self) -> None:
        """Apply a step that waited for its optimizer step's outcome (unless that step was skipped)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            skipped, args, kwargs = pending
            if not skipped():
                self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        self._apply_pending()
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:  # a copy is not judged again
        return {k: None if k == "_end_check" else v for k, v in self.__dict__.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._apply_pending()
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # get_last_lr(), last_epoch, optimizer, ...: the wrapped scheduler's, up to date
        if self.__dict__.get("_pending") is not None:
            self._apply_pending()
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"


def check_schedules() -> None:
    """At ``ak.end_training``: judge every prepared schedule still alive, in the order they were prepared,
    whether it was sized for ``num_processes`` times the run's steps (``_schedule_check``), once each."""
    for prepared in sorted(_state.training.schedulers, key=lambda p: p._order):
        if prepared._end_check is not None:
            prepared._apply_pending()  # a step still waiting for its optimizer's outcome counts
            prepared._end_check()


def _read_now(flag: torch.Tensor) -> bool:  # a state built by hand (tests) has no hardware backend
    return bool(flag.any())
