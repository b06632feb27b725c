"""The optimizer step reads nothing back from the device: counted against the raw loop it replaces.

On the CPU every read is cheap, but the same reads on a GPU are host-device synchronisations:
each stalls the host until the device drains. So the prepared loop may read a value back no
more often than the hand-written loop (autocast, GradScaler) does. tests/test_gpu.py checks
the same loop on CUDA under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelkit as ak
from accelkit._backends.cpu import CPUBackend

# Tensor methods that copy a value back to the host; GradScaler.get_scale() is one too.
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
STEPS = 6


@contextmanager
def counting_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()

    def counted(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        patch.setattr(owner, name, wrapper)

    with monkeypatch.context() as patch:
        for name in READS:
            counted(torch.Tensor, name)
        counted(torch.amp.GradScaler, "get_scale")
        yield counts


def model_and_data() -> tuple[nn.Module, torch.utils.data.TensorDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(STEPS * 4, 8, generator=torch.Generator().manual_seed(1)) * 1e-3  # small: fp16 does not overflow
    return model, torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "fused":  # skips overflowing steps on the device (GradScaler passes it found_inf)
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def raw_loop(precision: str, kind: str, with_scheduler: bool, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The loop accelkit replaces, written the way the PyTorch AMP recipe writes it."""
    model, data = model_and_data()
    opt = optimizer(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=4))  # its seed is drawn (read) here
    with counting_reads(monkeypatch) as counts:
        for x, y in batches:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if with_scheduler:
                sched.step()
            opt.zero_grad()
    return counts


def accelkit_loop(precision: str, kind: str, with_scheduler: bool, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    ak.init(precision=precision)  # type: ignore[arg-type]
    model, data = model_and_data()
    opt = optimizer(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    model, opt, loader, sched = ak.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4), sched)
    batches = iter(loader)
    with counting_reads(monkeypatch) as counts:
        for x, y in batches:
            loss = F.mse_loss(model(x), y)
            ak.backward(loss)
            opt.step()
            if with_scheduler:
                sched.step()
            opt.zero_grad()
    return counts


