"""Train a small CNN on scikit-learn's digits (8x8 images, 10 classes) with accelkit.

    python examples/digits.py --epochs 10
    tensorboard --logdir runs          # the curves: loss, learning rate, test accuracy

The same script runs unchanged on a CPU-only machine (2 CPU processes), on one GPU or on
several (one process per visible GPU), and under torchrun or `accelkit launch`;
``--num-processes N`` and ``--cpu`` choose otherwise. The data set ships with scikit-learn:
nothing is downloaded. Rank 0 logs the training loss and learning rate every step and the test
accuracy every epoch to TensorBoard and a CSV file under runs/digits/ (or to the trackers chosen
by --log-with, `accelkit launch --log-with`, ...).
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak

logging.basicConfig(format="%(message)s")  # module level: spawned workers import it too


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 digits, scaled to [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def train(
    epochs: int = 10, batch_size: int = 32, lr: float = 3e-3, seed: int = 0, log_with: str | None = None
) -> float:
    """Train and evaluate; returns the final test accuracy (the same on every rank)."""
    logger = ak.get_logger("digits", log_level="INFO")
    ak.set_seed(seed)
    with ak.main_process_first():
        train_set, test_set = digits(seed)
    model = DigitsNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model, optimizer, train_loader, test_loader = ak.prepare(model, optimizer, train_loader, test_loader)
    # Size the schedule from the prepared loader: it steps once per real optimizer step.
    scheduler = ak.prepare(torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=epochs * len(train_loader)))
    # Trackers: --log-with, else the configured ones (`accelkit launch --log-with`, ACCELKIT_LOG_WITH), else these.
    trackers = log_with or ak.state().options.log_with or ("tensorboard", "csv")
    hparams = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "seed": seed, "processes": ak.world_size()}
    ak.init_trackers("digits", hparams, log_with=trackers)  # rank 0 writes; closed by ak.end_training()
    accuracy, step = 0.0, 0
    for epoch in range(1, epochs + 1):
        model.train()
        bar = ak.progress(train_loader, desc=f"epoch {epoch}", leave=False)  # drawn once per machine
        for images, labels in bar:
            loss = F.cross_entropy(model(images), labels)
            ak.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            ak.log({"train/loss": loss, "train/lr": scheduler.get_last_lr()[0]}, step=step)  # other ranks: no-op
            if ak.is_local_main_process():
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)  # redrawn at tqdm's own pace
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in test_loader:
                predictions, labels = ak.gather_for_metrics((model(images).argmax(dim=1), labels))
                correct += int((predictions == labels).sum())
                total += len(labels)
        accuracy = correct / total
        ak.log({"eval/accuracy": accuracy, "epoch": epoch}, step=step)
        logger.info("epoch %d: last loss %.3f, test accuracy %.3f on %d samples", epoch, loss.item(), accuracy, total)
    ak.end_training()
    return accuracy


def default_num_processes(cpu: bool) -> int:
    """One process per visible GPU; 2 CPU processes where there is none (or with --cpu)."""
    return (0 if cpu else torch.cuda.device_count()) or 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=None, help="default: one per GPU, else 2 on the CPU")
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes even where GPUs are visible")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", choices=["no", "fp16", "bf16"], default=None, help="default: the config's")
    parser.add_argument("--log-with", default=None, help="trackers, e.g. tensorboard,csv (the default) or jsonl")
    parser.add_argument("--project-dir", default=None, help="where the trackers write (default: runs)")
    args = parser.parse_args()
    accuracy = ak.launch(
        train,
        (args.epochs, args.batch_size, args.lr, 0, args.log_with),
        num_processes=args.num_processes or default_num_processes(args.cpu),
        precision=args.precision,
        cpu=args.cpu or None,  # None: ACCELKIT_CPU or the config file decide
        project_dir=args.project_dir,
    )
    ak.print(f"test accuracy: {accuracy:.3f}")  # once, also under `accelkit launch`


if __name__ == "__main__":
    main()
