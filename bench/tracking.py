"""Per-call cost of ``ak.log`` on rank 0 (per tracker) and on the other ranks, in µs.

Two real gloo processes (``accelkit.testing.run_distributed``). Each logs ``{"loss": 0-d tensor,
"lr": float}``. Rank 0 times ``ak.log`` against the same writes done by hand (CSV row + flush,
JSON line + flush, ``SummaryWriter.add_scalar`` x2 + flush, as Accelerate's tracker does);
rank 1 times its ``ak.log`` (which returns at once) against an empty function call. Blocks of
calls alternate between accelkit and the reference; each sample is one block's mean per call.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import Row, paired_row


def _per_call(fn: Callable[[int], None], calls: int, start: int) -> float:
    begin = time.perf_counter()
    for i in range(start, start + calls):
        fn(i)
    return (time.perf_counter() - begin) / calls * 1e6


def _references(directory: Path) -> dict[str, tuple[Callable[[int], None], Callable[[], None]]]:
    import torch

    loss = torch.tensor(0.25)
    refs: dict[str, tuple[Callable[[int], None], Callable[[], None]]] = {}
    f = (directory / "ref.csv").open("a", newline="")
    w = csv.writer(f)

    def by_hand_csv(step: int) -> None:
        w.writerow([step, loss.item(), 1e-3])
        f.flush()

    refs["csv"] = (by_hand_csv, f.close)
    g = (directory / "ref.jsonl").open("a")

    def by_hand_jsonl(step: int) -> None:
        g.write(json.dumps({"step": step, "loss": loss.item(), "lr": 1e-3}) + "\n")
        g.flush()

    refs["jsonl"] = (by_hand_jsonl, g.close)
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(directory / "ref-tb"))

        def by_hand_tb(step: int) -> None:
            writer.add_scalar("loss", loss.item(), step)
            writer.add_scalar("lr", 1e-3, step)
            writer.flush()

        refs["tensorboard"] = (by_hand_tb, writer.close)
    return refs


def _measure(directory: str, blocks: int, calls: int) -> dict[str, tuple[list[float], list[float]]]:
    import torch

    import accelkit as ak

    loss = torch.tensor(0.25)
    out: dict[str, tuple[list[float], list[float]]] = {}
    if not ak.is_main_process():
        ak.init_trackers("bench", log_with="csv", project_dir=directory)
        ours, ref = [], []
        for b in range(blocks):
            ours.append(_per_call(lambda i: ak.log({"loss": loss, "lr": 1e-3}, step=i), calls, b * calls))
            ref.append(_per_call(lambda i: None, calls, 0))
        out["rank 1 (returns at once)"] = (ours, ref)
        ak.end_training()
        return out
    refs = _references(Path(directory))
    for name, (by_hand, close) in refs.items():
        ours, ref = [], []
        with ak.init_trackers(f"bench-{name}", log_with=name, project_dir=directory):
            for b in range(blocks):
                ours.append(_per_call(lambda i: ak.log({"loss": loss, "lr": 1e-3}, step=i), calls, b * calls))
                ref.append(_per_call(by_hand, calls, b * calls))
        close()
        out[f"rank 0, {name}"] = (ours, ref)
    ak.end_training()
    return out


def run(quick: bool) -> list[Row]:
    from accelkit.testing import run_distributed

    blocks, calls = (5, 100) if quick else (15, 400)
    with tempfile.TemporaryDirectory(prefix="accelkit-bench-tracking-") as directory:
        results: list[dict[str, Any]] = run_distributed(_measure, (directory, blocks, calls), task_timeout=600)
    rows = []
    for result in results:
        for name, (ours, ref) in result.items():
            reference = "an empty call" if name.startswith("rank 1") else "the same writes by hand"
            rows.append(paired_row(f"ak.log per call, {name} (vs {reference})", ours, ref, unit="us"))
    return rows
