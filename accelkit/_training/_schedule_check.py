"""Whether a prepared schedule was sized Accelerate's way: ``num_processes`` times longer than the run.

Accelerate steps a prepared scheduler ``num_processes`` times per optimizer step, so its recipes size
a schedule ``num_processes`` times longer (``num_training_steps * accelerator.num_processes``, or the
unprepared loader's length); here the scheduler steps once per real step, so such a schedule stops
1/N of the way through (a linear decay at (N-1)/N of its peak). Each prepared scheduler of a run of
several processes is judged once, on the main process, when its run is over: at ``ak.end_training()``,
or when it is dropped (the end of the function or script that held it, or the interpreter's exit),
when its step count is final. Right or silent: only a schedule whose stated length is about N times
the steps taken, or whose factor still decays at the last step and stops decaying about N times
later, is reported; one still warming up, flat, or of a shape not understood says nothing.
"""

from __future__ import annotations

import itertools
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["stretched_end", "watch"]

# Schedules whose length a scheduler states, and that decay to their end: class name -> the attribute.
_LENGTHS = {"OneCycleLR": "total_steps", "CosineAnnealingLR": "T_max", "LinearLR": "total_iters",
            "PolynomialLR": "total_iters"}  # fmt: skip


def watch(prepared: object, scheduler: Any, world_size: int) -> Callable[[], Any]:
    """Judge ``scheduler`` once: when this returned callable is called, or when ``prepared`` is collected."""
    return weakref.finalize(prepared, _judge, scheduler, world_size)


def _judge(scheduler: Any, world_size: int) -> None:
    done = getattr(scheduler, "last_epoch", None)
    if not isinstance(done, int):
        return
    end = stretched_end(scheduler, done, world_size)
    if end is None:
        return
    warnings.warn(
        f"{type(scheduler).__name__} was sized for {end} optimizer steps but the run took {done} "
        f"({end / done:.2g}x fewer, {world_size} processes): its schedule stopped {done / end:.0%} of the way "
        f"through. accelkit steps a prepared scheduler once per real optimizer step (Accelerate steps it "
        f"num_processes times), so size it from the prepared loader, without * num_processes: "
        f"num_training_steps = math.ceil(len(loader) / accumulation_steps) * epochs",
        UserWarning,
        stacklevel=2,
    )


def stretched_end(scheduler: Any, done: int, world_size: int) -> int | None:
    """Where ``scheduler``'s schedule ends, if that is about ``world_size`` times the ``done`` steps taken
    and its learning rate was still decaying towards it; None otherwise (nothing to say).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> linear = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1 - k / 100))
        >>> stretched_end(linear, 50, 2), stretched_end(linear, 100, 2)
        (100, None)
    """
    if world_size < 2 or done < 2:
        return None
    target = done * world_size
    slack = max(world_size, math.ceil(0.05 * target))  # a last batch cut differently, a rounded division
    from torch.optim import lr_scheduler

    for name, attribute in _LENGTHS.items():
        if isinstance(scheduler, getattr(lr_scheduler, name)):
            length = getattr(scheduler, attribute, None)
            rising = name == "LinearLR" and scheduler.end_factor >= scheduler.start_factor  # a warm-up's length
            if not isinstance(length, int) or rising:
                return None
            return length if length > done and abs(length - target) <= slack else None
    factors = getattr(scheduler, "lr_lambdas", None)  # LambdaLR (transformers' get_scheduler kinds)
    if not isinstance(scheduler, lr_scheduler.LambdaLR) or not isinstance(factors, list) or not factors:
        return None
    try:
        ends = {_decay_end(f, done, target + slack) for f in factors}
    except Exception:  # a factor that cannot be asked about another step: nothing to say
        return None
    end = ends.pop() if len(ends) == 1 else None
    return end if end is not None and abs(end - target) <= slack else None


def _decay_end(factor: Callable[[int], float], done: int, limit: int) -> int | None:
    """The first step after ``done`` at which ``factor`` stops decreasing (its end), if it decreases at
    ``done`` and stops by ``limit``, falling on the way; None for any other shape."""

    def f(step: int) -> float:
        return float(factor(step))

    def stopped(step: int) -> bool:
        return f(step + 1) >= f(step)

    now = f(done)
    if stopped(done) or not stopped(limit):  # warming up, flat or over; or still decaying past the limit
        return None
    low, high = done, limit  # stopped(low) is False, stopped(high) True: the first True between them
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if stopped(middle) else (middle, high)
    path = [f(done + (high - done) * k // 8) for k in range(9)]
    falling = all(b <= a for a, b in itertools.pairwise(path))
    return high if falling and path[-1] < now / 2 else None
