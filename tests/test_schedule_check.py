"""The warning of a schedule sized Accelerate's way (``num_processes`` times the run): right or silent.

Every kind of transformers' ``get_scheduler`` (its lambdas written here: transformers is not a dependency)
and torch's schedulers that state a length, each sized from the prepared loader with the warm-ups of
Accelerate's examples and scripts (none, a few steps, half the run, between 1x and 2x the run, a fixed
100) and sized Accelerate's way (``* num_processes``, or from the unprepared loader): only the second
warns, and only where the run's end shows it (a schedule still warming up, or flat, is not judged).
Said once, on the main process: at ``ak.end_training()``, or where that is never called, when the
scheduler is dropped or the process ends.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import subprocess_env
from torch import nn
from torch.optim import lr_scheduler

import accelkit as ak
from accelkit.testing import run_distributed

pytestmark = pytest.mark.distributed

STEPS, WORLD = 48, 2  # the run's optimizer steps (the 9 examples: 48, on 2 processes)
WARNING = "optimizer steps but the run took"


# --- transformers' get_scheduler kinds, as transformers/optimization.py writes their factors ------------


def _warm(s: int, w: int) -> float:
    return float(s) / float(max(1, w))


def linear(s: int, *, w: int, t: int) -> float:
    return _warm(s, w) if s < w else max(0.0, float(t - s) / float(max(1, t - w)))


def cosine(s: int, *, w: int, t: int, cycles: float = 0.5) -> float:
    if s < w:
        return _warm(s, w)
    progress = float(s - w) / float(max(1, t - w))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))


def cosine_with_restarts(s: int, *, w: int, t: int, cycles: int = 1) -> float:
    if s < w:
        return _warm(s, w)
    progress = float(s - w) / float(max(1, t - w))
    return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0))))


def polynomial(s: int, *, w: int, t: int, lr_end: float = 1e-7, power: float = 1.0, lr_init: float = 0.1) -> float:
    if s < w:
        return _warm(s, w)
    if s > t:
        return lr_end / lr_init
    return ((lr_init - lr_end) * (1 - (s - w) / (t - w)) ** power + lr_end) / lr_init


def constant(s: int, *, w: int, t: int) -> float:
    return 1.0


def constant_with_warmup(s: int, *, w: int, t: int) -> float:
    return _warm(s, w) if s < w else 1.0


def inverse_sqrt(s: int, *, w: int, t: int) -> float:
    timescale = w or 10_000
    return _warm(s, w) if s < w else 1.0 / math.sqrt((s + timescale - w) / timescale)


def cosine_with_min_lr(s: int, *, w: int, t: int, min_lr_rate: float = 0.1) -> float:
    if s < w:
        return _warm(s, w)
    progress = float(s - w) / float(max(1, t - w))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)) * (1 - min_lr_rate) + min_lr_rate)


def cosine_warmup_with_min_lr(s: int, *, w: int, t: int, min_lr_rate: float = 0.1) -> float:
    if s < w:
        return (s + 1.0) / max(1.0, w)
    progress = (s - w + 1.0) / max(1.0, t - w)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)) * (1 - min_lr_rate) + min_lr_rate)


def warmup_stable_decay(s: int, *, w: int, t: int) -> float:
    decay = max(1, t // 5)  # num_decay_steps: the last fifth; the rest after the warm-up is stable
    if s < w:
        return _warm(s, w)
    if s < t - decay:
        return 1.0
    return max(0.0, 1.0 - float(s - (t - decay)) / decay) if s < t else 0.0


LAMBDAS: dict[str, Callable[..., float]] = {f.__name__: f for f in (
    linear, cosine, cosine_with_restarts, polynomial, constant, constant_with_warmup, inverse_sqrt,
    cosine_with_min_lr, cosine_warmup_with_min_lr, warmup_stable_decay)}  # fmt: skip
# The kinds whose factor is still falling at the end of a run half their length (past its warm-up).
DECAYING = {"linear", "cosine", "cosine_with_restarts", "polynomial", "cosine_with_min_lr", "cosine_warmup_with_min_lr"}


def _torch_kinds(t: int) -> dict[str, Callable[[torch.optim.Optimizer], Any]]:
    """torch's schedulers that state their length (the first four decay to their end; the last warms up)."""
    return {
        "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=t),
        "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=t),
        "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=t),
        "PolynomialLR": lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=t),
        "LinearLR-warmup": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=t),
    }


