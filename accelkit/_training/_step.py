"""The training step: ``backward``, ``accumulate``, ``no_sync``, gradient clipping, ``unwrap``."""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

from .. import _frames, _state
from .._options import is_int
from .._strategies import Strategy
from ._precision import MixedPrecisionModule
from ._unprepared import check_prepared

__all__ = [
    "accumulate",
    "backward",
    "no_sync",
    "sync_gradients",
    "unwrap",
]


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward(**kwargs)``, scaled for fp16 and divided by the accumulation steps.

    The loss is divided inside ``ak.accumulate`` only (by its ``steps``). Outside it, with
    ``gradient_accumulation_steps`` > 1 configured, nothing is divided (Accelerate's
    ``accelerator.backward`` would divide): a warning, once, says so and names ``ak.accumulate``.

    Args:
        loss: the loss to differentiate.
        **kwargs: passed on to ``loss.backward`` (``retain_graph=True``, ...).

    Example:
        >>> import accelkit as ak, torch
        >>> w = torch.ones(2, requires_grad=True)
        >>> ak.backward((w * 3).sum())
        >>> w.grad
        tensor([3., 3.])
    """
    training = _state.training
    if not training.accumulating:
        strategy = training.strategy
        steps = (strategy.options if strategy is not None else _state.get().options).gradient_accumulation_steps
        if steps > 1:
            _warn_once("outside accumulate", _OUTSIDE_ACCUMULATE, steps=steps)
    if not training.backward_calls:  # the first of a run
        check_prepared(loss)
    training.backward_calls += 1
    steps = training.accumulation_steps
    strategy = None if training.torch_step else _state.own_step()
    if strategy is None:  # torch's own: no call to the strategy, on every step
        (loss / steps if steps > 1 else loss).backward(**kwargs)  # type: ignore[no-untyped-call]
    else:
        strategy.backward(loss, divide_by=steps, boundary=training.sync_gradients, **kwargs)


_OUTSIDE_ACCUMULATE = (
    "ak.backward(loss) outside ak.accumulate, with gradient_accumulation_steps={steps}: the loss is not "
    "divided by {steps} (only ak.accumulate divides it, and it decides when gradients are synchronised and "
    "the optimizer steps), so gradients accumulated over {steps} backward calls are {steps}x those of "
    "Accelerate's accelerator.backward. Put each micro-step in `with ak.accumulate(model):`; or, "
    "accumulating by hand, divide the loss yourself and set gradient_accumulation_steps=1"
)
_SEVERAL_BACKWARDS = (
    "ak.accumulate(model) saw {calls} ak.backward calls in one region, with steps=1 "
    "(gradient_accumulation_steps left at 1): each synchronised the gradients, and they add up undivided "
    "({calls}x those of one micro-step). For {calls} micro-steps per optimizer step, give each its own "
    "region and the count: `for _ in range({calls}): with ak.accumulate(model, steps={calls}): "
    "ak.backward(loss)`, then clip and optimizer.step() after the loop. If several backward calls per "
    "step are meant (several losses), say so with steps=1"
)


_WHOLE_REGIONS = (
    "{regions} ak.accumulate(model) regions with steps left at 1 ran ak.backward before this optimizer step: "
    "each region is a whole step, so the gradients were synchronised {regions} times and add up undivided "
    "({regions}x those of one micro-step). For {regions} micro-steps per optimizer step, give the count: "
    "`with ak.accumulate(model, steps={regions}):` (or ak.init(gradient_accumulation_steps={regions})). If "
    "several losses per step are meant, say so with steps=1"
)


def warn_whole_regions(regions: int) -> None:
    """The prepared optimizer steps after ``regions`` > 1 whole-step regions: micro-steps that missed ``steps=``."""
    warned = _state.training.warned
    if "whole regions" not in warned:
        warned.add("whole regions")
        warnings.warn(_WHOLE_REGIONS.format(regions=regions), UserWarning, stacklevel=3)  # the user's step()


def _warn_once(key: str, message: str, **values: int) -> None:
    """``message`` filled with ``values``, as a UserWarning at the user's call, once per run per ``key``."""
    warned = _state.training.warned
    if key not in warned:
        warned.add(key)
        warnings.warn(message.format(**values), UserWarning, stacklevel=3)


