"""Prepared loaders that move batches to a device read one batch ahead, and change nothing else.

On a GPU the hardware backend's transfer copies batch ``i + 1`` while batch ``i`` computes
(tests/test_gpu.py runs the CUDA one). Here the CPU backend is given a transfer that copies
each batch, so the read-ahead path runs on the CPU: what the batches contain, their order,
the last-batch bookkeeping (``ak.accumulate``'s boundary, ``gather_for_metrics``' padding) and
the position a checkpoint records must be those of the loader without it. Without a transfer
(the CPU as it is) batches are not copied at all.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import accelkit as ak
from accelkit._backends.cpu import CPUBackend
from accelkit._backends.cuda import CUDABackend, CUDATransfer
from accelkit._tree import apply_to_tensors
from accelkit.testing import WorkerPool


class Copying:
    """A transfer that copies every tensor (as a device copy would) and logs what it did when."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def start(self, batch: Any) -> Any:
        self.log.append(("start", first_value(batch)))
        return apply_to_tensors(torch.Tensor.clone, batch)

    def finish(self, handle: Any) -> Any:
        self.log.append(("finish", first_value(handle)))
        return handle

    def pin_in_loader(self, num_workers: int) -> bool:
        return False


def first_value(batch: Any) -> Any:
    value = _plain(batch)
    while isinstance(value, (list, tuple, dict)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return value


@contextmanager
def moving_batches(log: list[tuple[str, Any]] | None = None) -> Iterator[list[tuple[str, Any]]]:
    """Prepared loaders made inside get the copying transfer (in this process)."""
    log = [] if log is None else log
    original = CPUBackend.batch_transfer
    CPUBackend.batch_transfer = lambda self, device: Copying(log)  # type: ignore[assignment,method-assign]
    try:
        yield log
    finally:
        CPUBackend.batch_transfer = original  # type: ignore[method-assign]


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def loaders() -> dict[str, Any]:
    data = torch.arange(40).view(20, 2).float()
    by_four = BatchSampler(SequentialSampler(range(9)), batch_size=4, drop_last=False)
    return {
        "shuffled": lambda: DataLoader(torch.utils.data.TensorDataset(data), batch_size=3, shuffle=True),
        "dicts": lambda: DataLoader([{"x": data[i], "i": i} for i in range(7)], batch_size=2),
        "batch sampler": lambda: DataLoader(range(9), batch_sampler=by_four),
        "unbatched": lambda: DataLoader(range(5), batch_size=None),
        "stream": lambda: DataLoader(Stream(7), batch_size=3),
    }


def epochs(make: Any, moved: bool, n: int = 2) -> list[list[Any]]:
    ak.reset_state()
    ak.set_seed(3)
    if moved:
        with moving_batches():
            loader = ak.prepare(make())
    else:
        loader = ak.prepare(make())
    return [[_plain(batch) for batch in loader] for _ in range(n)]


def _plain(batch: Any) -> Any:
    return apply_to_tensors(torch.Tensor.tolist, batch)


@pytest.mark.parametrize("kind", list(loaders()))
def test_batches_moved_ahead_are_the_same_batches_in_the_same_order(kind: str) -> None:
    make = loaders()[kind]
    assert epochs(make, moved=True) == epochs(make, moved=False)


def test_the_next_copy_starts_after_the_current_batch_is_ready_and_before_it_is_used() -> None:
    with moving_batches() as log:
        loader = ak.prepare(DataLoader(range(3), batch_size=1))
    for batch in loader:
        log.append(("use", batch.item()))
    assert log == [
        ("start", 0), ("finish", 0), ("start", 1), ("use", 0),
        ("finish", 1), ("start", 2), ("use", 1),
        ("finish", 2), ("use", 2),
    ]  # fmt: skip


def test_accumulation_ends_on_the_last_batch_read_ahead_or_not() -> None:
    def boundaries() -> list[bool]:
        model = torch.nn.Linear(1, 1)
        seen = []
        for _ in loader:
            with ak.accumulate(model, steps=4):
                seen.append(ak.sync_gradients())
        return seen

    with moving_batches():
        loader = ak.prepare(DataLoader(range(6), batch_size=1))
    assert boundaries() == [False, False, False, True, False, True]


def test_a_checkpoint_position_counts_the_batches_handed_out_not_the_one_read_ahead() -> None:
    with moving_batches():
        loader = ak.prepare(DataLoader(range(10), batch_size=2, shuffle=True))
        resumed = ak.prepare(DataLoader(range(10), batch_size=2, shuffle=True))
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state["batches_yielded"] == 2
    rest = [b.tolist() for b in it]
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest and len(seen + rest) == 5


def test_a_break_leaves_no_active_loader_and_the_next_epoch_is_whole() -> None:
    with moving_batches():
        loader = ak.prepare(DataLoader(range(6), batch_size=2))
    for _ in loader:
        break
    assert ak._state.training.active_loaders == []
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


def test_without_a_transfer_cpu_batches_are_not_copied() -> None:
    items = [torch.full((2,), float(i)) for i in range(3)]
    loader = ak.prepare(DataLoader(items, batch_size=None))  # batches are the samples themselves
    assert all(batch is item for batch, item in zip(loader, items, strict=True))


def gathered(moved: bool) -> tuple[list[int], list[bool]]:
    """Every rank's gather_for_metrics of 11 samples in batches of 3 (the last padded), and the last-batch flags."""
    values: list[int] = []
    last: list[bool] = []
    with moving_batches() if moved else _nothing():
        loader = ak.prepare(DataLoader(range(11), batch_size=3))
    model = torch.nn.Linear(1, 1)
    for batch in loader:
        with ak.accumulate(model, steps=10):
            last.append(ak.sync_gradients())
        values += ak.gather_for_metrics(batch).tolist()
    return values, last


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.distributed
def test_gather_for_metrics_drops_the_padding_of_batches_read_ahead(pool: WorkerPool) -> None:
    moved, plain = pool.run(gathered, True), pool.run(gathered, False)
    assert moved == plain
    values, last = moved[0]
    assert sorted(values) == list(range(11)) and last == [False, True]


# --- pinning: beside the step, never on the iterating thread, never twice -----------------------------
# The CUDA backend's transfer as a real object: deciding how a loader pins, and handing a batch to its
# thread, needs no device (its copies do: tests/test_gpu.py runs them).


@contextmanager
def copies_to_cuda() -> Iterator[CUDATransfer]:
    """Prepared loaders made inside get the CUDA backend's transfer to cuda:0 (made, not iterated, here)."""
    transfer = CUDABackend(shared=True).batch_transfer(torch.device("cuda", 0))
    original = CPUBackend.batch_transfer
    CPUBackend.batch_transfer = lambda self, device: transfer  # type: ignore[assignment,method-assign]
    try:
        yield transfer
    finally:
        CPUBackend.batch_transfer = original  # type: ignore[method-assign]


def prepared_pin_memory(moved_by: str, **options: Any) -> tuple[bool, str]:
    """The prepared loader's pin_memory and pin_memory_device, for a DataLoader(range(8), **options)."""
    ak.reset_state()
    if moved_by == "cuda":
        with copies_to_cuda():
            loader = ak.prepare(DataLoader(range(8), batch_size=2, **options))
    elif moved_by == "plain copies":
        with moving_batches():
            loader = ak.prepare(DataLoader(range(8), batch_size=2, **options))
    else:
        loader = ak.prepare(DataLoader(range(8), batch_size=2, **options))
    return loader.pin_memory, loader.pin_memory_device


def test_a_loader_with_workers_pins_in_its_pin_memory_thread_where_the_copies_want_pinned_batches() -> None:
    assert prepared_pin_memory("cuda", num_workers=2) == (True, "")
    assert prepared_pin_memory("cuda", num_workers=2, persistent_workers=True) == (True, "")
    # Without workers DataLoader would pin in next(), on the thread that iterates: the transfer pins instead.
    assert prepared_pin_memory("cuda") == (False, "")
    # No device copies (the CPU) or plain ones: nothing to pin for.
    assert prepared_pin_memory("none", num_workers=2) == (False, "")
    assert prepared_pin_memory("plain copies", num_workers=2) == (False, "")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_users_pin_memory_is_kept_as_it_is(num_workers: int) -> None:
    for moved_by in ("cuda", "none"):
        assert prepared_pin_memory(moved_by, num_workers=num_workers, pin_memory=True) == (True, "")


class Pinned(Exception):
    """Raised where a tensor would be pinned: this machine has no accelerator to pin for."""


@contextmanager
def pins_recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads that pin a tensor; each pin raises :class:`Pinned`. A thread that selects
    a CUDA device first (as the transfer's thread selects its own) is recorded as ``"<name> on <device>"``."""
    threads: list[str] = []

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        raise Pinned

    def set_device(device: torch.device) -> None:
        threads.append(f"{threading.current_thread().name} on {device}")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "pin_memory", pin_memory)
        patch.setattr(torch.cuda, "set_device", set_device)
        yield threads


def pin_threads_ended() -> None:
    """Every transfer is gone: its thread ends with it (the hygiene fixture fails on a thread left running)."""
    gc.collect()
    for thread in threading.enumerate():
        if thread.name.startswith("accelkit-pin"):
            thread.join(timeout=10)
            assert not thread.is_alive()


def test_a_batch_to_pin_is_pinned_on_the_transfers_thread_and_its_error_comes_with_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer = CUDABackend(shared=True).batch_transfer(torch.device("cuda", 0))
    with pins_recorded(monkeypatch) as threads:
        handle = transfer.start({"x": torch.ones(3), "label": "a string rides along"})  # returns at once
        with pytest.raises(Pinned):
            transfer.finish(handle)
    assert threads == ["accelkit-pin_0 on cuda:0", "accelkit-pin_0"]  # its device selected first, then pinned
    del transfer, handle
    pin_threads_ended()


@pytest.mark.parametrize("kind", ["tensors", "dicts", "stream"])
def test_nothing_pins_on_the_thread_that_iterates_a_prepared_loader(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make = {
        "tensors": lambda: DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2),
        "dicts": loaders()["dicts"],
        "stream": loaders()["stream"],
    }[kind]
    with copies_to_cuda():
        loader = ak.prepare(make())
    with pins_recorded(monkeypatch) as threads, pytest.raises(Pinned):
        next(iter(loader))
    assert threads and threading.current_thread().name not in threads, threads
    assert threads == ["accelkit-pin_0 on cuda:0", "accelkit-pin_0"]
    del loader
    pin_threads_ended()
