"""Two ranks on one GPU: the multi-process device paths, marked ``gpu`` and skipped without CUDA.

NCCL puts one rank on each GPU, so on a one-GPU machine these paths run as ``accelkit.testing``
runs them with ``device="cuda"``: every rank on cuda:0, over gloo, which moves CUDA tensors through
host memory (tests/test_gpu.py has the one-rank paths and the first two-rank ones). What is checked:
the checked collectives read nothing back from the device in steady state and report a
disagreement found on the device (one call late); an fp16 DDP step makes no host-device sync; a
background save of CUDA state is a snapshot, committed while the loop goes on, and resumes bit for
bit (under DDP and under FSDP2); the mesh options that fit on 2 ranks train like one process.

Host-device syncs are counted as in tests/test_gpu.py, with ``torch.cuda.set_sync_debug_mode("warn")``
(a public switch: each synchronising CUDA call of this thread, or of autograd's, warns). Not "error":
gloo's own worker thread synchronises its copy streams, which that mode would turn into a failed
collective; its warnings do not reach Python, so the count is what the calling code does. Where gloo
cannot do an operation with CUDA tensors, or crashes in torch's functional collectives (tensor
parallelism's all-reduces; DTensor's ``full_tensor()``, which these tests avoid), the test skips and
says which. Results are compared with one process on the CPU or on the same GPU.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from mesh_models import train_on_mesh, train_reference
from test_gpu import TIMEOUT, Attempts, count_syncs, ddp_against_one_process, prepared_loop, skip_unsupported
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak
from accelkit.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEADY_CALLS = 5  # counted after 3 calls of each: a point of the program is planned from its second call


# --- the checked collectives' device path: nothing read back in steady state ----------------------


def repeated(call: Any) -> Any:
    return lambda: [call() for _ in range(STEADY_CALLS)]


def steady_state_syncs() -> dict[str, Any]:
    """Per call, in steady state: accelkit's syncs and raw torch.distributed's for the same job; the values."""
    import torch.distributed as dist

    device, rank = ak.device(), ak.rank()
    x = torch.arange(1000.0, device=device) + rank
    tree = {"a": x[:10].clone(), "b": x[:3].half()}
    loader = ak.prepare(DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4))  # even batches: no sizes read
    batch = next(iter(loader))[0]

    def raw_gather(t: torch.Tensor) -> None:
        dist.all_gather_into_tensor(t.new_empty(2 * t.numel()), t)

    cases = {
        "reduce": (lambda: ak.reduce(x), lambda: dist.all_reduce(x.clone())),
        "reduce mean": (lambda: ak.reduce(x, op="mean"), lambda: dist.all_reduce(x.clone())),
        "gather": (lambda: ak.gather(x), lambda: raw_gather(x)),
        "broadcast": (lambda: ak.broadcast(x), lambda: dist.broadcast(x.clone(), 0)),
        "gather of a tree": (lambda: ak.gather(tree), lambda: [raw_gather(t) for t in tree.values()]),
        "reduce of a tree": (lambda: ak.reduce(tree), lambda: [dist.all_reduce(t.clone()) for t in tree.values()]),
        "gather_for_metrics": (lambda: ak.gather_for_metrics(batch), lambda: raw_gather(batch)),
    }
    counts: dict[str, list[int]] = {}
    for name, (ours, raw) in cases.items():
        for _ in range(3):
            ours()
            raw()
        counts[name] = [count_syncs(repeated(ours)), count_syncs(repeated(raw))]
    values = {
        "reduce": ak.reduce(x[:3]).cpu().tolist(),
        "gather": ak.gather(x[:2]).cpu().tolist(),
        "tree": {k: v.float().cpu().tolist() for k, v in ak.reduce({"a": x[:2], "b": x[:2].half()}).items()},
        "gather_for_metrics": ak.gather_for_metrics(batch).cpu().tolist(),
    }
    ak.wait_for_everyone()  # reads the last verdict
    return {"counts": counts, "values": values, "device": str(x.device)}


def test_checked_collectives_read_nothing_back_from_the_device_in_steady_state() -> None:
    for rank, got in enumerate(run_distributed(steady_state_syncs, device="cuda", task_timeout=TIMEOUT)):
        assert got["device"] == "cuda:0"
        for name, (ours, raw) in got["counts"].items():
            assert ours == 0, f"rank {rank}, {name}: {ours} syncs in {STEADY_CALLS} calls (raw: {raw})"
        assert got["values"] == {
            "reduce": [1.0, 3.0, 5.0],
            "gather": [0.0, 1.0, 1.0, 2.0],
            "tree": {"a": [1.0, 3.0], "b": [1.0, 3.0]},
            "gather_for_metrics": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        }


def disagreement_found_on_the_device() -> dict[str, Any]:
    """Three calls plan a point of the program; at the fourth, rank 1 passes another shape (the same bytes)."""
    device, rank = ak.device(), ak.rank()
    x = torch.arange(4.0, device=device)
    raised: list[tuple[str, str]] = []
    for step in range(4):
        mine = x.view(2, 2) if step == 3 and rank == 1 else x
        try:
            ak.reduce(mine)  # one point of the program
        except ak.DistributedOperationError as exc:
            raised.append((f"call {step}", str(exc)))
    try:
        ak.wait_for_everyone()  # on a GPU the verdict of a planned call is read here, one call late
    except ak.DistributedOperationError as exc:
        raised.append(("the next call", str(exc)))
    after = ak.reduce(torch.ones(2, device=device)).cpu().tolist()  # the ranks stayed in step
    return {"raised": raised, "after": after}


def test_a_disagreement_found_on_the_device_is_raised_on_every_rank_by_the_next_call() -> None:
    for rank, got in enumerate(run_distributed(disagreement_found_on_the_device, device="cuda", task_timeout=TIMEOUT)):
        assert len(got["raised"]) == 1, f"rank {rank}: {got['raised']}"
        where, message = got["raised"][0]
        assert where in ("call 3", "the next call"), (rank, where)
        assert "accelkit.reduce" in message and "[2, 2]" in message, message
        assert got["after"] == [2.0, 2.0], rank


# --- an fp16 step under DDP: no host-device sync --------------------------------------------------


def fp16_ddp_steps() -> dict[str, Any]:
    step, model, sched = prepared_loop("fp16")  # test_gpu's one-rank loop, here under DDP
    losses = [step()]  # the first step creates the optimizer's state, cuBLAS handles, DDP's buckets
    torch.cuda.synchronize()
    syncs = count_syncs(lambda: losses.extend(step() for _ in range(10)))
    params = [p.detach().cpu() for p in ak.unwrap(model).parameters()]
    return {"syncs": syncs, "losses": [v.item() for v in losses], "params": params, "lr": sched.get_last_lr()[0]}


def test_an_fp16_step_under_ddp_on_two_ranks_makes_no_host_device_sync() -> None:
    runs = run_distributed(fp16_ddp_steps, device="cuda", task_timeout=TIMEOUT)
    for rank, got in enumerate(runs):
        assert got["syncs"] == 0, f"rank {rank}: {got['syncs']} syncs in 10 steps"
        assert len(got["losses"]) == 11
    for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
        assert torch.equal(a, b)  # DDP kept the replicas equal
    assert runs[0]["lr"] == runs[1]["lr"] < 1e-3  # the scheduler stepped with the optimizer


# --- a background save of CUDA state: a snapshot, committed while the loop goes on ----------------


def wide_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))  # 16 MB, 48 MB with Adam


def host_copies(model: nn.Module) -> list[torch.Tensor]:
    """This rank's part of each parameter (an FSDP shard, compared without a collective), on the host."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone() for p in model.parameters()]