class accumulate(contextlib.ContextDecorator):
    """One micro-step of gradient accumulation over ``steps`` micro-steps.

    Gradients are synchronised across processes (and the prepared optimizer and scheduler
    really step) only on every ``steps``-th call and on the last batch of a prepared
    dataloader. With the ``sync_each_batch`` option the gradients are synchronised on every
    micro-step too (less memory under FSDP, more communication); the optimizer still steps on the
    boundary only.

    One ``ak.backward`` per region: a loop of micro-steps puts each in its own region, and
    clipping and ``optimizer.step()`` may follow the loop (after the ``steps``-th region,
    ``ak.sync_gradients()`` is True). Several ``ak.backward`` calls in one region with
    ``steps`` left at 1 warn once (pass ``steps=1`` when several losses per step are meant).
    A class, as ``torch.no_grad``: it runs on every step, and a function around it would cost a call.

    Args:
        *models: the prepared models whose gradients accumulate.
        steps: micro-steps per optimizer step; ``None``: the configured ``gradient_accumulation_steps``.

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> with ak.accumulate(model, steps=2):
        ...     ak.sync_gradients()
        False
    """

    __slots__ = ("_backwards", "_outer", "_steps", "_sync_off", "models", "steps")

    def __init__(self, *models: nn.Module, steps: int | None = None) -> None:
        valid = steps is None or (type(steps) is int and steps >= 1)  # the common cases first: it runs every step
        if not valid and (not is_int(steps) or steps < 1):
            raise ValueError(f"accelkit.accumulate(steps={steps!r}): expected an integer >= 1, e.g. steps=4")
        self.models = models
        self.steps = steps
        # Set on entry: the steps in force, those of the region outside (0: not entered), the
        # ak.backward calls so far, the no-sync regions entered (None: none).
        self._steps = self._outer = self._backwards = 0
        self._sync_off: list[Any] | None = None

    def __enter__(self) -> None:
        training = _state.training
        strategy = training.strategy  # None: no state yet, or one built by hand
        steps = self.steps
        if steps is None:
            steps = (strategy.options if strategy is not None else _state.get().options).gradient_accumulation_steps
        if steps > 1 and "step watch" not in _state.hooks:
            _state.this_process.once("step watch", _watch_steps)
        loaders = training.active_loaders
        if loaders and loaders[-1].at_last_batch:
            training.micro_step = 0  # the next epoch starts a fresh cycle
            training.sync_gradients = sync = True
        else:
            training.micro_step = micro = training.micro_step + 1
            training.sync_gradients = sync = micro % steps == 0
        self._steps, self._outer, self._backwards = steps, training.accumulation_steps, training.backward_calls
        training.accumulation_steps = steps
        training.accumulating += 1
        if not sync and not (strategy.options if strategy is not None else _state.get().options).sync_each_batch:
            self._sync_off = self._stop_syncing(strategy)

    def _stop_syncing(self, strategy: Strategy | None) -> list[Any]:
        """Enter each model's no-sync region; those entered (left again, with the region, on an error)."""
        sync_off: list[Any] = []
        try:
            strategy = strategy or _state.strategy()
            for model in self.models:
                if isinstance(model, MixedPrecisionModule):
                    model = model.forward_module
                region = strategy.no_sync(model)
                region.__enter__()
                sync_off.append(region)
        except BaseException:
            self._sync_off = sync_off
            self.__exit__(*sys.exc_info())
            raise
        return sync_off

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        steps = self._steps
        assert steps, "accumulate.__exit__ without __enter__"
        training = _state.training
        sync_off, self._sync_off = self._sync_off, None
        try:
            while sync_off:
                sync_off.pop().__exit__(kind, value, traceback)
        finally:
            training.accumulation_steps = self._outer
            training.accumulating -= 1
        if steps == 1 and self.steps is None and kind is None:
            calls = training.backward_calls - self._backwards
            if calls:
                training.whole_regions += 1  # the prepared optimizer's step says so when several came before it
            if calls > 1:
                _warn_once("several backwards", _SEVERAL_BACKWARDS, calls=calls)


