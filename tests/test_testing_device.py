"""accelkit.testing keeps its workers on the CPU on every path, unless asked for the one GPU.

A CPU-only machine cannot tell a worker on the CPU from one that would have picked a GPU, so
the workers here are shown a CUDA device (``torch.cuda.is_available`` answers True): without
the pin a worker that asks for ``cpu=False`` would then try to use it, and fail.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import accelkit as ak
from accelkit.testing import WorkerPool, run_distributed


def _as_if_a_gpu_were_visible() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1


def device_of_a_task() -> str:
    _as_if_a_gpu_were_visible()
    return str(ak.device())


@pytest.mark.distributed
def test_pool_workers_stay_on_the_cpu_in_every_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")  # the suite's own pin: the pool's must hold without it
    with WorkerPool(2) as pool:
        assert pool.run(device_of_a_task) == ["cpu", "cpu"]
        assert pool.run(device_of_a_task) == ["cpu", "cpu"]  # a fresh training state, the same pin


def rank_one_fails_while_rank_zero_is_stuck() -> None:
    if ak.rank() == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(600)  # e.g. in a collective that waits for rank 1


@pytest.mark.distributed
def test_a_task_that_leaves_a_rank_stuck_restarts_the_pool() -> None:
    with WorkerPool(2, grace=1.0) as pool:
        first = pool.pids
        with pytest.raises(ak.WorkerError, match=r"rank 1 failed: RuntimeError: rank 1 fails") as failed:
            pool.run(rank_one_fails_while_rank_zero_is_stuck)
        assert "rank 0 did not answer within 1 s" in str(failed.value)
        assert pool.run(ak.rank, task_timeout=30) == [0, 1], "the next task runs on a fresh group"
        assert set(pool.pids).isdisjoint(first)


def device_across_a_restart() -> tuple[int, str, str]:
    _as_if_a_gpu_were_visible()
    st = ak.init(cpu=False)  # code that asks for the accelerator, inside a test's worker
    if st.restart_count == 0 and st.rank == 1:
        raise RuntimeError("the first attempt fails; the agent restarts every worker")
    return st.restart_count, str(st.device), st.backend


@pytest.mark.distributed
def test_run_distributed_workers_stay_on_the_cpu_after_a_restart() -> None:
    assert run_distributed(device_across_a_restart, max_restarts=1) == [(1, "cpu", "gloo")] * 2


def device_after_a_state_reset() -> tuple[str, str]:
    _as_if_a_gpu_were_visible()
    before = str(ak.device())
    ak.reset_state()
    return before, str(ak.init(cpu=False).device)


def test_a_worker_stays_on_the_cpu_after_a_state_reset() -> None:
    # One process: re-forming a two-rank group after a reset is another matter (gloo's timing).
    assert run_distributed(device_after_a_state_reset, num_processes=1) == [("cpu", "cpu")]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device": "gpu"}, ValueError, r"device='gpu'\): expected one of 'cpu', 'cuda'"),
        ({"device": "cpu", "cpu": False}, ValueError, r"device='cpu', cpu=False\).*chosen by device= alone"),
        ({"cpu": "yes"}, ValueError, r"cpu='yes'\): expected True or False"),
    ],
)
def test_bad_devices_are_refused_before_any_worker_starts(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        run_distributed(ak.rank, **kwargs)
    with pytest.raises(error, match=match):
        WorkerPool(2, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_asking_for_the_gpu_without_one_says_how_to_skip() -> None:
    with pytest.raises(RuntimeError, match=r"device='cuda'\): torch sees no CUDA device.*skipif"):
        run_distributed(ak.rank, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_worker_pinned_to_a_gpu_it_cannot_see_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TEST_DEVICE", "cuda")
    with pytest.raises(ak.ConfigurationError, match=r"ACCELKIT_TEST_DEVICE=cuda.*no CUDA device.*device='cpu'"):
        ak.init()


def test_a_malformed_pin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TEST_DEVICE", "tpu")
    with pytest.raises(ak.ConfigurationError, match=r"ACCELKIT_TEST_DEVICE='tpu': expected one of cpu, cuda"):
        ak.init()