def cases(steps: int, world: int) -> dict[str, tuple[Callable[[torch.optim.Optimizer], Any], bool]]:
    """Label -> (how to build the schedule, whether it must warn) for a run of ``steps`` on ``world`` processes."""
    out: dict[str, tuple[Callable[[torch.optim.Optimizer], Any], bool]] = {}
    sized = {  # (num_training_steps, num_warmup_steps) -> stretched
        # From the prepared loader: no warm-up, a few steps, half the run, 1.25x and 1.9x the run (between 1x
        # and 2x: the false alarm), and Accelerate's examples' fixed 100.
        **{(steps, w): False for w in (0, 5, steps // 2, steps * 5 // 4, steps * 19 // 10, 100)},
        # Accelerate's way: transformers' scripts multiply both by num_processes; Accelerate's examples size from
        # the unprepared loader (a little less than num_processes times the prepared one), with warm-up 100.
        **{(steps * world, w * world): True for w in (0, 5)},
        (steps * world - 3, 0): True,
        (steps * world - 3, 100): False,  # still warming up when the run ends: nothing can be said
    }
    for (t, w), stretched in sized.items():
        for kind, factor in LAMBDAS.items():
            out[f"{kind}-T{t}-W{w}"] = (partial(_lambda_lr, partial(factor, w=w, t=t)), stretched and kind in DECAYING)
    for t, stretched in ((steps, False), (steps * world, True)):
        for kind, make in _torch_kinds(t).items():
            out[f"{kind}-T{t}"] = (make, stretched and kind != "LinearLR-warmup")
    return out


def _lambda_lr(factor: Callable[[int], float], opt: torch.optim.Optimizer) -> lr_scheduler.LambdaLR:
    return lr_scheduler.LambdaLR(opt, factor)


def _named(label: str, make: Callable[[torch.optim.Optimizer], Any], opt: torch.optim.Optimizer) -> Any:
    """The schedule ``make`` builds, as an instance of a subclass called ``label`` (the warning names it)."""
    scheduler = make(opt)
    scheduler.__class__ = type(label, (type(scheduler),), {})
    return scheduler


def _run(steps: int, names: list[str] | None = None) -> list[Any]:
    """Each case's prepared schedule (or those named), stepped ``steps`` times with its optimizer."""
    chosen = cases(steps, WORLD)  # the sizes of a run on WORLD processes, whatever this run has
    model = nn.Linear(1, 1)
    labels = names if names is not None else list(chosen)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in labels]
    schedulers = [_named(label, chosen[label][0], opt) for label, opt in zip(labels, optimizers, strict=True)]
    model, *prepared = ak.prepare(model, *optimizers, *schedulers)
    for _ in range(steps):
        ak.backward(model(torch.ones(1, 1)).sum())
        for opt in prepared[: len(labels)]:
            opt.step()
        for sched in prepared[len(labels) :]:
            sched.step()
        prepared[0].zero_grad()
    return prepared[len(labels) :]


def warned_at_end_training(steps: int) -> list[str]:
    kept = _run(steps)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ak.end_training()
    del kept
    return [str(w.message) for w in seen if WARNING in str(w.message)]


def test_only_a_schedule_sized_for_num_processes_times_the_run_warns_at_end_training() -> None:
    on_rank_0, on_rank_1 = run_distributed(warned_at_end_training, (STEPS,), task_timeout=180)
    assert on_rank_1 == []  # said on the main process only
    warned = [message.split(" was sized for ")[0] for message in on_rank_0]
    expected = [label for label, (_, stretched) in cases(STEPS, WORLD).items() if stretched]
    assert len(expected) == 22 and len(cases(STEPS, WORLD)) == 110
    assert warned == expected  # once each, in the order prepared, and no other
    first = on_rank_0[0]
    assert first.startswith(f"linear-T96-W0 was sized for 96 optimizer steps but the run took {STEPS} (2x fewer, 2 pro")
    assert "stopped 50% of the way" in first and "num_training_steps = math.ceil(len(loader)" in first


def test_one_process_never_warns() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(STEPS, ["linear-T96-W0", "OneCycleLR-T96"])
        ak.end_training()


# --- without ak.end_training() --------------------------------------------------------------------


def stretched_and_returned(steps: int) -> int:
    _run(steps, ["linear-T96-W0", "cosine-T48-W60", "OneCycleLR-T96"])  # dropped here: judged at once
    return 0


def test_a_function_that_never_calls_end_training_is_warned_when_its_schedule_is_dropped(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert run_distributed(stretched_and_returned, (STEPS,)) == [0, 0]
    err = capfd.readouterr().err
    assert err.count(WARNING) == 2, err  # rank 0 only; the false alarm's shape (warm-up 1.25x) says nothing
    assert "linear-T96-W0 was sized for 96" in err and "OneCycleLR-T96 was sized for 96" in err


SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
import accelkit as ak
from test_schedule_check import _run

ak.init()
schedulers = _run(48, {names!r})  # kept to the end of the script, which never calls ak.end_training()
sys.stdout.write(f"trained {{ak.rank()}}\\n")  # one write: the ranks share the launcher's stdout
"""


@pytest.mark.slow
def test_a_launched_script_that_never_calls_end_training_is_warned_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    names = ["linear-T96-W10", "polynomial-T48-W60"]  # stretched; sized right, with the false alarm's warm-up
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent), names=names)))
    done = subprocess.run(
        [sys.executable, "-m", "accelkit", "launch", "-n", "2", "--cpu", str(script)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "trained 0" in done.stdout and "trained 1" in done.stdout
    assert done.stderr.count(WARNING) == 1, done.stderr  # rank 0, the stretched one
    assert "linear-T96-W10 was sized for 96 optimizer steps but the run took 48" in done.stderr
