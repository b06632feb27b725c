"""Accelerate's own ``test_script.py`` checks, ported: ``training_check`` and the README's scheduler recipe.

``training_check`` (accelerate/test_utils/scripts/test_script.py): a baseline trains a two-scalar
regression model on one process with a plain shuffled DataLoader of batch ``8 * world`` whose
``generator`` is seeded (``set_seed(42); g.manual_seed(42)``) before training; the prepared run
trains the same model on ``world`` processes with per-process batches of 8 (Accelerate's default,
accelkit's too) or, with ``split_batches``, the global batch of 16 split, re-seeding the generator
*after* ``prepare``, and must end with the same ``a`` and ``b``: in fp32, bf16 and fp16 (the mixed
precision runs compared to the fp32 baseline with ``torch.allclose``'s tolerance, as Accelerate does).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import accelkit as ak
from accelkit.testing import WorkerPool

WORLD = 2
BATCH = 8  # per process
LENGTH = BATCH * 4 * WORLD  # Accelerate's: 4 global batches per epoch


class RegressionDataset(Dataset[dict[str, torch.Tensor]]):
    """Accelerate's test dataset: ``y = a * x + b`` plus noise, the same for the same seed."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int = 42) -> None:
        rng = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=rng)
        self.y = a * self.x + b + 0.1 * torch.randn(length, generator=rng)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}

    def __len__(self) -> int:
        return len(self.x)


class RegressionModel(torch.nn.Module):
    """Accelerate's test model: ``x * a + b``, both scalars starting at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


def baseline(batch_size: int) -> torch.Tensor:
    """Accelerate's ``mock_training``: one process, a plain DataLoader, the generator seeded first."""
    g = torch.Generator()
    ak.set_seed(42)
    g.manual_seed(42)
    loader = DataLoader(RegressionDataset(length=LENGTH), batch_size=batch_size, shuffle=True, generator=g)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for batch in loader:
            model.zero_grad()
            F.mse_loss(model(batch["x"]), batch["y"]).backward()
            optimizer.step()
    return torch.stack([model.a.detach(), model.b.detach()])


def prepared_training(precision: str, split_batches: bool) -> torch.Tensor:
    """The prepared run: the generator is re-seeded after ``ak.prepare``, as Accelerate's test does."""
    if precision != "no":
        ak.init(precision=precision)
    g = torch.Generator().manual_seed(7)  # any state at prepare time: the re-seed below decides the order
    batch_size = BATCH * ak.world_size() if split_batches else BATCH
    loader = DataLoader(RegressionDataset(length=LENGTH), batch_size=batch_size, shuffle=True, generator=g)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader, model, optimizer = ak.prepare(loader, model, optimizer, split_batches=split_batches)
    ak.set_seed(42)
    g.manual_seed(42)
    for _ in range(3):
        for batch in loader:
            model.zero_grad()
            ak.backward(F.mse_loss(model(batch["x"]), batch["y"]))
            optimizer.step()
    unwrapped = ak.unwrap(model)
    return torch.stack([unwrapped.a.detach(), unwrapped.b.detach()]).float().cpu()


@pytest.fixture(scope="module")
def expected() -> torch.Tensor:
    return baseline(BATCH * WORLD)


@pytest.mark.parametrize("split_batches", [False, True], ids=["per-process-batch", "split-batches"])
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_prepared_training_ends_with_the_baseline_model(
    pool: WorkerPool, expected: torch.Tensor, precision: str, split_batches: bool
) -> None:
    rank0, rank1 = pool.run(prepared_training, precision, split_batches)
    assert torch.equal(rank0, rank1), "the ranks trained different models"
    assert torch.allclose(rank0, expected), f"{precision}: {rank0.tolist()} != baseline {expected.tolist()}"


def test_one_process_is_the_baseline_itself() -> None:
    reference = baseline(BATCH)  # one process: batch 8 * 1, split or not
    assert torch.equal(prepared_training("no", split_batches=False), reference)
    ak.reset_state()
    assert torch.equal(prepared_training("no", split_batches=True), reference)


def test_the_check_fails_without_the_reseed(expected: torch.Tensor) -> None:
    """The order comes from the generator, not from the global seed: another seed trains another model."""
    g = torch.Generator().manual_seed(42)
    loader = ak.prepare(DataLoader(RegressionDataset(length=LENGTH), batch_size=16, shuffle=True, generator=g))
    first = [batch["x"].tolist() for batch in loader]
    g.manual_seed(43)
    assert [batch["x"].tolist() for batch in loader] != first


# --- the README's scheduler recipe ------------------------------------------------------------


def scheduler_recipe(samples: int, steps: int, epochs: int) -> tuple[int, int, int]:
    """The README's recipe: size OneCycleLR from the prepared loader, run it to its end.

    Returns (len(loader), the computed total, the scheduler's last_epoch after the run).
    """
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, samples).unsqueeze(1)
    loader = ak.prepare(DataLoader(torch.utils.data.TensorDataset(x, 3 * x + 1), batch_size=4, shuffle=True))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ak.prepare(model, optimizer)
    total = math.ceil(len(loader) / steps) * epochs
    scheduler = ak.prepare(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total))
    for _ in range(epochs):
        for xb, yb in loader:
            with ak.accumulate(model, steps=steps):
                ak.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return len(loader), total, scheduler.last_epoch


def test_the_readme_scheduler_count_runs_one_cycle_to_its_end_on_one_process() -> None:
    # 7 batches per epoch, accumulation 2: the last window of each epoch is a single batch, and steps.
    assert scheduler_recipe(28, steps=2, epochs=3) == (7, 12, 12)


def test_the_readme_scheduler_count_runs_one_cycle_to_its_end_on_two_processes(pool: WorkerPool) -> None:
    assert pool.run(scheduler_recipe, 56, 2, 3) == [(7, 12, 12)] * WORLD  # 7 batches per rank


def test_the_floor_count_was_too_small() -> None:
    """``len(loader) * epochs // steps`` (10 here) undercounts: OneCycleLR refuses the 11th step."""
    with pytest.raises(ValueError, match="Tried to step 11 times"):
        _floor_recipe()


def _floor_recipe() -> Any:
    loader = ak.prepare(DataLoader(range(28), batch_size=4))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ak.prepare(model, optimizer)
    total = len(loader) * 3 // 2
    scheduler = ak.prepare(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total))
    for _ in range(3):
        for batch in loader:
            with ak.accumulate(model, steps=2):
                ak.backward(model(batch.float().unsqueeze(1)).pow(2).mean())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