def background_save_and_resume(root: str) -> dict[str, Any]:
    device = ak.device()

    def prepared(seed: int) -> tuple[Any, Any]:
        model = wide_model(seed)
        return ak.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))

    def steps(model: Any, opt: Any, first: int, n: int) -> None:
        for i in range(first, first + n):
            g = torch.Generator().manual_seed(100 * i + ak.rank())
            ak.backward(model(torch.randn(8, 1024, generator=g).to(device)).square().mean())
            opt.step()
            opt.zero_grad()

    model, opt = prepared(0)
    steps(model, opt, 0, 2)
    saved = host_copies(ak.unwrap(model))
    ak.save_state(f"{root}/ckpt", blocking=False, model=model, optimizer=opt, step=2)  # returns once staged
    steps(model, opt, 2, 3)  # the loop goes on while the state is written: the checkpoint must not see it
    ak.wait_for_checkpoint()
    went_on = host_copies(ak.unwrap(model))
    model, opt = prepared(7)  # another seed: everything must come from the checkpoint
    values = ak.load_state(f"{root}/ckpt", model=model, optimizer=opt)
    loaded = host_copies(ak.unwrap(model))
    steps(model, opt, 2, 3)  # the same three steps again
    return {
        "values": values,
        "snapshot": all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True)),
        "moved_on": any(not torch.equal(a, b) for a, b in zip(went_on, saved, strict=True)),
        "resumed": all(torch.equal(a, b) for a, b in zip(host_copies(ak.unwrap(model)), went_on, strict=True)),
        "device": str(next(ak.unwrap(model).parameters()).device),
        "strategy": ak.state().strategy.name,  # type: ignore[union-attr]
    }


def attempted_background_save(root: str) -> dict[str, Any]:
    attempt = Attempts()
    attempt("run", lambda: background_save_and_resume(root))
    return {**attempt.results, "unsupported": attempt.unsupported}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_background_save_of_cuda_state_is_a_snapshot_and_resumes_bit_exactly(tmp_path: Path, strategy: str) -> None:
    results = run_distributed(
        attempted_background_save, (str(tmp_path),), device="cuda", strategy=strategy, task_timeout=TIMEOUT
    )
    for rank, got in enumerate(results):
        run = got.get("run")
        if run is None:
            continue
        assert (run["device"], run["strategy"], run["values"]) == ("cuda:0", strategy, {"step": 2}), rank
        assert run["moved_on"], "the loop trained on after the call"
        assert run["snapshot"], f"rank {rank}: the checkpoint holds the state of the call, not a later one"
        assert run["resumed"], f"rank {rank}: the resumed run took other steps"
    skip_unsupported([u for got in results for u in got["unsupported"]])