def _watch_steps() -> Any:
    return optimizer_module.register_optimizer_step_pre_hook(_warn_unprepared_step)


def _warn_unprepared_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Any optimizer stepping on an accumulation micro-step was not prepared (a prepared one skips it)."""
    training = _state.training
    if training.sync_gradients or training.accumulation_steps == 1:
        return
    frame = _frames.user_frame(skip=(optimizer_module.__file__,))
    warnings.warn_explicit(
        f"{type(optimizer).__name__}.step() ran on a gradient-accumulation micro-step of ak.accumulate: this "
        f"optimizer was not prepared, so it steps on every micro-step with 1/{training.accumulation_steps} of "
        f"the loss. Prepare it: model, optimizer = ak.prepare(model, optimizer)",
        UserWarning,
        frame.f_code.co_filename if frame else "<unknown>",
        frame.f_lineno if frame else 0,
        registry=frame.f_globals.setdefault("__warningregistry__", {}) if frame else None,  # once per line
    )


class _SyncGradients:
    """``ak.sync_gradients()``: whether this step synchronises gradients (False on accumulation micro-steps).

    A function, unlike Accelerate's ``accelerator.sync_gradients`` property: ``if ak.sync_gradients:``
    (without the call) would always be true, so it raises a ``TypeError`` saying to call it.

    Example:
        >>> import accelkit as ak
        >>> ak.sync_gradients()
        True
    """

    __name__ = __qualname__ = "sync_gradients"
    __module__ = "accelkit"

    def __call__(self) -> bool:
        return _state.training.sync_gradients

    def __bool__(self) -> bool:
        raise TypeError(
            "ak.sync_gradients is a function: call it, `if ak.sync_gradients():` (it is a property of "
            "Accelerate's Accelerator, so `if accelerator.sync_gradients:` ports to `if ak.sync_gradients():`)"
        )

    def __repr__(self) -> str:
        return "<function accelkit.sync_gradients>"

    def __reduce__(self) -> str:
        return "sync_gradients"  # pickled by name, as a function is: accelkit.sync_gradients


sync_gradients = _SyncGradients()


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Skip the gradient all-reduce in the body (DDP's ``no_sync``); a no-op on one process.

    Under FSDP2 the body's backward keeps unsharded, unreduced gradients until the region ends.

    Args:
        model: the prepared model.

    Example:
        >>> import accelkit as ak, torch
        >>> with ak.no_sync(torch.nn.Linear(2, 1)):
        ...     pass
    """
    if isinstance(model, MixedPrecisionModule):
        model = model.forward_module
    return _Reentrant(model)


class _Reentrant:
    """``ak.no_sync(model)``, kept and entered again (also inside itself): each entry enters a new region."""

    __slots__ = ("_entered", "_model")

    def __init__(self, model: nn.Module) -> None:
        self._model, self._entered = model, list[contextlib.AbstractContextManager[Any]]()

    def __enter__(self) -> None:
        region = (_state.training.strategy or _state.strategy()).no_sync(self._model)
        region.__enter__()
        self._entered.append(region)
        _state.training.unsynced += 1

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        _state.training.unsynced -= 1
        self._entered.pop().__exit__(kind, value, traceback)


def unwrap(model: nn.Module, keep_precision: bool = False) -> nn.Module:
    """The user's module, as it was, without the prepared wrappers (precision, DDP, DeepSpeed, ``torch.compile``).

    Args:
        model: a prepared model (or any module: it comes back as it is).
        keep_precision: keep the forward in the prepared precision, with fp32 outputs (Accelerate's
            ``keep_fp32_wrapper``).

    Example:
        >>> import accelkit as ak, torch
        >>> net = torch.nn.Linear(2, 1)
        >>> ak.unwrap(ak.prepare(net)) is net
        True
    """
    strategy = _state.strategy()
    precision: MixedPrecisionModule | None = None
    while True:
        if isinstance(model, MixedPrecisionModule):
            precision, model = model, model.forward_module
        inner = strategy.unwrap(model)
        if inner is model:
            break
        model = inner
    if keep_precision and precision is not None:
        return (
            precision
            if precision.forward_module is model
            else MixedPrecisionModule(model, precision.mode, precision.device_type)
        )
    return model
