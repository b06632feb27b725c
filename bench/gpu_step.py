"""One GPU: accelkit's training step against raw best practice, paired in one process.

Raw best practice: ``torch.autocast``, ``torch.amp.GradScaler`` (fp16), fused AdamW, and a
DataLoader with ``pin_memory=True`` whose batches are copied with ``non_blocking=True``.
accelkit: the same model and optimizer through ``ak.prepare``, ``ak.backward``, ``opt.step()``.
Per model (an overhead-bound MLP, a transformer encoder stack), precision (bf16, fp16) and data
source, the two loops alternate in segments of the same length. The sources:
- ``batches on the GPU``: the same tensors, already on the device (the step alone);
- ``DataLoader``: the loader as a user writes it (no ``pin_memory``, no workers) against raw's
  pinned one: accelkit pins beside the step and copies one batch ahead;
- ``DataLoader, 2 workers``: the same with two persistent workers on both sides (accelkit's
  prepared loader pins in DataLoader's pin-memory thread);
- ``pinned DataLoader``: the user's loader is raw's own (``pin_memory=True``): not pinned twice.
Rows per setting:
- steps/s (median paired ratio accelkit / raw; target: >= 0.98);
- host-device synchronisations per step, counted with ``torch.cuda.set_sync_debug_mode("warn")``
  (target: 0, as raw);
- peak GPU memory a step needs above what is resident before it (target: within 1 % of raw's);
- the training thread's time per step in ``next(batches)`` (no target: where a gap comes from).
Last, the stall of ``ak.save_state(blocking=False)`` for ~1 GB of CUDA state (a model and its AdamW
moments) against the blocking save of it, one process (target: <= 0.1x): the call returns once the
state is copied into pinned host memory.
Without CUDA the section is reported as skipped. Run alone: ``python bench/gpu_step.py [--quick]``
(``--quick``: a smaller encoder and fewer segments, about two minutes on an H200).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():  # bench/run.py reports an ImportError as a skipped section
    raise ImportError("needs a CUDA device (torch.cuda.is_available() is False)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, paired_row

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TARGET_RATIO = 0.98
TARGET_MEMORY = 0.01  # peak memory over raw's, as a fraction of raw's
TARGET_STALL = 0.1
STALL_WIDTH, STALL_LAYERS = 4096, 5  # 5 layers of 4096 x 4096 and their AdamW moments: ~1 GB
Step = Callable[[], None]

# Each source: how raw best practice builds its DataLoader (None: batches on the GPU), and how the user
# builds the one accelkit prepares.
SOURCES: dict[str, tuple[dict[str, Any] | None, dict[str, Any]]] = {
    "batches on the GPU": (None, {}),
    "DataLoader": ({"pin_memory": True}, {}),
    "DataLoader, 2 workers": (
        {"pin_memory": True, "num_workers": 2, "persistent_workers": True},
        {"num_workers": 2, "persistent_workers": True},
    ),
    "pinned DataLoader": ({"pin_memory": True}, {"pin_memory": True}),
}


class Loop(NamedTuple):
    step: Step
    fetch: Fetch  # the time the training thread spends in next(batches)


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


class Fetch:
    """``batches``, forever (a new epoch after each), timing the caller's wait for each."""

    def __init__(self, batches: Any) -> None:
        self.batches, self.seconds, self.count = batches, 0.0, 0
        self._it: Iterator[Any] = iter(())

    def __next__(self) -> Any:
        start = time.perf_counter()
        batch = next(self._it, None)
        if batch is None:
            self._it = iter(self.batches)
            batch = next(self._it)
        self.seconds += time.perf_counter() - start
        self.count += 1
        return batch

    def per_step_ms(self) -> float:
        ms = 1e3 * self.seconds / max(1, self.count)
        self.seconds, self.count = 0.0, 0
        return ms


def loader(data: torch.Tensor, batch: int, **options: Any) -> torch.utils.data.DataLoader[Any]:
    dataset = torch.utils.data.TensorDataset(data, data)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, **options)


def on_gpu(data: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, x) for x in data.to(DEVICE).split(batch)[: 8 if data.dim() > 2 else 32]]


def raw_loop(make: Callable[[], nn.Module], data: torch.Tensor, batch: int, precision: str, source: str) -> Loop:
    torch.manual_seed(0)
    model = make().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(DEVICE) if precision == "fp16" else None
    dtype = DTYPES[precision]
    options = SOURCES[source][0]
    fetch = Fetch(on_gpu(data, batch) if options is None else loader(data, batch, **options))

    def step() -> None:
        x, y = next(fetch)
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

    return Loop(step, fetch)


def accelkit_loop(make: Callable[[], nn.Module], data: torch.Tensor, batch: int, precision: str, source: str) -> Loop:
    import accelkit as ak

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = ak.prepare(model, opt)
    raw_options, user_options = SOURCES[source]
    fetch = Fetch(on_gpu(data, batch) if raw_options is None else ak.prepare(loader(data, batch, **user_options)))

    def step() -> None:
        x, y = next(fetch)
        loss = F.mse_loss(model(x), y)
        ak.backward(loss)
        opt.step()
        opt.zero_grad()

    return Loop(step, fetch)


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


