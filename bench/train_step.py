"""Training-step cost: accelkit's four-line loop vs a hand-written DDP loop, 2 gloo processes.

Both loops see the same per-rank batches (the raw loop uses accelkit's shard order through
a plain sampler), so their final losses must agree bit for bit. Per model size and
accumulation setting, each loop is built once in the same two workers (in several launches, each
loop built first in half of them), and they run one epoch each in turn (paired rounds; epochs of
whole accumulation cycles):
- steps/s over the whole loop (ratio accelkit / raw);
- CPU per step: the main thread's CPU time (``time.thread_time``) over the whole loop, batch
  fetch to ``zero_grad``, divided by the steps: what accelkit adds per step, backward included,
  without the time a rank waits for the other's all-reduce (gloo's own threads do that work).
  The row's ``diff`` (accelkit - raw, median over the paired rounds) is the figure: many short
  rounds, as the machine's other load moves one round's figure by tens of µs;
- a control: the hand-written loop against a copy of itself, measured the same way (tiny MLP);
- peak RSS per worker, from separate launches of each loop alone.
Run alone: ``python bench/train_step.py [--quick]``.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
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


Epoch = Callable[[], tuple[float, float, float]]  # one pass over the loader: (wall s, thread CPU s, last loss)


def _raw_loop(size: str, steps: int, accumulation: int) -> Epoch:
    """A hand-written DDP loop, built once; each call runs one epoch of ``steps`` batches."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = _data(size, steps, world)
    batch = SIZES[size][2]
    model = nn.parallel.DistributedDataParallel(_model(size))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=_ShardOrder(len(data), batch, rank, world))

    def epoch() -> tuple[float, float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % accumulation == 0
            with model.no_sync() if not boundary else torch.enable_grad():
                out = model(x)
                loss = nn.functional.mse_loss(out, y)
                (loss / accumulation if accumulation > 1 else loss).backward()
            if boundary:
                opt.step()
                opt.zero_grad()
        return time.perf_counter() - start, time.thread_time() - cpu, loss.item()

    return epoch


def _accelkit_loop(size: str, steps: int, accumulation: int) -> Epoch:
    """The same loop with accelkit, built once; each call runs one epoch."""
    import accelkit as ak

    data = _data(size, steps, ak.world_size())
    model = _model(size)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=SIZES[size][2])
    model, opt, loader = ak.prepare(model, opt, loader)

    def epoch() -> tuple[float, float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        for x, y in loader:
            with ak.accumulate(model, steps=accumulation):
                out = model(x)
                loss = nn.functional.mse_loss(out, y)
                ak.backward(loss)
                opt.step()
                opt.zero_grad()
        return time.perf_counter() - start, time.thread_time() - cpu, loss.item()

    return epoch


LOOPS: dict[str, Callable[[str, int, int], Epoch]] = {"raw": _raw_loop, "accelkit": _accelkit_loop}


def paired_rounds(
    size: str, steps: int, accumulation: int, rounds: int, subject: str = "accelkit", subject_first: bool = False
) -> list[tuple[float, ...]]:
    """In each worker: the raw loop and ``subject``'s built once, in the order given, then one epoch of
    each in turn (either first in turn); (raw s, raw CPU s, raw loss, subject's ...) per round. Both
    models see the same batches and updates, so their losses agree bit for bit every round."""
    import accelkit as ak

    ak.state()  # join the group once
    if subject_first:
        ours = LOOPS[subject](size, steps, accumulation)
        raw = _raw_loop(size, steps, accumulation)
    else:
        raw = _raw_loop(size, steps, accumulation)
        ours = LOOPS[subject](size, steps, accumulation)
    for _ in range(2):  # warm up both paths (DDP lays its buckets out again after the first step)
        raw(), ours()
    out = []
    for i in range(rounds):
        if i % 2:
            out.append(raw() + ours())
        else:
            ak_part = ours()
            out.append(raw() + ak_part)
    return out


def both_orders(
    size: str, steps: int, accumulation: int, rounds: int, subject: str = "accelkit", launches: int = 6
) -> list[Any]:
    """Rank 0's rounds from ``launches`` launches, each loop built first in every other one: a loop's
    figure moves by several µs with where its memory lands (which loop was built first, and luck that
    changes from launch to launch: up to ±5 µs in A/A runs), so that the figure pools many builds."""
    from accelkit.testing import run_distributed

    each = max(1, rounds // launches)
    return [
        round_
        for launch in range(launches)
        for round_ in run_distributed(
            paired_rounds, (size, steps, accumulation, each, subject, launch % 2 == 1), task_timeout=900
        )[0]
    ]


def peak_rss(kind: str, size: str, steps: int) -> int:
    """KiB: one loop alone in fresh workers."""
    import accelkit as ak

    ak.state()
    (_raw_loop if kind == "raw" else _accelkit_loop)(size, steps, 1)()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run(quick: bool) -> list[Row]:
    from accelkit.testing import run_distributed

    rows: list[Row] = []
    sizes = (("tiny", 48, 10 if quick else 180), ("medium", 12 if quick else 40, 4 if quick else 8))
    for size, steps, rounds in sizes:
        launches = 2 if quick or size != "tiny" else 6
        for accumulation in (1, 4):
            rank0 = both_orders(size, steps, accumulation, rounds, launches=launches)
            raw_s, raw_cpu, raw_loss = (list(col) for col in zip(*[r[:3] for r in rank0], strict=True))
            ak_s, ak_cpu, ak_loss = (list(col) for col in zip(*[r[3:] for r in rank0], strict=True))
            label = f"{size} MLP, accumulation {accumulation}"
            row = paired_row(f"train step/s: {label}", [steps / s for s in ak_s], [steps / s for s in raw_s], unit="/s")
            row["target"], row["ok"] = None, None
            rows.append(row)
            rows.append(
                paired_row(
                    f"CPU per step (thread time): {label}",
                    [c / steps * 1e6 for c in ak_cpu],
                    [c / steps * 1e6 for c in raw_cpu],
                    target=10.0 if size == "tiny" else None,
                    unit="us",
                )
            )
            same = all(a == b for a, b in zip(ak_loss, raw_loss, strict=True))
            rows.append(
                {
                    "name": f"final loss bit-identical: {label}",
                    "unit": "",
                    "accelkit": ak_loss[0],
                    "reference": raw_loss[0],
                    "diff": None,
                    "ratio": None,
                    "target": None,
                    "ok": same,
                    "n": len(ak_loss),
                }
            )
        if size == "tiny":
            rows.extend(_control(steps, rounds, launches))
        raw_rss = run_distributed(peak_rss, ("raw", size, steps))
        ak_rss = run_distributed(peak_rss, ("accelkit", size, steps))
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


def _control(steps: int, rounds: int, launches: int) -> list[Row]:
    """The hand-written loop against a second copy of itself, measured as accelkit's is: how far the
    figure moves when nothing differs (its median diff should be about 0)."""
    rows = []
    for accumulation in (1, 4):
        rank0 = both_orders("tiny", steps, accumulation, rounds, subject="raw", launches=launches)
        first = [r[1] / steps * 1e6 for r in rank0]
        second = [r[4] / steps * 1e6 for r in rank0]
        row = paired_row(
            f"CPU per step (thread time): tiny MLP, accumulation {accumulation}, hand-written "
            "against itself (the measurement's spread)",
            second,
            first,
            unit="us",
        )
        row["ok"] = None
        rows.append(row)
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
