"""Train on scikit-learn's digits with less communication: local SGD, or a compressed gradient all-reduce.

    python examples/local_sgd.py                        # local SGD: parameters averaged every 8 steps
    python examples/local_sgd.py --local-sgd-steps 16   # ... every 16
    python examples/local_sgd.py --comm-hook fp16       # every step, the gradients all-reduced in fp16
    python examples/local_sgd.py --comm-hook power_sgd  # ... as rank-1 approximations (PowerSGD)

Local SGD (Accelerate's ``LocalSGD``): each process steps on its own gradients and the processes
average their parameters every K optimizer steps, and at the end of each epoch (leaving the
``with`` block), before the test set is scored. A DDP communication hook (Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)``) keeps the gradient exchange of every step but
sends less. Like ``digits.py`` (whose model and data this reuses) it runs on every GPU, else on 2
CPU processes, and under ``accelkit launch``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from digits import DigitsNet, default_num_processes, digits
from torch.utils.data import DataLoader

import accelkit as ak


def train(epochs: int = 10, lr: float = 3e-3, local_sgd_steps: int = 8, comm_hook: str = "no") -> float:
    """Train and evaluate; returns the final test accuracy. ``local_sgd_steps`` 0 turns local SGD off."""
    ak.set_seed(0)
    with ak.main_process_first():
        train_set, test_set = digits(0)
    model = DigitsNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loaders = DataLoader(train_set, batch_size=32, shuffle=True), DataLoader(test_set, batch_size=64)
    # PowerSGD starts compressing after 1,000 steps by default; these runs are shorter.
    hook_options = {"start_powerSGD_iter": 10} if comm_hook == "power_sgd" else None
    model, optimizer, train_loader, test_loader = ak.prepare(
        model, optimizer, *loaders, comm_hook=comm_hook, comm_hook_options=hook_options
    )
    accuracy, steps, averages = 0.0, 0, 0
    for epoch in range(1, epochs + 1):
        model.train()
        # One block per epoch: leaving it averages the parameters, so every rank scores the same model.
        with ak.local_sgd(model, steps=local_sgd_steps or 1, enabled=local_sgd_steps > 0) as sync:
            for images, labels in train_loader:
                loss = F.cross_entropy(model(images), labels)
                ak.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                sync.step()  # every local_sgd_steps-th step: the parameters are averaged
        steps, averages = steps + sync.num_steps, averages + sync.num_averages
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in test_loader:
                predictions, labels = ak.gather_for_metrics((model(images).argmax(dim=1), labels))
                correct += int((predictions == labels).sum())
                total += len(labels)
        accuracy = correct / total
        ak.print(f"epoch {epoch}: loss {loss.item():.3f}, test accuracy {accuracy:.3f}")
    exchange = f"{averages} parameter averages" if averages else f"{steps} gradient all-reduces ({comm_hook} hook)"
    ak.print(f"{steps} optimizer steps per process, {exchange}")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=None, help="default: one per GPU, else 2 on the CPU")
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes even where GPUs are visible")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--local-sgd-steps", type=int, default=None, help="average every K steps (default 8)")
    how.add_argument("--comm-hook", choices=["fp16", "bf16", "power_sgd"], default=None, help="instead of local SGD")
    args = parser.parse_args()
    local_sgd_steps = 0 if args.comm_hook else (8 if args.local_sgd_steps is None else args.local_sgd_steps)
    accuracy = ak.launch(
        train,
        (args.epochs, args.lr, local_sgd_steps, args.comm_hook or "no"),
        num_processes=args.num_processes or default_num_processes(args.cpu),
        cpu=args.cpu or None,
    )
    ak.print(f"test accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
