"""save_state and ak.accumulate windows: between windows it resumes bit-exact, with gradients pending it refuses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak
from accelkit._checkpoint import CheckpointError
from accelkit.testing import WorkerPool

BATCHES = 7  # per epoch and rank: odd, so that the last window of an epoch is short and the windows shift
TOTAL = 2 * BATCHES + 3  # into a third epoch


def make_run() -> tuple[Any, Any, Any]:
    ak.set_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(7)
    n = BATCHES * ak.world_size()
    dataset = TensorDataset(torch.randn(n, 3, generator=data), torch.randn(n, 1, generator=data))
    return ak.prepare(model, opt, DataLoader(dataset, batch_size=1, shuffle=True))


def train(root: str, steps: int, save_at: int = 0, resume: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """``TOTAL`` batches in windows of ``steps``; a save after batch ``save_at``: (the weights, its refusal or '')."""
    model, opt, loader = make_run()
    done, refused = 0, ""
    if resume:
        done = ak.load_state(f"{root}/ckpt", model=model, optimizer=opt)["done"]
    while done < TOTAL:
        for x, y in loader:
            with ak.accumulate(model, steps=steps):
                ak.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            done += 1
            if done == save_at:
                try:
                    ak.save_state(f"{root}/ckpt", model=model, optimizer=opt, done=done)
                except CheckpointError as exc:
                    refused = str(exc)
            if done == TOTAL:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, refused


def boundaries(steps: int) -> set[int]:
    """The batches after which a window is closed: every ``steps``-th of an epoch and its last."""
    return {e * BATCHES + b for e in range(3) for b in range(1, BATCHES + 1) if b % steps == 0 or b == BATCHES}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("steps", [2, 3])
def test_every_offset_of_the_window_resumes_exactly_or_is_refused(tmp_path: Path, steps: int) -> None:
    reference, _ = train(str(tmp_path / "ref"), steps)
    closed = boundaries(steps)
    for save_at in range(1, TOTAL):
        root = tmp_path / f"at-{save_at}"
        ak.reset_state()
        finished, refused = train(str(root), steps, save_at=save_at)
        assert_equal(finished, reference)  # a refused save changes nothing in the run
        if save_at in closed:
            assert refused == "", f"batch {save_at} closes a window"
            ak.reset_state()
            torch.manual_seed(999)  # whatever the RNG was, the checkpoint brings it back
            resumed, _ = train(str(root), steps, resume=True)
            assert_equal(resumed, reference)
            continue
        assert f"accelkit.save_state({str(root / 'ckpt')!r}): an unfinished ak.accumulate window" in refused
        assert "has pending gradients" in refused
        assert "save when ak.sync_gradients() is True" in refused
        assert "`if ak.sync_gradients(): ak.save_state(...)`" in refused
        assert not root.exists() or os.listdir(root) == [], "nothing is written: no checkpoint, no temporary directory"
    offsets = {(save_at - 1) % BATCHES % steps for save_at in set(range(1, TOTAL)) - closed}
    assert offsets == set(range(steps - 1)), "refused at every micro-step of a window but its last"


def test_inside_the_region_the_refusal_names_the_micro_step(tmp_path: Path) -> None:
    model, opt, _ = make_run()
    x = torch.randn(2, 3)
    with ak.accumulate(model, steps=3):  # micro-step 1, before its backward: nothing pending yet
        ak.save_state(tmp_path / "before", model=model, optimizer=opt)
        ak.backward(model(x).sum())
    with ak.accumulate(model, steps=3):
        ak.backward(model(x).sum())
        with pytest.raises(CheckpointError, match=r"micro-step 2 of 3 of an ak\.accumulate\(steps=3\) window has pen"):
            ak.save_state(tmp_path / "a", model=model, optimizer=opt)
    with ak.accumulate(model, steps=3):
        ak.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        assert ak.sync_gradients()
        ak.save_state(tmp_path / "b", model=model, optimizer=opt)  # the window's last micro-step, stepped
    assert sorted(os.listdir(tmp_path)) == ["b", "before"]


def save_mid_window(root: str) -> tuple[str, list[str]]:
    """Two processes: a save at micro-step 1 of 2 (refused on each rank), then one after the step (saved)."""
    model, opt, loader = make_run()
    refused = ""
    for i, (x, y) in enumerate(loader):
        with ak.accumulate(model, steps=2):
            ak.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if i == 0:
            try:
                ak.save_state(f"{root}/mid", model=model, optimizer=opt)
            except CheckpointError as exc:
                refused = str(exc)
        if i == 1:
            ak.save_state(f"{root}/boundary", model=model, optimizer=opt, blocking=False)
    ak.wait_for_checkpoint()
    return refused, sorted(os.listdir(root))


def test_every_rank_refuses_alike_and_saves_on(pool: WorkerPool, tmp_path: Path) -> None:
    (refused_0, listed), (refused_1, _) = pool.run(save_mid_window, str(tmp_path))
    assert refused_0 == refused_1 and "has pending gradients" in refused_0
    assert listed == ["boundary"], "the refused save wrote nothing; the next one, collective as ever, did"