# --- FSDP2 over gloo with CUDA tensors: several steps, then the shards against one process ---------


def fsdp_bf16_against_one_process() -> dict[str, Any]:
    """bf16 FSDP2 (the default wrap) against one process on the whole batch, under autocast, on the same GPU."""
    attempt = Attempts()
    attempt("fsdp bf16", lambda: ddp_against_one_process("bf16"))  # ak.prepare shards with strategy="fsdp"
    return {"strategy": ak.state().strategy.name, **attempt.results, "unsupported": attempt.unsupported}  # type: ignore[union-attr]


def test_fsdp2_in_bf16_on_cuda_trains_like_one_process() -> None:
    results = run_distributed(fsdp_bf16_against_one_process, device="cuda", strategy="fsdp", task_timeout=TIMEOUT)
    for got in results:
        assert got["strategy"] == "fsdp"
        if "fsdp bf16" in got:
            assert max(got["fsdp bf16"]) < 1e-2  # bf16 matmuls of half the batch each, against the whole one
    skip_unsupported([u for got in results for u in got["unsupported"]])


# --- the mesh options that fit on 2 ranks --------------------------------------------------------

MESHES = {"dp_shard=2": {"dp_shard": 2}, "dp_replicate=2": {"dp_replicate": 2}, "tp=2": {"tp": 2}}
BATCH, STEPS, ACCUMULATE = 2, 3, 2


def local_parts(model: nn.Module) -> dict[str, Any]:
    """Each parameter's part on this rank, and where it is cut from the whole: (dim, index, parts) per shard.

    Read without a collective: ``full_tensor()`` goes through torch's functional collectives, which
    crash gloo with CUDA tensors (module docstring).
    """
    from torch.distributed.tensor import DTensor, Shard

    parts: dict[str, Any] = {}
    for name, p in ak.unwrap(model).named_parameters():
        cuts = []
        if isinstance(p, DTensor):
            mesh, coordinate = p.device_mesh, p.device_mesh.get_coordinate() or []
            cuts = [(pl.dim, coordinate[i], mesh.size(i)) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
            p = p.to_local()
        parts[name] = (p.detach().float().cpu(), cuts)
    return parts


def cut(whole: torch.Tensor, cuts: list[tuple[int, int, int]]) -> torch.Tensor:
    for dim, index, parts in cuts:  # torch.chunk's split, as DTensor's Shard; a rank past the chunks has none
        chunks = whole.chunk(parts, dim)
        whole = chunks[index] if index < len(chunks) else whole.narrow(dim, 0, 0)
    return whole


def mesh_on_cuda(sizes: dict[str, int]) -> dict[str, Any]:
    attempt = Attempts()
    attempt("mesh", lambda: train_on_mesh(BATCH, STEPS, ACCUMULATE, params=local_parts, **sizes))
    return {**attempt.results, "unsupported": attempt.unsupported}


@pytest.mark.parametrize("layout", list(MESHES))
def test_a_mesh_on_two_ranks_of_one_gpu_trains_to_the_one_process_parameters(layout: str) -> None:
    sizes = MESHES[layout]
    try:
        runs = run_distributed(mesh_on_cuda, (sizes,), device="cuda", task_timeout=TIMEOUT)
    except ak.WorkerError as exc:
        crashed = [f for f in exc.failures if f.exitcode == -signal.SIGSEGV]
        if layout == "tp=2" and crashed:  # tensor parallelism's all-reduces are functional collectives
            pytest.skip(f"gloo crashed (SIGSEGV) with CUDA tensors in torch {torch.__version__}: {exc}")
        raise
    dp = 1 if layout == "tp=2" else 2
    ref = train_reference(BATCH * dp * ACCUMULATE, STEPS)
    whole = ref["params"]
    for rank, got in enumerate(runs):
        run = got.get("mesh")
        if run is None:
            continue
        assert layout.split("=")[0] in run["mesh"], run["mesh"]
        for name, (part, cuts) in run["params"].items():
            torch.testing.assert_close(part, cut(whole[name], cuts), atol=1e-4, rtol=0, msg=f"rank {rank}: {name}")
        torch.testing.assert_close(run["norms"], ref["norms"], atol=1e-4, rtol=0)
        micro = run["losses"]
        pairs = [sum(micro[i : i + ACCUMULATE]) / ACCUMULATE for i in range(0, len(micro), ACCUMULATE)]
        torch.testing.assert_close(pairs, ref["losses"], atol=1e-4, rtol=0)
    seen = [got["mesh"]["seen"] for got in runs if "mesh" in got]
    if len(seen) == 2:
        assert (seen[0] == seen[1]) == (layout == "tp=2"), "a tp group shares its batches; dp ranks do not"
    skip_unsupported([u for got in runs for u in got["unsupported"]])
