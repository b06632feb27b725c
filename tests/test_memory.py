"""find_executable_batch_size and free_memory: the retry schedule on one process, the
decorator's contract, and on two gloo processes a rank that runs out of memory while the
other one waits for it in a collective."""

from __future__ import annotations

import gc
import inspect
import logging
import math
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import accelkit as ak
from accelkit._backends.cpu import CPUBackend
from accelkit.testing import WorkerPool, run_distributed


class Fits:
    """A stand-in for a training function: out of memory above ``limit``; records each call."""

    def __init__(self, limit: int, error: BaseException | None = None) -> None:
        self.limit, self.error, self.calls = limit, error, []  # type: ignore[var-annotated]

    def __call__(self, batch_size: int) -> int:
        self.calls.append(batch_size)
        if batch_size > self.limit:
            raise self.error or torch.OutOfMemoryError(f"CUDA out of memory at batch_size={batch_size}")
        return batch_size


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def retries() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("accelkit._memory")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


# --- one process ------------------------------------------------------------------------------


def test_halves_until_the_function_fits() -> None:
    fits = Fits(limit=32)
    assert ak.find_executable_batch_size(starting_batch_size=128)(fits)() == 32
    assert fits.calls == [128, 64, 32]
    assert not dist.is_initialized()  # one process: no process group for the agreement


def test_each_call_starts_again_from_the_starting_size() -> None:
    fits = Fits(limit=20)
    run = ak.find_executable_batch_size(starting_batch_size=64)(fits)
    assert run() == 16
    fits.limit = 100  # more memory now: the next call gets the full size again
    assert run() == 64
    assert fits.calls == [64, 32, 16, 64]


def test_the_bare_decorator_starts_at_128() -> None:
    fits = Fits(limit=1000)
    assert ak.find_executable_batch_size(fits)() == 128


def test_no_executable_size_lists_the_sizes_and_chains_the_last_oom() -> None:
    fits = Fits(limit=0)
    with pytest.raises(ak.NoExecutableBatchSizeError, match="no executable batch size") as info:
        ak.find_executable_batch_size(starting_batch_size=8)(fits)()
    assert isinstance(info.value, RuntimeError)  # as Accelerate's, which raises a bare RuntimeError
    assert "(8, 4, 2, 1)" in str(info.value)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "batch_size=1" in str(info.value.__cause__)
    assert fits.calls == [8, 4, 2, 1]


def test_other_errors_propagate_unchanged_at_once() -> None:
    error = ValueError("bad input")
    fits = Fits(limit=0, error=error)
    with pytest.raises(ValueError) as info:
        ak.find_executable_batch_size(starting_batch_size=64)(fits)()
    assert info.value is error
    assert fits.calls == [64]


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
        "to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)",
        "XPU out of memory. Tried to allocate 1.00 GiB",
        "MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 0 bytes)",
    ],
)
def test_allocator_messages_count_as_out_of_memory(message: str) -> None:
    fits = Fits(limit=16, error=RuntimeError(message))
    assert ak.find_executable_batch_size(starting_batch_size=32)(fits)() == 16


def test_a_python_memory_error_counts_as_out_of_memory() -> None:
    assert ak.find_executable_batch_size(starting_batch_size=4)(Fits(limit=2, error=MemoryError()))() == 2


