"""Training bit-identical to Accelerate's: the same script, ported by the migration table, run by both.

Two gloo CPU processes train a small model with dropout, with gradient accumulation, on a shuffled loader
(with and without a ``generator``) and evaluate on an unshuffled one every epoch, user code drawing from the
global RNG too: every loss, every evaluation and the final weights must be equal to the bit, also after an
interruption and a resume from ``ak.save_state``. Accelerate runs in workers of their own (its state is a
process-wide singleton); accelkit in the session's worker pool.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak
from accelkit.testing import WorkerPool, run_distributed

pytest.importorskip("accelerate")

pytestmark = pytest.mark.distributed

SEED, EPOCHS, ACCUMULATION, DATA_SEED = 1234, 3, 2, 99
# The training loader: shuffled by its generator, by the global RNG (none given), or by data_seed (Accelerate's
# use_seedable_sampler); the evaluation loader draws its base seeds from the global RNG in every mode.
MODES = ("generator", "global-rng", "data-seed")
SAVE_AT = (1, 2)  # the checkpoint: epoch 1, after its second micro-batch (a window's end)


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)  # the data itself does not draw from the global RNG
    x, w = torch.randn(37, 6, generator=g), torch.randn(6, 1, generator=g)  # 37: a padded last global batch
    x_eval = torch.randn(13, 6, generator=g)
    return TensorDataset(x, x @ w), TensorDataset(x_eval, x_eval @ w)


def _parts(mode: str) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any], DataLoader[Any]]:
    """The model, optimizer and loaders, built after the seed: model init and dropout draw from the global RNG."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    train, evaluation = _data()
    generator = torch.Generator().manual_seed(7) if mode == "generator" else None
    loader = DataLoader(train, batch_size=4, shuffle=True, generator=generator)
    return model, opt, loader, DataLoader(evaluation, batch_size=4)


def _noisy(x: torch.Tensor) -> torch.Tensor:
    return x + 0.01 * torch.randn_like(x)  # user code drawing from the global RNG, as an augmentation would


def _weights(model: nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def _train(
    parts: tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any], DataLoader[Any]],
    epochs: range,
    accumulate: Callable[[nn.Module], AbstractContextManager[Any]],
    backward: Callable[[torch.Tensor], None],
    gather_for_metrics: Callable[[Any], Any],
    after_batch: Callable[[int, int], None] = lambda epoch, batch: None,
) -> dict[str, Any]:
    """The training script, written once: each framework passes its own spelling of the calls."""
    model, opt, loader, eval_loader = parts
    losses: list[list[float]] = []
    evals: list[float] = []
    for epoch in epochs:
        model.train()
        losses.append([])
        for x, y in loader:
            with accumulate(model):
                loss = nn.functional.mse_loss(model(_noisy(x)), y)
                backward(loss)
                opt.step()
                opt.zero_grad()
            losses[-1].append(loss.item())
            after_batch(epoch, len(losses[-1]))
        model.eval()
        predictions, targets = [], []
        for x, y in eval_loader:
            with torch.no_grad():
                p, t = gather_for_metrics((model(x), y))
            predictions.append(p)
            targets.append(t)
        evals.append(nn.functional.mse_loss(torch.cat(predictions), torch.cat(targets)).item())
    return {"losses": losses, "evals": evals}


def train_with_accelerate() -> dict[str, dict[str, Any]]:
    """The script run by Accelerate in each mode, one after the other, each from the seed."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    results = {}
    for mode in MODES:
        seedable = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=DATA_SEED)
        config = seedable if mode == "data-seed" else DataLoaderConfiguration()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, dataloader_config=config)
        set_seed(SEED)
        parts = accelerator.prepare(*_parts(mode))
        out = _train(parts, range(EPOCHS), accelerator.accumulate, accelerator.backward, accelerator.gather_for_metrics)
        results[mode] = {**out, "weights": _weights(accelerator.unwrap_model(parts[0]))}
        accelerator.free_memory()  # forgets the prepared objects and the accumulation's step count
    return results


def train_with_accelkit(mode: str, directory: str, resume: bool) -> dict[str, Any]:
    """The same script ported to accelkit; it saves a checkpoint at SAVE_AT, or starts from it (``resume``)."""
    ak.init(gradient_accumulation_steps=ACCUMULATION)
    ak.set_seed(SEED)
    data_seed = DATA_SEED if mode == "data-seed" else None  # DataLoaderConfiguration(use_seedable_sampler=True, ...)
    model, opt, loader, eval_loader = ak.prepare(*_parts(mode), data_seed=data_seed)
    start = ak.load_state(directory, model=model, optimizer=opt)["epoch"] if resume else 0

    def save_at(epoch: int, batch: int) -> None:
        if not resume and (epoch, batch) == SAVE_AT:
            ak.save_state(directory, model=model, optimizer=opt, epoch=epoch)

    parts = (model, opt, loader, eval_loader)
    out = _train(parts, range(start, EPOCHS), ak.accumulate, ak.backward, ak.gather_for_metrics, save_at)
    return {**out, "weights": _weights(ak.unwrap(model))}


@pytest.fixture(scope="module")
def accelerate_runs() -> dict[str, list[dict[str, Any]]]:
    """Accelerate's results on each rank, in each mode (in workers of their own: its state is a singleton)."""
    zero, one = run_distributed(train_with_accelerate, task_timeout=180)
    return {mode: [zero[mode], one[mode]] for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_training_is_bit_identical_to_accelerates_in_every_epoch_and_after_a_resume(
    pool: WorkerPool, accelerate_runs: dict[str, list[dict[str, Any]]], mode: str, tmp_path: Path
) -> None:
    expected = accelerate_runs[mode]
    assert [len(epoch) for epoch in expected[0]["losses"]] == [5] * EPOCHS  # 37 samples, 2 x 4 per batch
    assert expected[0]["losses"][0] != expected[0]["losses"][1]  # a new order (and new dropout) each epoch
    assert expected[0]["weights"] == expected[1]["weights"]  # DDP kept the replicas equal
    whole = pool.run(train_with_accelkit, mode, str(tmp_path), False, task_timeout=120)
    for rank in (0, 1):
        for epoch in range(EPOCHS):
            assert whole[rank]["losses"][epoch] == expected[rank]["losses"][epoch], f"rank {rank}, epoch {epoch}"
            assert whole[rank]["evals"][epoch] == expected[rank]["evals"][epoch], f"rank {rank}, epoch {epoch} eval"
        assert whole[rank]["weights"] == expected[rank]["weights"], f"rank {rank}: final weights"
    resumed = pool.run(train_with_accelkit, mode, str(tmp_path), True, task_timeout=120)
    epoch, batches = SAVE_AT
    for rank in (0, 1):
        tail = [expected[rank]["losses"][epoch][batches:], *expected[rank]["losses"][epoch + 1 :]]
        assert resumed[rank]["losses"] == tail, f"rank {rank}: the losses after the resume"
        assert resumed[rank]["evals"] == expected[rank]["evals"][epoch:], f"rank {rank}: the evaluations"
        assert resumed[rank]["weights"] == expected[rank]["weights"], f"rank {rank}: final weights after a resume"
