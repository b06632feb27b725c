"""Hygiene for every test, and the long-lived worker group the distributed tests share."""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from processes import alive

import accelkit as ak
from accelkit.testing import WorkerPool

# A config file of the machine's user must not change what the tests see; tests that need one set it.
os.environ["ACCELKIT_CONFIG_FILE"] = ""
# The tests run in this process, in the pool's workers and in the subprocesses they start test CPU
# behaviour, the same on every machine: the state's device is the CPU. The CUDA paths have tests of
# their own, marked `gpu` (skipped without CUDA, run last, their CUDA work in workers or with
# ACCELKIT_CPU unset), so that nothing initialises CUDA in this process before a test that forks.
os.environ["ACCELKIT_CPU"] = "1"
# torch.cuda.is_available() (the gpu tests' skip conditions, read at collection) asks NVML, not the CUDA
# driver: a driver initialised here would fail the CUDA calls of the workers that later tests fork.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
# Workers started by the tests share two cores: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# multiprocessing's helper process lives for the whole session; start it before any test.
multiprocessing.resource_tracker.ensure_running()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` last: one that initialises CUDA here would stop later tests from forking."""
    items.sort(key=lambda item: item.get_closest_marker("gpu") is not None)


def _children() -> set[int]:
    pid = os.getpid()
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
        except OSError:
            pass
    return found


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if alive(pid)}


_pools: list[WorkerPool] = []
# pytest's own, and one torch sets for itself the first time it loads its compiler stack.
_NOT_OURS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    """Reset accelkit; fail on leaked env vars, process groups, threads and child processes, and on CUDA
    initialised here by a test not marked ``gpu``."""
    ak.reset_state()
    cuda_before = torch.cuda.is_initialized()
    env = dict(os.environ)
    threads = set(threading.enumerate())
    children = _children()
    yield
    ak.reset_state()
    problems = []
    if dist.is_initialized():
        problems.append("a process group is still initialised")
        dist.destroy_process_group()
    changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
    changed -= _NOT_OURS
    if changed:
        problems.append(f"environment variables changed: {sorted(changed)}")
        os.environ.clear()
        os.environ.update(env)
    leaked_threads = [t for t in set(threading.enumerate()) - threads if t.is_alive()]
    if leaked_threads:
        problems.append(f"threads left running: {leaked_threads}")
    pool_pids = {pid for pool in _pools for pid in pool.pids}
    leaked = _alive(_children() - children - pool_pids)
    if leaked:
        problems.append(f"child processes left running: {sorted(leaked)}")
    if torch.cuda.is_initialized() and not cuda_before and request.node.get_closest_marker("gpu") is None:
        problems.append("CUDA was initialised in the test process (later tests that fork fail): do it in workers")
    saving = sys.modules.get("accelkit._checkpoint._async")
    lost = saving._unreported() if saving is not None else []
    if lost:  # else the whole session would end with exit code 1, as a script does
        problems.append(
            f"a background save failed and no call raised it ({lost[0][2]!r}): raise it with ak.wait_for_checkpoint()"
        )
        lost.clear()
    if problems:
        pytest.fail("test hygiene: " + "; ".join(problems))


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """Two gloo CPU workers, started once per session; send them module-level functions."""
    with WorkerPool(2) as workers:
        _pools.append(workers)
        yield workers
    _pools.remove(workers)


@pytest.fixture(scope="module")
def pool4() -> Iterator[WorkerPool]:
    """Four gloo CPU workers, for the tests of one module."""
    with WorkerPool(4, task_timeout=300) as workers:
        _pools.append(workers)
        yield workers
    _pools.remove(workers)


@pytest.fixture(scope="session")
def debug_pool() -> Iterator[WorkerPool]:
    """Like ``pool``, with accelkit's debug mode on in the workers."""
    with WorkerPool(2, debug=True) as workers:
        _pools.append(workers)
        yield workers
    _pools.remove(workers)
