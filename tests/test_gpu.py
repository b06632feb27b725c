"""The CUDA paths, on a machine with a GPU: every test is marked ``gpu`` and skipped without CUDA.

Each test runs in spawned workers (``accelkit.testing`` with ``device="cuda"``), so that this
process never initialises CUDA: tests that fork workers later in the session still may. Two
ranks share the one visible GPU over gloo, which moves CUDA tensors through host memory; where
gloo cannot do an operation on CUDA tensors, the test skips and says which. Results are
compared with raw PyTorch computed on the same GPU, or with the same run on the CPU.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from processes import subprocess_env
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak
from accelkit.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIMEOUT = 300.0
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def gloo_cannot(exc: BaseException) -> bool:
    """Whether ``exc`` says that the backend does not do this operation with these tensors."""
    text = str(exc).lower()
    return any(s in text for s in ("not supported", "unsupported", "does not support", "only supports", "expected cpu"))


class Attempts:
    """Runs named operations; those gloo cannot do on CUDA tensors are listed instead of failing."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.unsupported: list[str] = []

    def __call__(self, name: str, fn: Any) -> None:
        try:
            self.results[name] = fn()
        except (RuntimeError, ValueError) as exc:
            if not gloo_cannot(exc):
                raise
            self.unsupported.append(f"{name}: {str(exc).splitlines()[0]}")


def skip_unsupported(unsupported: list[str]) -> None:
    if unsupported:
        pytest.skip("gloo cannot do these with CUDA tensors: " + "; ".join(sorted(set(unsupported))))


# --- precision: prepare / backward / clip / step / overflow skip, against the raw AMP loop -------


def amp_against_raw(precision: str) -> dict[str, Any]:
    ak.init(precision=precision)  # type: ignore[arg-type]
    dtype, fp16, device = DTYPES[precision], precision == "fp16", ak.device()
    model, reference = mlp(), mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    model, opt, sched = ak.prepare(model, opt, sched)
    scaler = torch.amp.GradScaler(device.type) if fp16 else None
    inner: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    g = torch.Generator(device=device).manual_seed(1)
    inputs = [torch.randn(8, 16, device=device, generator=g) * 0.1 for _ in range(5)]
    if fp16:
        inputs[2] = torch.full((8, 16), math.inf, device=device)  # overflows: the step must be skipped
    out: dict[str, Any] = {"skipped": [], "ref_skipped": [], "norms": [], "ref_norms": [], "lrs": [], "ref_lrs": []}
    for x in inputs:
        y = model(x)
        out["out_dtype"] = str(y.dtype)
        ak.backward(y.square().mean())
        out["norms"].append(ak.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        out["skipped"].append(opt.step_was_skipped)
        out["lrs"].append(sched.get_last_lr()[0])
        # The same step written by hand (PyTorch's AMP recipe); the scheduler holds on a skipped step.
        with torch.autocast(device.type, dtype=dtype):
            ref_y = reference(x)
        ref_loss = ref_y.float().square().mean()
        scale = scaler.get_scale() if scaler is not None else 1.0
        (scaler.scale(ref_loss) if scaler is not None else ref_loss).backward()
        if scaler is not None:
            scaler.unscale_(ref_opt)
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item())
        if scaler is not None:
            scaler.step(ref_opt)
            scaler.update()
        else:
            ref_opt.step()
        skipped = scaler is not None and scaler.get_scale() < scale
        if not skipped:
            ref_sched.step()
        ref_opt.zero_grad()
        out["ref_skipped"].append(skipped)
        out["ref_lrs"].append(ref_sched.get_last_lr()[0])
    out["inner"] = sorted({str(d) for d in inner})
    out["devices"] = sorted({str(p.device) for p in model.parameters()})
    out["params"] = [p.detach().cpu() for p in model.parameters()]
    out["ref_params"] = [p.detach().cpu() for p in reference.parameters()]
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_on_cuda_match_the_raw_amp_loop(precision: str) -> None:
    (run,) = run_distributed(amp_against_raw, (precision,), num_processes=1, device="cuda", task_timeout=TIMEOUT)
    assert run["devices"] == ["cuda:0"]
    assert run["inner"] == [str(DTYPES[precision])] and run["out_dtype"] == "torch.float32"
    assert run["skipped"] == run["ref_skipped"]
    if precision == "fp16":
        assert run["skipped"][2]  # the overflowing step
    torch.testing.assert_close(run["norms"], run["ref_norms"], equal_nan=True)
    assert run["lrs"] == run["ref_lrs"]
    for ours, ref in zip(run["params"], run["ref_params"], strict=True):
        torch.testing.assert_close(ours, ref)


