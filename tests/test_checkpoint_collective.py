"""``save_state`` is collective: one called on the main process only fails fast, naming the others."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import accelkit as ak
from accelkit.testing import run_distributed


def save_on_main_only(directory: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, opt = ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        opt.zero_grad()
        ak.backward(model(torch.randn(8, 4)).pow(2).mean())
        opt.step()
        if ak.is_main_process():  # the single-process habit
            ak.save_state(directory, model=model, step=step)


@pytest.mark.distributed
def test_save_state_on_the_main_process_only_fails_within_seconds(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ak.WorkerError) as info:
        # A hang would end at the 120 s collective timeout with gloo's text, not this error.
        run_distributed(save_on_main_only, (str(tmp_path / "ckpt"),), num_processes=2, timeout=120)
    first = info.value.failures[0]
    assert first.rank == 0 and first.exc_type == "accelkit.errors.DistributedOperationError", info.value
    for part in ("every process must call save_state (it is collective)", "process 1 went on without it",
                 "(it waits for every process)",
                 "not under `if ak.is_main_process():`"):  # fmt: skip
        assert part in first.message, first.message
    assert not (tmp_path / "ckpt").exists(), "nothing is written"
    # The wait polls the store: a store wait that times out logs a line of torch's C++ on every try.
    assert "waitForInput" not in capfd.readouterr().err