def test_other_runtime_errors_are_not_out_of_memory() -> None:
    fits = Fits(limit=0, error=RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        ak.find_executable_batch_size(starting_batch_size=64)(fits)()
    assert fits.calls == [64]


class Activations:
    pass


def test_the_failed_attempt_is_released_before_the_cache_is_emptied(monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[weakref.ref[Activations]] = []
    released_when_emptied: list[bool] = []
    monkeypatch.setattr(CPUBackend, "empty_cache", lambda self: released_when_emptied.append(held[-1]() is None))
    ak.init(cpu=True)

    @ak.find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int) -> int:
        activations = Activations()  # what a real forward pass holds on to when memory runs out
        held.append(weakref.ref(activations))
        if batch_size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return batch_size

    assert train() == 1
    assert released_when_emptied == [True, True]


def test_every_retry_is_logged_with_the_old_and_new_size(retries: Records) -> None:
    ak.find_executable_batch_size(starting_batch_size=128)(Fits(limit=32))()
    assert len(retries.messages) == 2
    assert "batch_size=128" in retries.messages[0] and "retrying with batch_size=64" in retries.messages[0]
    assert "batch_size=64" in retries.messages[1] and "retrying with batch_size=32" in retries.messages[1]
    assert "CUDA out of memory at batch_size=128" in retries.messages[0]


# --- the decorator's contract -----------------------------------------------------------------


@ak.find_executable_batch_size(starting_batch_size=16)
def train(batch_size: int, epochs: int, *, lr: float = 0.1) -> tuple[int, int, float]:
    """Train for a few epochs."""
    return batch_size, epochs, lr


def the_signature_without_batch_size(epochs: int, *, lr: float = 0.1) -> tuple[int, int, float]:
    raise AssertionError("only its signature is used")


def test_name_doc_and_signature_are_kept_without_the_batch_size() -> None:
    assert train.__name__ == "train"
    assert train.__doc__ == "Train for a few epochs."
    assert inspect.signature(train) == inspect.signature(the_signature_without_batch_size)
    assert "batch_size" in inspect.signature(train.__wrapped__).parameters  # type: ignore[attr-defined]
    assert train(3, lr=0.5) == (16, 3, 0.5)


untyped_decorator: Any = ak.find_executable_batch_size  # its types describe functions, not methods


class Trainer:
    @untyped_decorator(starting_batch_size=8)  # type: ignore[untyped-decorator]
    def fit(self, batch_size: int, epochs: int = 1) -> tuple[Trainer, int, int]:
        return self, batch_size, epochs


def test_methods_bind_and_keep_their_signature() -> None:
    trainer = Trainer()
    assert trainer.fit(2) == (trainer, 8, 2)
    assert Trainer.fit(trainer, epochs=3) == (trainer, 8, 3)
    assert list(inspect.signature(trainer.fit).parameters) == ["epochs"]
    assert list(inspect.signature(Trainer.fit).parameters) == ["self", "epochs"]
    assert inspect.signature(trainer.fit).parameters["epochs"].default == 1


def test_a_positional_starting_size_hints_at_the_keyword() -> None:
    with pytest.raises(TypeError, match=r"did you mean @ak.find_executable_batch_size\(starting_batch_size=64\)"):
        ak.find_executable_batch_size(64)  # type: ignore[call-overload]


@pytest.mark.parametrize("bad", [-8, 2.5, "64", True])
def test_a_starting_size_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"starting_batch_size={bad!r}"):
        ak.find_executable_batch_size(starting_batch_size=bad)


def test_the_function_must_take_the_batch_size_first() -> None:
    with pytest.raises(TypeError, match="must take the batch size as its first positional parameter"):
        ak.find_executable_batch_size(lambda *, batch_size: batch_size)  # type: ignore[arg-type,misc]
    with pytest.raises(TypeError, match="must decorate a function"):
        ak.find_executable_batch_size("train")  # type: ignore[call-overload]


def test_a_batch_size_from_the_caller_is_refused() -> None:
    supplied = r"batch_size is supplied by @accelkit.find_executable_batch_size; call train\(3\) without it"
    with pytest.raises(TypeError, match=supplied):
        train(32, 3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"batch_size is supplied by .*train\(3, lr=0.5\)"):
        train(3, batch_size=32, lr=0.5)  # type: ignore[call-arg]


def test_optional_arguments_are_not_mistaken_for_a_batch_size() -> None:
    @ak.find_executable_batch_size(starting_batch_size=4)
    def evaluate(batch_size: int, steps: int = 10, *extra: int) -> tuple[int, int, tuple[int, ...]]:
        return batch_size, steps, extra

    assert evaluate(5) == (4, 5, ())
    assert evaluate(5, 6, 7) == (4, 5, (6, 7))