# --- the prepared loader on CUDA: the CPU loader's batches, moved ahead ----------------------------


def loader_batches() -> dict[str, Any]:
    device = ak.device()
    ak.set_seed(5)
    big = torch.arange(64 * 2**16, dtype=torch.float32).view(64, 2**16)  # 256 KiB rows: copies that take time
    sets = {
        "shuffled": DataLoader(TensorDataset(big, torch.arange(64)), batch_size=8, shuffle=True),
        "pinned": DataLoader(TensorDataset(big[:20]), batch_size=6, pin_memory=device.type == "cuda"),
        "dicts": DataLoader([{"x": big[i, :4], "i": i} for i in range(9)], batch_size=4),
        "on the device": DataLoader(TensorDataset(big[:10].to(device)), batch_size=4),
    }
    prepared = {name: ak.prepare(loader) for name, loader in sets.items()}
    out: dict[str, Any] = {"devices": set()}
    for name, loader in prepared.items():
        epochs = []
        for _ in range(2):
            batches = []
            for batch in loader:
                leaves = batch if isinstance(batch, (list, tuple)) else list(batch.values())
                out["devices"].update(str(t.device) for t in leaves)
                # Computed on the current stream right away: reads the copy only if the stream waited for it.
                batches.append([(t * 1).cpu() for t in leaves])
            epochs.append(batches)
        out[name] = epochs
    loader = prepared["shuffled"]
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = [b[1].cpu().tolist() for b in it]
    loader.load_state_dict(state)
    out["resumed"] = [b[1].cpu().tolist() for b in loader] == rest and len(rest) == 6
    out["devices"] = sorted(out["devices"])
    return out


def test_the_prepared_loader_on_cuda_gives_the_cpu_loaders_batches() -> None:
    (on_gpu,) = run_distributed(loader_batches, num_processes=1, device="cuda", task_timeout=TIMEOUT)
    (on_cpu,) = run_distributed(loader_batches, num_processes=1, device="cpu", task_timeout=TIMEOUT)
    assert on_gpu["devices"] == ["cuda:0"] and on_cpu["devices"] == ["cpu"]
    for name in ("shuffled", "pinned", "dicts", "on the device"):
        gpu_epochs, cpu_epochs = on_gpu[name], on_cpu[name]
        assert [len(e) for e in gpu_epochs] == [len(e) for e in cpu_epochs], name
        for gpu_epoch, cpu_epoch in zip(gpu_epochs, cpu_epochs, strict=True):
            for gpu_batch, cpu_batch in zip(gpu_epoch, cpu_epoch, strict=True):
                assert len(gpu_batch) == len(cpu_batch) and all(map(torch.equal, gpu_batch, cpu_batch)), name
    assert on_gpu["resumed"] and on_cpu["resumed"]


# --- pinning: beside the step, never on the training thread, never twice ---------------------------

LOADERS = {
    "plain": {},
    "plain, 2 workers": {"num_workers": 2},
    "pinned": {"pin_memory": True},
    "pinned, 2 workers": {"num_workers": 2, "pin_memory": True},
}