def _row(name: str, unit: str, ours: float, ref: float, target: float | None) -> Row:
    """A row of single figures; ``target``: the largest acceptable accelkit - reference (None: no target)."""
    ok = None if target is None else ours - ref <= target
    return {"name": name, "unit": unit, "accelkit": ours, "reference": ref, "diff": ours - ref,
            "ratio": ours / ref if ref else None, "target": target, "ok": ok, "n": 1}  # fmt: skip


def compare(label: str, raw: Loop, ours: Loop, steps: int, segments: int) -> list[Row]:
    """The rows of one setting: steps/s in paired segments, syncs, peak memory and batch wait per step."""
    for loop in (raw, ours):  # warm-up: kernels chosen, caches and optimizer state filled
        timed(loop.step, max(3, steps // 4))
        loop.fetch.per_step_ms()  # the waits are counted from here
    pairs = []
    for i in range(segments):  # each leads in turn
        if i % 2 == 0:
            pairs.append((timed(raw.step, steps), timed(ours.step, steps)))
        else:
            o = timed(ours.step, steps)
            pairs.append((timed(raw.step, steps), o))
    waits = raw.fetch.per_step_ms(), ours.fetch.per_step_ms()  # over the timed segments
    speed = paired_row(f"GPU step/s: {label}", [steps / o for _, o in pairs], [steps / r for r, _ in pairs], unit="/s")
    speed["ok"] = speed["ratio"] >= TARGET_RATIO
    raw_syncs, our_syncs = syncs_per_step(raw.step), syncs_per_step(ours.step)
    raw_peak, our_peak = peak_mib(raw.step, steps), peak_mib(ours.step, steps)
    return [
        speed,
        _row(f"syncs per step: {label}", "", our_syncs, raw_syncs, target=0.0),
        _row(f"peak GPU MiB per step: {label}", "MiB", our_peak, raw_peak, target=TARGET_MEMORY * raw_peak),
        _row(f"batch wait ms per step: {label}", "ms", waits[1], waits[0], target=None),
    ]


def stall_row(quick: bool) -> Row:
    """Seconds the loop stands still for a background save of ~1 GB of CUDA state, against a blocking save."""
    import accelkit as ak

    ak.reset_state()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(STALL_WIDTH, STALL_WIDTH) for _ in range(STALL_LAYERS)]).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(2, STALL_WIDTH, device=DEVICE)).sum().backward()
    opt.step()
    tensors = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]
    mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    root = tempfile.mkdtemp(prefix="accelkit-bench-gpu-ckpt-", dir=os.environ.get("ACCELKIT_BENCH_DIR"))
    stalls: list[float] = []
    blocking: list[float] = []
    try:
        ak.save_state(os.path.join(root, "warm-up"), blocking=False, model=model, optimizer=opt)
        ak.wait_for_checkpoint()
        for i in range(3 if quick else 5):
            ours, ref = os.path.join(root, f"async-{i}"), os.path.join(root, f"blocking-{i}")
            for kind in ("async", "blocking") if i % 2 == 0 else ("blocking", "async"):
                torch.cuda.synchronize()  # the state is computed: the stall is the save's own
                start = time.perf_counter()
                if kind == "async":
                    ak.save_state(ours, blocking=False, model=model, optimizer=opt)
                    stalls.append(time.perf_counter() - start)
                    ak.wait_for_checkpoint()  # the loop would go on training here
                else:
                    ak.save_state(ref, model=model, optimizer=opt)
                    blocking.append(time.perf_counter() - start)
            shutil.rmtree(ours)
            shutil.rmtree(ref)
    finally:
        ak.reset_state()  # lets the staging buffers go
        shutil.rmtree(root, ignore_errors=True)
    row = paired_row(f"save_state(blocking=False) stall, {mb:.0f} MB of CUDA state (vs blocking)", stalls, blocking)
    row["ok"] = row["ratio"] <= TARGET_STALL
    return row


def run(quick: bool) -> list[Row]:
    import accelkit as ak

    rows: list[Row] = []
    segments = 3 if quick else 15
    for name in ("MLP", "encoder"):
        make, data, batch = workload(name, quick)
        steps = (40 if quick else 200) if name == "MLP" else (5 if quick else 20)
        for precision in ("bf16", "fp16"):
            for source in SOURCES:
                ak.reset_state()
                ak.init(precision=precision)  # type: ignore[arg-type]
                raw = raw_loop(make, data, batch, precision, source)
                ours = accelkit_loop(make, data, batch, precision, source)
                rows += compare(f"{name}, {precision}, {source}", raw, ours, steps, segments)
                del raw, ours
                torch.cuda.empty_cache()
    ak.reset_state()
    rows.append(stall_row(quick))
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