# --- free_memory ------------------------------------------------------------------------------


class Cycle:
    def __init__(self) -> None:
        self.me = self  # only the garbage collector frees it


def test_free_memory_returns_nones_collects_and_empties_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[bool] = []
    monkeypatch.setattr(CPUBackend, "empty_cache", lambda self: emptied.append(True))
    ak.init(cpu=True)
    a: Cycle | None = Cycle()
    b: Cycle | None = Cycle()
    refs = weakref.ref(a), weakref.ref(b)
    gc.disable()  # only an explicit collection frees the cycles
    try:
        a, b = ak.free_memory(a, b)
        assert (a, b) == (None, None)
        assert ak.free_memory() == []  # the rebound objects are garbage now
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
    assert emptied == [True, True]


def test_free_memory_creates_no_state() -> None:
    assert ak.free_memory(torch.zeros(3)) == [None]
    assert not ak.is_initialized() and not dist.is_initialized()


# --- several processes ------------------------------------------------------------------------
# Rank 1 runs out of memory above 32 after a short delay, while rank 0 is already waiting
# for it in a collective of the same step.


@ak.find_executable_batch_size(starting_batch_size=128)
def _reduce_step(batch_size: int, log: list[tuple[str, int]]) -> tuple[int, float]:
    log.append(("start", batch_size))
    if ak.rank() == 1:
        time.sleep(0.5)  # rank 0 is inside the all-reduce by now
        if batch_size > 32:
            raise torch.OutOfMemoryError(f"CUDA out of memory on rank 1 at batch_size={batch_size}")
    total = ak.reduce(torch.tensor([float(batch_size)]), op="sum")
    log.append(("end", batch_size))
    return batch_size, total.item()


@ak.find_executable_batch_size(starting_batch_size=16)
def _local_step(batch_size: int) -> int:
    if ak.rank() == 1 and batch_size > 4:  # rank 0 has finished and waits for the verdict
        raise torch.OutOfMemoryError(f"CUDA out of memory on rank 1 at batch_size={batch_size}")
    return batch_size


def oom_while_peer_waits() -> dict[str, Any]:
    log: list[tuple[str, int]] = []
    started = time.monotonic()
    batch_size, total = _reduce_step(log)
    after = ak.reduce(torch.tensor([1.0]), op="sum").item()  # the re-formed group works
    seconds = time.monotonic() - started
    local = _local_step()
    return {"batch_size": batch_size, "total": total, "log": log, "after": after, "seconds": seconds, "local": local}


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_one_oom_while_rank_zero_waits_in_a_collective() -> None:
    # The collective timeout is 600 s; were rank 0 left waiting, run_distributed would fail at 120 s.
    results = run_distributed(oom_while_peer_waits, task_timeout=120)
    tried = [("start", 128), ("start", 64), ("start", 32), ("end", 32)]
    for result in results:
        assert result["log"] == tried  # rank 0 too was stopped at 128 and 64, inside its all-reduce
        assert (result["batch_size"], result["total"], result["after"]) == (32, 64.0, 2.0)
        assert result["seconds"] < 60
        assert result["local"] == 4  # rank 0 had returned from 16 and 8, and still retried with rank 1


@ak.find_executable_batch_size(starting_batch_size=64)
def _ddp_step(batch_size: int, log: list[int]) -> tuple[int, list[float]]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 1))
    )
    log.append(batch_size)
    if ak.rank() == 1:
        time.sleep(0.5)  # rank 0 waits in DDP's gradient all-reduce by now
        if batch_size > 16:
            raise torch.OutOfMemoryError(f"CUDA out of memory on rank 1 at batch_size={batch_size}")
    x = torch.randn(batch_size, 256, generator=torch.Generator().manual_seed(ak.rank()))
    model(x).square().mean().backward()
    return batch_size, [p.grad.sum().item() for p in model.parameters()]  # type: ignore[union-attr]