@pytest.mark.parametrize(
    ("precision", "kind", "with_scheduler"),
    [
        ("no", "plain", True),
        ("bf16", "plain", True),
        ("fp16", "plain", True),  # GradScaler reads the overflow flag itself (raw does too); accelkit adds none
        ("fp16", "plain", False),
        ("fp16", "fused", False),  # nothing is read: the optimizer skips on the device
    ],
)
def test_the_step_path_reads_no_more_than_the_raw_loop(
    precision: str, kind: str, with_scheduler: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = raw_loop(precision, kind, with_scheduler, monkeypatch)
    ours = accelkit_loop(precision, kind, with_scheduler, monkeypatch)
    assert sum(ours.values()) <= sum(raw.values()), (dict(ours), dict(raw))
    assert ours["get_scale"] == 0
    if precision == "fp16" and kind == "plain":
        assert raw["item"] >= STEPS  # the counting sees GradScaler's own read: it can see ours
    if kind == "fused":
        assert sum(raw.values()) == 0


def test_a_scheduler_of_a_fused_fp16_optimizer_reads_the_flag_in_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one read per step the raw loop does not make (it steps its scheduler even on skipped
    # steps). On the CPU the flag is in host memory, so it is read at once; where reading would
    # wait for a device, it is read one step later (below, and on CUDA in tests/test_gpu.py).
    raw = raw_loop("fp16", "fused", True, monkeypatch)
    ours = accelkit_loop("fp16", "fused", True, monkeypatch)
    assert sum(raw.values()) == 0
    assert ours["get_scale"] == 0 and sum(ours.values()) == STEPS


@contextmanager
def reads_as_on_a_gpu(log: list[str]) -> Iterator[None]:
    """The CPU backend hands out readers for later, as the CUDA backend does for device flags."""

    def read_later(self: CPUBackend, flag: torch.Tensor) -> Any:
        log.append("deferred")
        return lambda: log.append("read") or bool(flag)

    original = CPUBackend.read_later
    CPUBackend.read_later = read_later  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        CPUBackend.read_later = original  # type: ignore[method-assign]


# --- what the lazy outcome must still get right ----------------------------------------------


def fused_fp16_setup(lr: float = 1.0) -> tuple[nn.Module, Any, Any, list[float]]:
    ak.init(precision="fp16")
    model = nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    used: list[float] = []  # the learning rate each real step of the user's optimizer ran with
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    model, opt, sched = ak.prepare(model, opt, sched)
    return model, opt, sched, used


def fp16_step(model: nn.Module, opt: Any, sched: Any, value: float, log: list[str] | None = None) -> None:
    ak.backward(model(torch.full((1, 2), value)).sum() * 1e-3)  # scaled by 2**16: still finite in fp16
    if log is not None:
        log.append("step")
    opt.step()
    sched.step()
    opt.zero_grad()


@pytest.mark.parametrize("later", [False, True], ids=["read at once", "read one step later"])
def test_a_scheduler_holds_on_an_overflow_of_a_fused_optimizer(later: bool) -> None:
    log: list[str] = []
    with reads_as_on_a_gpu(log) if later else contextlib.nullcontext():
        model, opt, sched, used = fused_fp16_setup()
        for value in (1e-3, 1e-3, math.inf, 1e-3, 1e-3):
            fp16_step(model, opt, sched, value, log)
        # The third step overflowed: the fused optimizer ran but changed nothing, the scheduler held.
        assert used == [1.0, 0.5, 0.25, 0.25, 0.125]
        assert sched.get_last_lr() == [0.0625]  # reading the scheduler applies a pending step
        assert not opt.step_was_skipped
    if later:  # each step's flag is read at the next step, before the optimizer runs
        assert log[:7] == ["step", "deferred", "step", "read", "deferred", "step", "read"]
        assert log.count("read") == 5


def test_the_outcome_is_read_when_asked_and_state_dicts_see_the_scheduled_rate() -> None:
    with reads_as_on_a_gpu([]):
        model, opt, sched, _ = fused_fp16_setup()
        fp16_step(model, opt, sched, math.inf)
        assert opt.step_was_skipped
        fp16_step(model, opt, sched, 1e-3)
        assert not opt.step_was_skipped
        assert opt.state_dict()["param_groups"][0]["lr"] == 0.5  # the pending scheduler step, applied first
        assert sched.state_dict()["last_epoch"] == 1
        assert opt.param_groups[0]["lr"] == 0.5


def test_step_closures_are_refused_under_fp16() -> None:
    ak.init(precision="fp16")
    model = nn.Linear(2, 1)
    opt = ak.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    ak.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(ValueError, match=r"step\(closure\) under fp16.*SGD.*precision='bf16'"):
        opt.step(lambda: 0.0)


def test_clip_on_a_micro_step_divides_by_the_scale_without_reading_it(monkeypatch: pytest.MonkeyPatch) -> None:
    ak.init(precision="fp16")
    model = nn.Linear(2, 1, bias=False)
    nn.init.ones_(model.weight)
    model, _ = ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with ak.accumulate(model, steps=2):
        ak.backward(model(torch.full((1, 2), 0.25)).sum())  # gradient [1/8, 1/8] after the division by 2
        with counting_reads(monkeypatch) as counts:
            norm = ak.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert sum(counts.values()) == 0
    assert norm.item() == pytest.approx(math.sqrt(2) / 8)


def test_the_step_hook_goes_with_the_state() -> None:
    ak.init(precision="fp16")
    model = nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = ak.prepare(inner)
    ak.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    assert len(inner._optimizer_step_post_hooks) == 1
    ak.reset_state()
    gc.collect()
    assert len(inner._optimizer_step_post_hooks) == 0  # a user's optimizer keeps nothing of a dropped state
