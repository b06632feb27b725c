"""One GPU: accelkit's training step against raw best practice, paired in one process.

Raw best practice: ``torch.autocast``, ``torch.amp.GradScaler`` (fp16), fused AdamW, and a
DataLoader with ``pin_memory=True`` whose batches are copied with ``non_blocking=True``.
accelkit: the same model and optimizer through ``ak.prepare`` (the DataLoader as a user writes
it, without ``pin_memory``), ``ak.backward``, ``opt.step()``. Per model (an overhead-bound MLP,
a transformer encoder stack), precision (bf16, fp16) and data source (batches already on the
GPU, or a DataLoader), the two loops alternate in segments of the same length:
- steps/s (median paired ratio accelkit / raw; target: >= 0.99);
- host-device synchronisations per step, counted with ``torch.cuda.set_sync_debug_mode("warn")``
  (target: 0, as raw);
- peak GPU memory a step needs above what is resident before it (target: raw's).
Without CUDA the section is reported as skipped. Run alone: ``python bench/gpu_step.py [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():  # bench/run.py reports an ImportError as a skipped section
    raise ImportError("needs a CUDA device (torch.cuda.is_available() is False)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, paired_row

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Step = Callable[[], None]


def mlp() -> nn.Module:
    """Small kernels: the step's cost is launching them (the host's overhead shows in full)."""
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 512))


def encoder(layers: int) -> nn.Module:
    block = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(block, layers, enable_nested_tensor=False)


def workload(name: str, quick: bool) -> tuple[Callable[[], nn.Module], torch.Tensor, int]:
    """(model factory, the data set's inputs on the host, batch size)."""
    g = torch.Generator().manual_seed(0)
    if name == "MLP":
        return mlp, torch.randn(4096, 512, generator=g), 64
    layers = 4 if quick else 12
    return (lambda: encoder(layers)), torch.randn(256, 128, 768, generator=g), 16


def batches_forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def raw_loop(make: Callable[[], nn.Module], data: torch.Tensor, batch: int, precision: str, loader: bool) -> Step:
    torch.manual_seed(0)
    model = make().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(DEVICE) if precision == "fp16" else None
    dtype = DTYPES[precision]
    source = _source(data, batch, loader, pin_memory=True)

    def step() -> None:
        x, y = next(source)
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
        with torch.autocast(DEVICE, dtype=dtype):
            loss = F.mse_loss(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def accelkit_loop(make: Callable[[], nn.Module], data: torch.Tensor, batch: int, precision: str, loader: bool) -> Step:
    import accelkit as ak

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = ak.prepare(model, opt)
    if loader:
        dataset = torch.utils.data.TensorDataset(data, data)
        plain = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True)
        source = batches_forever(ak.prepare(plain))
    else:
        source = _source(data, batch, loader=False, pin_memory=False)

    def step() -> None:
        x, y = next(source)
        loss = F.mse_loss(model(x), y)
        ak.backward(loss)
        opt.step()
        opt.zero_grad()

    return step


def _source(data: torch.Tensor, batch: int, loader: bool, pin_memory: bool) -> Iterator[Any]:
    if loader:
        dataset = torch.utils.data.TensorDataset(data, data)
        return batches_forever(
            torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, pin_memory=pin_memory)
        )
    on_gpu = [(x, x) for x in data.to(DEVICE).split(batch)[: 8 if data.dim() > 2 else 32]]
    return batches_forever(on_gpu)


def timed(step: Step, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def syncs_per_step(step: Step, steps: int = 10) -> float:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen) / steps


def peak_mib(step: Step, steps: int) -> float:
    """MiB a step needs at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - resident) / 2**20


def _row(name: str, unit: str, ours: float, ref: float, target: float) -> Row:
    """A row of single figures; ``target``: the largest acceptable accelkit - reference."""
    return {"name": name, "unit": unit, "accelkit": ours, "reference": ref, "diff": ours - ref, "ratio": None,
            "target": target, "ok": ours - ref <= target, "n": 1}  # fmt: skip


def compare(label: str, raw: Step, ours: Step, steps: int, segments: int) -> list[Row]:
    """The rows of one setting: steps/s in paired segments, syncs per step, peak memory per step."""
    for step in (raw, ours):  # warm-up: kernels chosen, caches and optimizer state filled
        timed(step, max(3, steps // 4))
    pairs = [(timed(raw, steps), timed(ours, steps)) for _ in range(segments)]
    speed = paired_row(f"GPU step/s: {label}", [steps / o for _, o in pairs], [steps / r for r, _ in pairs], unit="/s")
    speed["ok"] = statistics.median(r / o for r, o in pairs) >= 0.99
    raw_syncs, our_syncs = syncs_per_step(raw), syncs_per_step(ours)
    raw_peak, our_peak = peak_mib(raw, steps), peak_mib(ours, steps)
    return [
        speed,
        _row(f"syncs per step: {label}", "", our_syncs, raw_syncs, target=0.0),
        _row(f"peak GPU MiB per step: {label}", "MiB", our_peak, raw_peak, target=1.0),
    ]


def run(quick: bool) -> list[Row]:
    import accelkit as ak

    rows: list[Row] = []
    segments = 3 if quick else 15
    for name in ("MLP", "encoder"):
        make, data, batch = workload(name, quick)
        steps = (40 if quick else 200) if name == "MLP" else (5 if quick else 20)
        for precision in ("bf16", "fp16"):
            for loader in (False, True):
                ak.reset_state()
                ak.init(precision=precision)  # type: ignore[arg-type]
                raw = raw_loop(make, data, batch, precision, loader)
                ours = accelkit_loop(make, data, batch, precision, loader)
                label = f"{name}, {precision}, {'DataLoader' if loader else 'batches on the GPU'}"
                rows += compare(label, raw, ours, steps, segments)
                del raw, ours
                torch.cuda.empty_cache()
    ak.reset_state()
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
