"""Saves over and over, for the race tests of test_checkpoint_integrity.py: every save's state is its number.

    python integrity_race_script.py ROOT same|prune SECONDS

``same`` saves into ``ROOT/ckpt`` each time; ``prune`` into ``ROOT/step-I`` with ``keep_last=1``. ROOT may
be a URL (``s3://bucket/run``). Save
``I`` (1, 2, ...) fills every parameter and every tensor of the optimizer's state with ``float(I)``, so
that a load that mixes two saves is told by its values alone (:func:`filled_with`).
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

WIDTH = 512  # 1 MiB of weights, 2 MiB of optimizer state: a save takes long enough to be caught mid-way


def make() -> tuple[nn.Linear, torch.optim.Adam]:
    """The model and its Adam, after one step (so that the optimizer has state)."""
    model = nn.Linear(WIDTH, WIDTH)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def fill(model: nn.Module, opt: torch.optim.Optimizer, value: float) -> None:
    """Every parameter and every tensor of the optimizer's state set to ``value``."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
            for tensor in opt.state[param].values():
                tensor.fill_(value)


def filled_with(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[float]]:
    """The distinct values of each parameter and optimizer tensor, by name (one value each when consistent)."""
    found = {}
    for name, param in model.named_parameters():
        found[name] = sorted(set(param.detach().flatten().tolist()))
        for key, tensor in sorted(opt.state[param].items()):
            found[f"{name}.{key}"] = sorted(set(tensor.detach().flatten().tolist()))
    return found


def main() -> None:
    import accelkit as ak

    root, mode, seconds = sys.argv[1].rstrip("/"), sys.argv[2], float(sys.argv[3])
    model, opt = make()
    end, step = time.monotonic() + seconds, 0
    while time.monotonic() < end:  # the test kills it long before
        step += 1
        fill(model, opt, float(step))
        if mode == "same":
            ak.save_state(f"{root}/ckpt", model=model, optimizer=opt, step=step)
        else:
            ak.save_state(f"{root}/step-{step}", keep_last=1, model=model, optimizer=opt, step=step)


if __name__ == "__main__":
    main()
