"""Training-step cost: accelkit's four-line loop vs a hand-written DDP loop, 2 gloo processes.

Both loops see the same per-rank batches (the raw loop uses accelkit's shard order through
a plain sampler) and make the same updates, so their losses must agree bit for bit. Per model size
and accumulation setting, each loop is built once in the same two workers (each built first in half
of the launches: where a loop's memory lands moves its figure by several µs), and then they take
**one step each in turn**, in an order drawn at random for each pair (the same on both ranks: the
all-reduce pairs them up), so that what the machine's other load does to one step, it does to the
other's neighbour too:
- CPU per step: the main thread's CPU time (``time.thread_time``) of each step, batch fetch to
  ``zero_grad``: what accelkit adds per step, backward included, without the time a rank waits for
  the other's all-reduce (gloo's own threads do that work). The pairs are pooled into blocks of one
  epoch's steps; the row's ``diff`` is the median over the blocks of (accelkit - raw) per step,
  as is each side's figure;
- steps/s: the same blocks' wall time;
- a control: the hand-written loop against a copy of itself, measured the same way (tiny MLP);
- peak RSS per worker, from separate launches of each loop alone (three each, in turn).
Run alone: ``python bench/train_step.py [--quick]``.
"""

from __future__ import annotations

import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, paired_row

SIZES = {"tiny": (32, 32, 8), "medium": (512, 2048, 64)}  # features, hidden, per-rank batch


def _model(size: str) -> nn.Module:
    features, hidden, _ = SIZES[size]
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


def _data(size: str, steps: int, world: int) -> torch.utils.data.TensorDataset:
    features, _, batch = SIZES[size]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch * world, features, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


class _ShardOrder(torch.utils.data.Sampler[int]):
    """accelkit's shard order written out by hand: rank r takes slice r of each global batch."""

    def __init__(self, n: int, batch: int, rank: int, world: int) -> None:
        self.indices = [
            i for start in range(0, n, batch * world) for i in range(start + rank * batch, start + (rank + 1) * batch)
        ]

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


Steps = Iterator[torch.Tensor]  # one training step per next(): its loss; epoch after epoch