def pinning_threads() -> dict[str, Any]:
    """Per kind of loader: which threads pinned how many tensors over two epochs, and the batches."""
    import threading

    pin_memory = torch.Tensor.pin_memory
    pins: list[str] = []

    def recorded(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pins.append(threading.current_thread().name)
        return pin_memory(self, *args, **kwargs)

    data = TensorDataset(torch.arange(48.0).view(12, 4), torch.arange(12))
    out: dict[str, Any] = {"main": threading.current_thread().name}
    torch.Tensor.pin_memory = recorded  # type: ignore[method-assign]
    try:
        for name, options in LOADERS.items():
            loader = ak.prepare(DataLoader(data, batch_size=3, **options))  # type: ignore[arg-type]
            pins.clear()
            epochs = [[[(str(t.device), (t * 1).cpu().tolist()) for t in batch] for batch in loader] for _ in range(2)]
            out[name] = {"pins": sorted(set(pins)), "count": len(pins), "epochs": epochs, "flag": loader.pin_memory}
    finally:
        torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    return out


def test_a_prepared_loader_pins_beside_the_step_never_on_the_training_thread_never_twice() -> None:
    (run,) = run_distributed(pinning_threads, num_processes=1, device="cuda", task_timeout=TIMEOUT)
    want = [[[("cuda:0", [[4.0 * i + j for j in range(4)] for i in range(b, b + 3)]), ("cuda:0", list(range(b, b + 3)))]
             for b in range(0, 12, 3)]] * 2  # fmt: skip
    tensors = 2 * 4 * 2  # two tensors a batch, four batches an epoch, two epochs: each pinned once
    for name in LOADERS:
        got = run[name]
        assert got["epochs"] == want, name
        assert got["count"] == tensors, f"{name}: {got['count']} pins, {tensors} tensors"
    assert run["plain"]["pins"] == ["accelkit-pin_0"] and not run["plain"]["flag"]  # the transfer's thread
    for name in ("plain, 2 workers", "pinned, 2 workers"):  # DataLoader's pin-memory thread
        assert run[name]["flag"] and run[name]["pins"] and run["main"] not in run[name]["pins"], (name, run[name])
        assert not any(p.startswith("accelkit-pin") for p in run[name]["pins"]), (name, run[name])
    assert run["pinned"]["pins"] == [run["main"]]  # the user's loader pins as it does unprepared; not again


# --- zero host-device synchronisations per step -----------------------------------------------


def prepared_loop(precision: str, loader_options: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """A small model's prepared loop, its optimizer skipping overflowing steps on the device: (step, model,
    scheduler); each ``step()`` takes the next batch (12 per epoch) and returns the loss."""
    ak.init(precision=precision)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # skips overflowing steps on the device
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.99**step)
    n = 8 * ak.world_size() * 12
    data = TensorDataset(torch.randn(n, 64), torch.randn(n, 1))
    plain = DataLoader(data, batch_size=8, shuffle=True, **(loader_options or {}))
    model, opt, loader, sched = ak.prepare(model, opt, plain, sched)
    batches = iter(loader)

    def step() -> torch.Tensor:
        x, y = next(batches)
        loss = F.mse_loss(model(x), y)
        ak.backward(loss)
        ak.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss

    return step, model, sched


def steps_under_sync_debug_error(precision: str, loader_options: dict[str, Any] | None = None) -> float:
    step, _, _ = prepared_loop(precision, loader_options)
    step()  # the first step creates the optimizer's state, cuBLAS handles, ...
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises, with its traceback
    try:
        for _ in range(10):
            loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return float(loss.item())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ten_steps_with_a_prepared_loader_make_no_host_device_sync(precision: str) -> None:
    (loss,) = run_distributed(
        steps_under_sync_debug_error, (precision,), num_processes=1, device="cuda", task_timeout=TIMEOUT
    )
    assert math.isfinite(loss)


@pytest.mark.parametrize("loader", ["plain, 2 workers", "pinned"])
def test_ten_steps_with_workers_or_a_pinned_loader_make_no_host_device_sync(loader: str) -> None:
    (loss,) = run_distributed(
        steps_under_sync_debug_error, ("bf16", LOADERS[loader]), num_processes=1, device="cuda", task_timeout=TIMEOUT
    )
    assert math.isfinite(loss)


# --- checked collectives make no host-device sync of their own -----------------------------------


def count_syncs(fn: Any) -> int:
    """How many synchronising CUDA calls ``fn`` makes (torch warns once per call in "warn" mode)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def collective_syncs() -> dict[str, list[int]]:
    """Per collective, in steady state: accelkit's syncs and raw torch.distributed's for the same job."""
    import torch.distributed as dist

    x = torch.arange(1000.0, device=ak.device()) + ak.rank()

    def raw_reduce() -> None:
        dist.all_reduce(x.clone())

    def raw_gather() -> None:
        dist.all_gather_into_tensor(x.new_empty(2 * x.numel()), x)

    def raw_broadcast() -> None:
        dist.broadcast(x.clone() if ak.rank() == 0 else torch.empty_like(x), 0)

    cases = {"reduce": (lambda: ak.reduce(x), raw_reduce), "gather": (lambda: ak.gather(x), raw_gather),
             "broadcast": (lambda: ak.broadcast(x), raw_broadcast)}  # fmt: skip
    counts = {}
    for name, (ours, raw) in cases.items():
        for _ in range(3):  # the first call at a point of the program is checked before its data moves
            ours()
            raw()
        counts[name] = [count_syncs(ours), count_syncs(raw)]
    ak.wait_for_everyone()  # reads the last verdict
    return counts


@pytest.mark.distributed
def test_checked_collectives_add_no_host_device_sync_in_steady_state() -> None:
    for counts in run_distributed(collective_syncs, device="cuda", task_timeout=TIMEOUT):
        for name, (ours, raw) in counts.items():
            assert ours <= raw, f"{name}: {ours} syncs, raw torch.distributed {raw}"


# --- collectives, DDP and gather_for_metrics with CUDA tensors: 2 ranks on one GPU ---------------


def collectives_on_cuda() -> dict[str, Any]:
    device, rank = ak.device(), ak.rank()
    attempt = Attempts()
    x = torch.arange(4.0, device=device) + 10 * rank
    tree = {"ids": torch.tensor([rank], device=device), "half": torch.full((2,), rank + 0.5, device=device).half()}
    attempt("gather", lambda: ak.gather(x).cpu().tolist())
    attempt("gather of a tree", lambda: {k: v.cpu().tolist() for k, v in ak.gather(tree).items()})
    for op in ("sum", "mean", "max"):
        attempt(f"reduce {op}", lambda op=op: ak.reduce(x, op=op).cpu().tolist())
    attempt("broadcast", lambda: ak.broadcast(x, src=1).cpu().tolist())
    attempt("pad_across_processes", lambda: ak.pad_across_processes(torch.ones(rank + 1, device=device)).tolist())
    attempt("gather_object", lambda: ak.gather_object({"rank": rank}))
    attempt("gather_for_metrics", gathered_metrics)
    attempt("ddp", ddp_against_one_process)
    return {"device": str(device), "backend": ak.state().backend, **attempt.results, "unsupported": attempt.unsupported}


def gathered_metrics() -> list[int]:
    loader = ak.prepare(DataLoader(range(11), batch_size=3))  # the last global batch is padded
    values: list[int] = []
    for batch in loader:
        assert batch.device == ak.device()
        values += ak.gather_for_metrics(batch).cpu().tolist()
    return values


def ddp_against_one_process(precision: str = "no") -> list[float]:
    """Largest difference between 2-rank DDP (or FSDP2) on CUDA and one process on the whole batch;
    ``precision="bf16"``: both under autocast."""
    model, reference = mlp(), mlp().to(ak.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # an update in proportion to the gradient
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, opt = ak.prepare(model, opt)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(16, 16, generator=g).to(ak.device()), torch.randn(16, 1, generator=g).to(ak.device())
        mine = slice(8 * ak.rank(), 8 * ak.rank() + 8)
        with ak.precision(precision):  # type: ignore[arg-type]
            loss = F.mse_loss(model(x[mine]).float(), y[mine])
        ak.backward(loss)
        opt.step()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            ref_loss = F.mse_loss(reference(x).float(), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    pairs = [own_part(p, ref) for p, ref in zip(ak.unwrap(model).parameters(), reference.parameters(), strict=True)]
    return [(a - b).abs().max().item() if a.numel() else 0.0 for a, b in pairs]


def own_part(param: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A parameter and its reference; of an FSDP DTensor, this rank's shard and the reference's part.

    Without a collective: ``DTensor.full_tensor()`` gathers through torch's functional collectives,
    which crash (SIGSEGV in gloo's thread) with CUDA tensors on gloo, all ranks on one GPU (torch 2.11).
    """
    if not hasattr(param, "to_local"):
        return param, reference
    parts = reference.chunk(ak.world_size())  # FSDP2 shards dim 0 as torch.chunk does; a rank past them has none
    return param.to_local(), parts[ak.rank()] if ak.rank() < len(parts) else reference[:0]


@pytest.mark.distributed
def test_collectives_ddp_and_the_loader_with_two_ranks_on_one_gpu() -> None:
    results = run_distributed(collectives_on_cuda, device="cuda", task_timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert (got["device"], got["backend"]) == ("cuda:0", "gloo")
        expected = {
            "gather": [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0],
            "gather of a tree": {"ids": [0, 1], "half": [0.5, 0.5, 1.5, 1.5]},
            "reduce sum": [10.0, 12.0, 14.0, 16.0],
            "reduce mean": [5.0, 6.0, 7.0, 8.0],
            "reduce max": [10.0, 11.0, 12.0, 13.0],
            "broadcast": [10.0, 11.0, 12.0, 13.0],
            "pad_across_processes": [1.0, 0.0] if rank == 0 else [1.0, 1.0],
            "gather_object": [{"rank": 0}, {"rank": 1}],
        }
        for name, value in expected.items():
            if name in got:
                assert got[name] == value, name
        if "gather_for_metrics" in got:
            assert sorted(got["gather_for_metrics"]) == list(range(11))
        if "ddp" in got:
            assert max(got["ddp"]) < 1e-5
    skip_unsupported([u for got in results for u in got["unsupported"]])


# --- checkpoints: CUDA tensors, the CUDA RNG, the grad scaler, resumed bit-exactly -----------------


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + 0.01 * torch.randn(x.shape[0], 1, device=x.device)  # draws from the CUDA RNG


def train_and_resume(directory: str) -> dict[str, Any]:
    data = TensorDataset(torch.randn(40, 16, generator=torch.Generator().manual_seed(0)), torch.randn(40, 1))

    def setup(seed: int) -> tuple[Any, Any, Any, Any]:
        ak.reset_state()
        ak.init(precision="fp16")
        ak.set_seed(seed)
        model = Noisy()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        loader = DataLoader(data, batch_size=8, shuffle=True)  # 5 batches an epoch
        return ak.prepare(model, opt, loader, sched)

    def steps(model: Any, opt: Any, loader: Any, sched: Any, n: int, at: dict[str, Any]) -> list[float]:
        losses: list[float] = []
        while len(losses) < n:
            batch = next(at["batches"], None)
            if batch is None:  # the epoch ended: the next iteration is the next epoch
                at["batches"] = iter(loader)
                continue
            x, y = batch
            loss = F.mse_loss(model(x), y)
            ak.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model, opt, loader, sched = setup(0)
    at = {"batches": iter(loader)}
    it_losses = steps(model, opt, loader, sched, 3, at)
    ak.save_state(directory, model=model, optimizer=opt, scheduler=sched, step=3)  # mid-epoch: 3 of 5 batches
    tail = steps(model, opt, loader, sched, 5, at)  # the rest of the epoch, then the next one
    params = [p.detach().cpu() for p in model.parameters()]
    model, opt, loader, sched = setup(123)  # another seed: everything must come from the checkpoint
    values = ak.load_state(directory, model=model, optimizer=opt, scheduler=sched)
    resumed = steps(model, opt, loader, sched, 5, {"batches": iter(loader)})
    return {
        "first": it_losses,
        "tail": tail,
        "resumed": resumed,
        "values": values,
        "same_params": all(torch.equal(a, b.detach().cpu()) for a, b in zip(params, model.parameters(), strict=True)),
        "device": str(next(model.parameters()).device),
    }


def test_a_checkpoint_with_cuda_tensors_and_rng_resumes_bit_exactly(tmp_path: Path) -> None:
    (run,) = run_distributed(
        train_and_resume, (str(tmp_path / "ckpt"),), num_processes=1, device="cuda", task_timeout=TIMEOUT
    )
    assert run["device"] == "cuda:0" and run["values"] == {"step": 3}
    assert run["resumed"] == run["tail"]  # loss for loss, bit for bit
    assert run["same_params"]


# --- save_model from CUDA, loaded by a process without CUDA -------------------------------------


def export_from_cuda(directory: str, torch_format: bool) -> tuple[str, dict[str, list[Any]]]:
    if torch_format:
        sys.modules["safetensors"] = None  # type: ignore[assignment]  # as on a machine without safetensors
    model = ak.prepare(mlp())
    path = ak.save_model(model, directory)
    return str(path), {k: v.cpu().tolist() for k, v in ak.unwrap(model).state_dict().items()}


LOAD_ON_CPU = """
import json, sys, torch
assert not torch.cuda.is_available()
path = sys.argv[1]
if path.endswith(".safetensors"):
    from safetensors.torch import load_file
    weights = load_file(path)
else:
    weights = torch.load(path, weights_only=True)  # plain torch, nothing of accelkit
print(json.dumps({k: [str(v.device), v.tolist()] for k, v in weights.items()}))
"""


@pytest.mark.parametrize("torch_format", [True, False], ids=["torch file", "as installed"])
def test_save_model_from_cuda_loads_in_a_cpu_only_process(tmp_path: Path, torch_format: bool) -> None:
    ((path, expected),) = run_distributed(
        export_from_cuda, (str(tmp_path / "export"), torch_format), num_processes=1, device="cuda"
    )
    if torch_format:
        assert path.endswith(".bin")
    done = subprocess.run(
        [sys.executable, "-c", LOAD_ON_CPU, path],
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert {k: v[1] for k, v in loaded.items()} == expected
    assert {v[0] for v in loaded.values()} == {"cpu"}


# --- FSDP2 with CUDA tensors: 2 ranks on one GPU, against one process ------------------------------


def fsdp_against_one_process() -> dict[str, Any]:
    attempt = Attempts()
    attempt("fsdp", ddp_against_one_process)  # the same loop: ak.prepare shards with strategy="fsdp"
    return {"strategy": ak.state().strategy.name, **attempt.results, "unsupported": attempt.unsupported}  # type: ignore[union-attr]


@pytest.mark.distributed
def test_fsdp2_on_cuda_trains_like_one_process() -> None:
    results = run_distributed(fsdp_against_one_process, device="cuda", strategy="fsdp", task_timeout=TIMEOUT)
    for got in results:
        assert got["strategy"] == "fsdp"
        if "fsdp" in got:
            assert max(got["fsdp"]) < 1e-5
    skip_unsupported([u for got in results for u in got["unsupported"]])


# --- find_executable_batch_size: a real CUDA out-of-memory error on one of two ranks ---------------


@ak.find_executable_batch_size(starting_batch_size=64)
def _cuda_ddp_step(batch_size: int, log: list[int]) -> tuple[int, list[float]]:
    model = ak.prepare(mlp())
    log.append(batch_size)
    if ak.rank() == 1 and batch_size > 16:
        torch.empty(2**46, dtype=torch.uint8, device="cuda")  # 64 TiB: a real CUDA out-of-memory error
    x = torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(ak.rank())).to(ak.device())
    ak.backward(model(x).square().mean())  # rank 0 waits in DDP's all-reduce while rank 1 fails
    return batch_size, [p.grad.sum().item() for p in model.parameters()]  # type: ignore[union-attr]


def cuda_oom_on_rank_one() -> tuple[list[int], int, list[float]]:
    log: list[int] = []
    batch_size, grads = _cuda_ddp_step(log)
    return log, batch_size, grads


@pytest.mark.distributed
def test_find_executable_batch_size_agrees_after_a_real_cuda_oom_on_one_rank() -> None:
    (log0, size0, grads0), (log1, size1, grads1) = run_distributed(
        cuda_oom_on_rank_one, device="cuda", task_timeout=TIMEOUT
    )
    assert log0 == log1 == [64, 32, 16]
    assert size0 == size1 == 16
    assert grads0 == pytest.approx(grads1)  # DDP averaged them: the last attempt was synchronised