def ddp_oom_while_peer_waits() -> tuple[list[int], int, list[float]]:
    log: list[int] = []
    batch_size, grads = _ddp_step(log)
    return log, batch_size, grads


@pytest.mark.slow
@pytest.mark.distributed
def test_a_ddp_model_built_inside_retries_on_every_rank() -> None:
    (log0, size0, grads0), (log1, size1, grads1) = run_distributed(ddp_oom_while_peer_waits, task_timeout=120)
    assert log0 == log1 == [64, 32, 16]
    assert size0 == size1 == 16
    assert grads0 == pytest.approx(grads1)  # DDP averaged the gradients: the final attempt was synchronised


@ak.find_executable_batch_size(starting_batch_size=16)
def _fitting_step(batch_size: int) -> int:
    return int(ak.reduce(torch.tensor([batch_size]), op="sum").item())


def fitting_step_keeps_the_group() -> tuple[int, bool]:
    group = dist.group.WORLD
    total = _fitting_step()
    return total, dist.group.WORLD is group


@pytest.mark.distributed
def test_when_every_rank_fits_the_group_is_kept(pool: WorkerPool) -> None:
    assert pool.run(fitting_step_keeps_the_group) == [(32, True), (32, True)]
    assert pool.run(fitting_step_keeps_the_group) == [(32, True), (32, True)]


@ak.find_executable_batch_size(starting_batch_size=16)
def _failing_step(batch_size: int) -> int:
    if ak.rank() == 1:
        raise KeyError("label 7 missing")
    return batch_size


def other_error_on_rank_one() -> int:
    return _failing_step()


@pytest.mark.distributed
def test_another_error_on_one_rank_stops_every_rank(pool: WorkerPool) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool.run(other_error_on_rank_one)
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[1].exc_type.endswith("KeyError") and "label 7 missing" in by_rank[1].message
    assert by_rank[0].exc_type.endswith("RuntimeError")
    assert "rank 1: KeyError" in by_rank[0].message
    assert pool.run(fitting_step_keeps_the_group) == [(32, True), (32, True)]  # the group is intact


@ak.find_executable_batch_size(starting_batch_size=16)
def _step_from_16(batch_size: int) -> int:
    return batch_size


@ak.find_executable_batch_size(starting_batch_size=8)
def _step_from_8(batch_size: int) -> int:
    return batch_size


def different_starting_sizes() -> int:
    return _step_from_16() if ak.rank() == 0 else _step_from_8()


@pytest.mark.distributed
def test_ranks_with_different_batch_sizes_are_refused(pool: WorkerPool) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool.run(different_starting_sizes)
    assert sorted(info.value.ranks) == [0, 1]
    for failure in info.value.failures:
        assert failure.exc_type.endswith("ValueError") and "same starting_batch_size" in failure.message


# --- a real CUDA out-of-memory error ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_out_of_memory_error_is_retried_down_to_the_largest_size_that_fits(
    retries: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")  # the state's device is the GPU: its cache is emptied between retries
    free_mib = torch.cuda.mem_get_info()[0] / 2**20
    start = 2 ** math.ceil(math.log2(4 * free_mib))  # 1 MiB rows: the first attempt needs 6 times what is free
    baseline = torch.cuda.memory_allocated()

    @ak.find_executable_batch_size(starting_batch_size=start)
    def forward(batch_size: int) -> int:
        inputs = torch.ones(batch_size // 2, 2**18, device="cuda")  # may fit where `hidden` does not
        hidden = torch.ones(batch_size, 2**18, device="cuda")
        return inputs.shape[0] + hidden.shape[0]

    batch_size = forward() * 2 // 3
    # The largest power of two that fits: 1.5 x batch_size MiB does, twice that did not.
    assert 1.5 * batch_size <= free_mib < 3 * batch_size / 0.9
    assert len(retries.messages) >= 2 and all("CUDA out of memory" in m for m in retries.messages)
    assert torch.cuda.memory_allocated() == baseline