def _raw_steps(size: str, steps: int, accumulation: int) -> Steps:
    """A hand-written DDP loop over epochs of ``steps`` batches, one step per ``next()``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = _data(size, steps, world)
    batch = SIZES[size][2]
    model = nn.parallel.DistributedDataParallel(_model(size))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=_ShardOrder(len(data), batch, rank, world))
    while True:
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % accumulation == 0
            with model.no_sync() if not boundary else torch.enable_grad():
                out = model(x)
                loss = nn.functional.mse_loss(out, y)
                (loss / accumulation if accumulation > 1 else loss).backward()
            if boundary:
                opt.step()
                opt.zero_grad()
            yield loss


def _accelkit_steps(size: str, steps: int, accumulation: int) -> Steps:
    """The same loop with accelkit."""
    import accelkit as ak

    data = _data(size, steps, ak.world_size())
    model = _model(size)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=SIZES[size][2])
    model, opt, loader = ak.prepare(model, opt, loader)
    while True:
        for x, y in loader:
            with ak.accumulate(model, steps=accumulation):
                out = model(x)
                loss = nn.functional.mse_loss(out, y)
                ak.backward(loss)
                opt.step()
                opt.zero_grad()
            yield loss


LOOPS: dict[str, Callable[[str, int, int], Steps]] = {"raw": _raw_steps, "accelkit": _accelkit_steps}


def paired_steps(
    size: str, steps: int, accumulation: int, pairs: int, subject: str = "accelkit", subject_first: bool = False
) -> tuple[list[tuple[int, int, int, int]], tuple[float, float]]:
    """In each worker: the raw loop and ``subject``'s built in the order given, then ``pairs`` steps
    of each, one each in turn, in a random order the ranks share; per pair (raw CPU ns, raw wall ns,
    subject's CPU ns, wall ns), and both loops' last losses."""
    import accelkit as ak

    ak.state()  # join the group once
    built = [LOOPS[subject], _raw_steps] if subject_first else [_raw_steps, LOOPS[subject]]
    loops = [make(size, steps, accumulation) for make in built]
    raw, ours = loops if not subject_first else loops[::-1]
    for _ in range(2 * steps):  # warm up both (DDP lays its buckets out again after the first step)
        next(raw), next(ours)
    order = random.Random(steps * 1009 + accumulation)  # the same on every rank
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    out = []
    for _ in range(pairs):
        first = order.random() < 0.5
        times = []
        for loop in (raw, ours) if first else (ours, raw):
            wall, start = clock(), cpu()
            next(loop)
            times.append((cpu() - start, clock() - wall))
        (raw_cpu, raw_wall), (our_cpu, our_wall) = times if first else times[::-1]
        out.append((raw_cpu, raw_wall, our_cpu, our_wall))
    return out, (next(raw).item(), next(ours).item())


def both_orders(
    size: str, steps: int, accumulation: int, pairs: int, subject: str = "accelkit", launches: int = 8
) -> tuple[list[tuple[float, ...]], list[tuple[float, float]]]:
    """Rank 0's pairs from ``launches`` launches (each loop built first in every other one), pooled
    into blocks of ``steps`` pairs: per block (raw CPU µs, raw steps/s, subject's CPU µs, steps/s)
    per step; and each launch's last losses."""
    from accelkit.testing import run_distributed

    blocks, losses = [], []
    for launch in range(launches):
        args = (size, steps, accumulation, pairs, subject, launch % 2 == 1)
        found, last = run_distributed(paired_steps, args, task_timeout=900)[0]
        losses.append(last)
        for start in range(0, len(found) - steps + 1, steps):
            block = found[start : start + steps]
            raw_cpu, raw_wall, our_cpu, our_wall = (sum(col) for col in zip(*block, strict=True))
            blocks.append(
                (raw_cpu / steps / 1e3, steps / raw_wall * 1e9, our_cpu / steps / 1e3, steps / our_wall * 1e9)
            )
    return blocks, losses


def _steps_alone(kind: str, size: str, steps: int) -> None:
    loop = (_raw_steps if kind == "raw" else _accelkit_steps)(size, steps, 1)
    for _ in range(steps):
        next(loop)


def peak_rss(kind: str, size: str, steps: int) -> int:
    """KiB: one loop alone in fresh workers."""
    import accelkit as ak

    ak.state()
    _steps_alone(kind, size, steps)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run(quick: bool) -> list[Row]:
    from accelkit.testing import run_distributed

    rows: list[Row] = []
    # (size, steps per epoch and block, pairs per launch, launches)
    sizes = (("tiny", 48, 480 if quick else 1200, 2 if quick else 8), ("medium", 24, 48 if quick else 120, 2))
    for size, steps, pairs, launches in sizes:
        for accumulation in (1, 4):
            blocks, losses = both_orders(size, steps, accumulation, pairs, launches=launches)
            raw_cpu, raw_rate, ak_cpu, ak_rate = (list(col) for col in zip(*blocks, strict=True))
            label = f"{size} MLP, accumulation {accumulation}"
            row = paired_row(f"train step/s: {label}", ak_rate, raw_rate, unit="/s")
            row["target"], row["ok"] = None, None
            rows.append(row)
            rows.append(
                paired_row(
                    f"CPU per step (thread time): {label}",
                    ak_cpu,
                    raw_cpu,
                    target=10.0 if size == "tiny" else None,
                    unit="us",
                )
            )
            rows.append(
                {
                    "name": f"final loss bit-identical: {label}",
                    "unit": "",
                    "accelkit": losses[0][1],
                    "reference": losses[0][0],
                    "diff": None,
                    "ratio": None,
                    "target": None,
                    "ok": all(ours == raw for raw, ours in losses),
                    "n": len(losses),
                }
            )
        if size == "tiny":
            rows.extend(_control(steps, pairs, launches))
        raw_rss: list[int] = []
        ak_rss: list[int] = []
        for _ in range(3):  # a launch's peak moves by a few MiB with where its memory lands
            raw_rss += run_distributed(peak_rss, ("raw", size, steps))
            ak_rss += run_distributed(peak_rss, ("accelkit", size, steps))
        rows.append(
            paired_row(
                f"peak RSS per worker: {size} MLP",
                [k / 1024 for k in ak_rss],
                [k / 1024 for k in raw_rss],
                target=2.0,
                unit="MiB",
            )
        )
    return rows


def _control(steps: int, pairs: int, launches: int) -> list[Row]:
    """The hand-written loop against a second copy of itself, measured as accelkit's is: how far the
    figure moves when nothing differs (its median diff should be about 0)."""
    rows = []
    for accumulation in (1, 4):
        blocks, _ = both_orders("tiny", steps, accumulation, pairs, subject="raw", launches=launches)
        row = paired_row(
            f"CPU per step (thread time): tiny MLP, accumulation {accumulation}, hand-written "
            "against itself (the measurement's spread)",
            [b[2] for b in blocks],
            [b[0] for b in blocks],
            unit="us",
        )
        row["ok"] = None
        rows.append(row)
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
