"""Prepared DataLoaders: shards against the single-process reference (batch B * world),
padding and gather_for_metrics totals, seeds and epochs, resuming, iterable datasets and
batch samplers, on one process and on two gloo processes."""

from __future__ import annotations

import dataclasses
import gc
import threading
import warnings
from collections import namedtuple
from itertools import cycle, islice
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

import accelkit as ak
from accelkit import _state
from accelkit._data import prepare_dataloader
from accelkit.testing import WorkerPool, run_distributed

PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
WORLD = 2
SIZES = [(n, b) for n in (1, 7, 16, 17, 33) for b in (1, 4, 8)]
Pair = namedtuple("Pair", ["left", "right"])


class Stream(IterableDataset[int]):
    """0, 1, ..., n - 1 as a stream (with a length, as many streams have)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Counting(Dataset[int]):
    """range(n) that counts the samples it loads."""

    def __init__(self, n: int) -> None:
        self.n, self.loads = n, 0

    def __getitem__(self, i: int) -> int:
        self.loads += 1
        return i

    def __len__(self) -> int:
        return self.n


def _reference(n: int, b: int, world: int, even: bool, drop_last: bool) -> list[list[list[int]]]:
    """Each rank's batches, cut from a plain single-process DataLoader with batch b * world."""
    per_rank: list[list[list[int]]] = [[] for _ in range(world)]
    for big in DataLoader(range(n), batch_size=b * world, drop_last=drop_last):
        rows = big.tolist()
        if even and world > 1 and len(rows) < b * world:
            rows += list(islice(cycle(range(n)), b * world - len(rows)))  # wrap around to the start
        for r in range(world):
            if rows[r * b : (r + 1) * b]:
                per_rank[r].append(rows[r * b : (r + 1) * b])
    return per_rank


def _expected_padding(n: int, b: int, world: int, even: bool, drop_last: bool) -> int:
    rest = n % (b * world)
    return b * world - rest if even and world > 1 and rest and not drop_last else 0


def _epoch(loader: Any) -> tuple[list[Any], list[tuple[bool, int]]]:
    """One epoch's batches, and (at_last_batch, padding) of the active-loader entry at each."""
    batches, flags = [], []
    for batch in loader:
        entry = _state.training.active_loaders[-1]
        batches.append(batch.tolist())
        flags.append((entry.at_last_batch, entry.padding))
    assert not _state.training.active_loaders
    return batches, flags


def _shards(even: bool, drop_last: bool, iterable: bool, num_workers: int = 0) -> dict[Any, Any]:
    out = {}
    for n, b in SIZES:
        data = Stream(n) if iterable else range(n)
        plain = DataLoader(data, batch_size=b, drop_last=drop_last, num_workers=num_workers)
        loader = ak.prepare(plain, even_batches=even)
        out[n, b] = (*_epoch(loader), len(loader))
    return out


# --- two processes ----------------------------------------------------------------------


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
@pytest.mark.parametrize(("even", "drop_last"), [(True, False), (False, False), (True, True), (False, True)])
def test_shards_match_the_single_process_reference(
    pool: WorkerPool, even: bool, drop_last: bool, iterable: bool
) -> None:
    results = pool.run(_shards, even, drop_last, iterable)
    for n, b in SIZES:
        expected = _reference(n, b, WORLD, even, drop_last)
        padding = _expected_padding(n, b, WORLD, even, drop_last)
        for rank, per_rank in enumerate(results):
            batches, flags, length = per_rank[n, b]
            case = f"N={n} B={b} rank={rank}"
            assert batches == expected[rank], case
            assert length == len(batches), case
            assert flags == [(i == len(batches) - 1, padding if i == len(batches) - 1 else 0)
                             for i in range(len(batches))], case  # fmt: skip


def _iterable_workers_warning() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ak.prepare(DataLoader(Stream(4), batch_size=2, num_workers=1))
    return [str(w.message) for w in caught]


def test_iterable_datasets_in_workers_warn_that_padding_is_per_worker(pool: WorkerPool) -> None:
    for messages in pool.run(_iterable_workers_warning):
        assert any("gather_for_metrics cannot drop the padding" in m for m in messages), messages


def _gathered(n: int, b: int, even: bool, drop_last: bool, shuffle: bool, objects: bool) -> list[int]:
    g = torch.Generator().manual_seed(11)  # with a generator, the order is the same on any number of processes
    loader = DataLoader(range(n), batch_size=b, shuffle=shuffle, drop_last=drop_last, generator=g)
    loader = ak.prepare(loader, even_batches=even)
    seen: list[int] = []
    for batch in loader:
        if objects:
            seen += ak.gather_for_metrics(batch.tolist(), use_gather_object=True)
        else:
            seen += ak.gather_for_metrics({"x": batch})["x"].tolist()
    return seen


def _single_process_stream(n: int, b: int, shuffle: bool, drop_last: bool) -> list[int]:
    """What one process with batch b * 2 sees in its first epoch (same generator as _gathered)."""
    g = torch.Generator().manual_seed(11)
    loader = ak.prepare(DataLoader(range(n), batch_size=b * WORLD, shuffle=shuffle, drop_last=drop_last, generator=g))
    return [i for batch in loader for i in batch.tolist()]


@PROPERTY
@given(
    n=st.integers(1, 40),
    b=st.integers(1, 6),
    even=st.booleans(),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    objects=st.booleans(),
)
def test_gather_for_metrics_sees_each_sample_once_in_reference_order(
    pool: WorkerPool, n: int, b: int, even: bool, drop_last: bool, shuffle: bool, objects: bool
) -> None:
    rest = n % (b * WORLD)
    # An uneven last round that leaves rank 1 without a batch gives it one step fewer; a
    # collective in that step would wait forever (documented), so that case is not gathered.
    assume(even or drop_last or rest == 0 or rest > b)
    r0, r1 = pool.run(_gathered, n, b, even, drop_last, shuffle, objects)
    assert r0 == r1
    assert r0 == _single_process_stream(n, b, shuffle, drop_last)
    assert len(r0) == (n - rest if drop_last else n)


def _break_then_other() -> dict[str, Any]:
    a = ak.prepare(DataLoader(range(7), batch_size=2))  # global batches [0..3], [4, 5, 6, +0]: padding 1
    b = ak.prepare(DataLoader(range(5), batch_size=2))  # [0..3], [4, +0, +1, +2]: padding 3
    out: dict[str, Any] = {}
    for i, batch in enumerate(a):
        if i == 1:
            out["a_last"] = ak.gather_for_metrics(batch).tolist()
            break
    mine = torch.full((2,), ak.rank())  # as long as a's global batch: trimmed if a still counted
    out["after_break"] = ak.gather_for_metrics(mine).tolist()
    with pytest.raises(KeyError):
        for i, _ in enumerate(a):
            if i == 1:
                raise KeyError("boom")
    out["after_raise"] = ak.gather_for_metrics(mine).tolist()
    outer, inner = [], []
    for batch in b:
        for small in a:
            inner += ak.gather_for_metrics(small).tolist()
        outer += ak.gather_for_metrics(batch).tolist()
    out["outer"], out["inner"], out["left"] = outer, inner, len(_state.training.active_loaders)
    return out


@pytest.mark.smoke
def test_padding_bookkeeping_survives_break_raise_and_nesting(pool: WorkerPool) -> None:
    for out in pool.run(_break_then_other):
        assert out["a_last"] == [4, 5, 6]
        assert out["after_break"] == [0, 0, 1, 1]
        assert out["after_raise"] == [0, 0, 1, 1]
        assert out["outer"] == list(range(5))
        assert out["inner"] == list(range(7)) * 2
        assert out["left"] == 0


def _epochs(n: int, b: int, seed: int) -> tuple[list[list[list[int]]], float]:
    ak.set_seed(seed)
    loader = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(seed)))
    epochs = [[batch.tolist() for batch in loader] for _ in range(3)]
    return epochs, torch.rand(()).item()


def test_shuffled_epochs_with_a_generator_equal_the_single_process_run(pool: WorkerPool) -> None:
    (e0, rand0), (e1, rand1) = pool.run(_epochs, 12, 3, 5)
    ak.set_seed(5)
    reference = ak.prepare(
        DataLoader(range(12), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5))
    )
    for epoch in range(3):
        expected = [batch.tolist() for batch in reference]
        assert [x + y for x, y in zip(e0[epoch], e1[epoch], strict=True)] == expected, f"epoch {epoch}"
    assert e0[0] != e0[1] != e0[2]  # a new order every epoch, without set_epoch
    # The global RNG advanced alike on every rank and in the single-process run (not at all: the
    # base seeds come from the loader's generator, as the plain loader draws them).
    assert rand0 == rand1 == torch.rand(()).item()
    (other, _), _ = pool.run(_epochs, 12, 3, 6)
    assert other[0] != e0[0]


def _global_draws() -> list[bool]:
    """After each step of a script, whether the global RNG stands where Accelerate's prepared loaders leave it."""
    ak.set_seed(3 + ak.rank())  # the ranks' streams differ: each draws from its own, the orders agree
    reference = torch.Generator().manual_seed(3 + ak.rank())

    def drawn(k: int) -> bool:  # the reference advanced by k int64 draws, compared with the global RNG
        for _ in range(k):
            torch.empty((), dtype=torch.int64).random_(generator=reference)
        return torch.equal(torch.get_rng_state(), reference.get_state())

    ds = range(12)
    g = torch.Generator().manual_seed(0)
    with_g, evaluation = ak.prepare(DataLoader(ds, batch_size=2, shuffle=True, generator=g), DataLoader(ds))
    checks = [drawn(0)]  # nothing at prepare for a generator or no shuffle
    shuffled = ak.prepare(DataLoader(ds, batch_size=2, shuffle=True))
    checks.append(drawn(1))  # the order's seed, once (rank 0's used at each epoch)
    for loader, draws in ((shuffled, 1), (evaluation, 1), (with_g, 0)) * 2:  # the base seed, at each start
        mine = [i for x in loader for i in x.tolist()]
        checks.append(
            drawn(draws) and sorted(i for part in ak.gather_object(mine) for i in part) == list(ds)
        )  # one order
    return checks


def test_several_processes_draw_from_the_global_rng_as_accelerates_loaders(pool: WorkerPool) -> None:
    for checks in pool.run(_global_draws):
        assert checks == [True] * 8, checks


def _resume(n: int, b: int, skip: int, stop: int) -> dict[str, Any]:
    ak.set_seed(3)
    full_loader = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True))
    full = [[x.tolist() for x in full_loader] for _ in range(2)]
    ak.set_seed(3)
    loader = ak.prepare(DataLoader(Counting(n), batch_size=b, shuffle=True))
    loader.dataset.loads = 0
    skipped = [x.tolist() for x in ak.skip_first_batches(loader, skip)]
    loads = loader.dataset.loads
    after = [x.tolist() for x in loader]
    # Interrupted after `stop` batches of epoch 0, resumed by a loader with another seed.
    ak.set_seed(3)
    first = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True))
    for i, _ in enumerate(first):
        if i + 1 == stop:
            saved = first.state_dict()
            break
    ak.set_seed(99)
    second = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True))
    second.load_state_dict(saved)
    resumed = [[x.tolist() for x in second] for _ in range(2)]
    return {"full": full, "skipped": skipped, "loads": loads, "after": after, "resumed": resumed}


def test_skip_first_batches_and_state_dict_resume_exactly(pool: WorkerPool) -> None:
    for out in pool.run(_resume, 21, 2, 3, 2):
        full = out["full"]
        assert out["skipped"] == full[0][3:]
        assert out["loads"] == sum(len(x) for x in full[0][3:])  # skipped samples were never loaded
        assert out["after"] == full[1]
        assert out["resumed"] == [full[0][2:], full[1]]


def _batch_sampler(even: bool) -> tuple[list[list[int]], list[int] | None]:
    groups = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]
    loader = ak.prepare(DataLoader(range(11), batch_sampler=groups), even_batches=even)
    batches = [x.tolist() for x in loader]
    if not even:
        return batches, None
    return batches, [i for x in loader for i in ak.gather_for_metrics(x).tolist()]


def test_batch_samplers_are_sharded_by_whole_batches(pool: WorkerPool) -> None:
    (b0, seen0), (b1, seen1) = pool.run(_batch_sampler, True)
    assert b0 == [[0, 1, 2], [4, 5], [10]]
    assert b1 == [[3], [6, 7, 8, 9], [0, 1, 2]]  # the last round completed with the first batch
    assert seen0 == seen1 == list(range(11))  # ragged batches gathered whole, padding dropped
    (b0, _), (b1, _) = pool.run(_batch_sampler, False)
    assert (b0, b1) == ([[0, 1, 2], [4, 5], [10]], [[3], [6, 7, 8, 9]])


def _plain_shuffled(seed: int, n: int, b: int, epochs: int = 3) -> tuple[list[list[list[int]]], torch.Tensor]:
    """The epochs of a plain shuffled loader with a generator seeded ``seed``, and the generator's state after."""
    g = torch.Generator().manual_seed(seed)
    plain = DataLoader(range(n), batch_size=b, shuffle=True, generator=g)
    return [[x.tolist() for x in plain] for _ in range(epochs)], g.get_state()


def _reseeded_after_prepare(n: int, b: int) -> tuple[list[list[list[int]]], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + ak.rank())  # any state at prepare time
    loader = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True, generator=g))
    g.manual_seed(42 + ak.rank())  # rank 0's generator is the one every rank follows
    return [[x.tolist() for x in loader] for _ in range(3)], g.get_state()


def test_the_order_follows_the_users_generator_reseeded_after_prepare(pool: WorkerPool) -> None:
    (e0, state0), (e1, state1) = pool.run(_reseeded_after_prepare, 12, 3)
    expected, state = _plain_shuffled(42, 12, 6)
    for epoch in range(3):
        assert [x + y for x, y in zip(e0[epoch], e1[epoch], strict=True)] == expected[epoch], f"epoch {epoch}"
    # Every rank's generator advanced as the plain loader's did (rank 1's took rank 0's state).
    assert torch.equal(state0, state) and torch.equal(state1, state)


def _resume_live(tmp: str, n: int, b: int, stop: int) -> dict[str, Any]:
    """Two epochs of a loader re-seeded after prepare; the same interrupted by save_state after ``stop``
    batches of epoch 0 and resumed by load_state in a loader whose generator has another seed."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    loader = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True, generator=g))
    g.manual_seed(42)
    whole = [[x.tolist() for x in loader] for _ in range(2)]
    whole_state = g.get_state()
    ak.reset_state()
    g = torch.Generator().manual_seed(1)
    first = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True, generator=g))
    g.manual_seed(42)
    for i, _ in enumerate(first):
        if i + 1 == stop:
            ak.save_state(tmp, step=i + 1)
            break
    ak.reset_state()
    g = torch.Generator().manual_seed(99)
    second = ak.prepare(DataLoader(range(n), batch_size=b, shuffle=True, generator=g))
    ak.load_state(tmp)
    resumed = [[x.tolist() for x in second] for _ in range(2)]
    return {"whole": whole, "resumed": resumed, "same_state": torch.equal(g.get_state(), whole_state)}


@pytest.mark.distributed
def test_a_followed_generator_resumes_mid_epoch_exactly(tmp_path: Any) -> None:
    # Fresh workers: the task resets the state twice, forming the group again on the same port, which a
    # session's pool may still hold through an earlier task's objects.
    for out in run_distributed(_resume_live, (str(tmp_path / "ckpt"), 21, 2, 2), num_processes=2):
        whole = out["whole"]
        assert whole[0] != whole[1]
        assert out["resumed"] == [whole[0][2:], whole[1]]
        assert out["same_state"], "the resumed generator ends where the uninterrupted one did"


# --- one process --------------------------------------------------------------------------


def test_prepared_loader_is_a_dataloader_with_the_same_settings() -> None:
    def collate(batch: list[int]) -> torch.Tensor:
        return torch.tensor(batch) * 10

    def init(worker_id: int) -> None:
        pass

    plain = DataLoader(range(10), batch_size=4, collate_fn=collate, drop_last=True, worker_init_fn=init)
    loader = prepare_dataloader(plain)
    assert isinstance(loader, DataLoader)
    assert (loader.batch_size, loader.drop_last, loader.num_workers, loader.pin_memory) == (4, True, 0, False)
    assert loader.collate_fn is collate and loader.worker_init_fn is init
    assert len(loader) == 2
    assert [x.tolist() for x in loader] == [[0, 10, 20, 30], [40, 50, 60, 70]]
    assert prepare_dataloader(loader) is loader
    assert ak.prepare(loader) is loader


@pytest.mark.parametrize("make", [
    lambda: DataLoader(range(10), batch_size=3),
    lambda: DataLoader(range(5), batch_size=None),
    lambda: DataLoader(Stream(10), batch_size=4),
    lambda: DataLoader(range(6), batch_sampler=[[5, 4], [3], [2, 1, 0]]),
], ids=["batched", "unbatched", "iterable", "batch_sampler"])  # fmt: skip
def test_one_process_yields_what_the_plain_loader_yields(make: Any) -> None:
    def listed(loader: Any) -> list[Any]:
        return [x.tolist() if isinstance(x, torch.Tensor) else x for x in loader]

    loader = prepare_dataloader(make())
    assert listed(loader) == listed(make()) == listed(loader)
    assert len(loader) == len(make())


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_dataloader_workers_mark_the_last_batch(iterable: bool) -> None:
    # Workers run ahead of the loop (map-style: the sampler in this process; iterable: in
    # the workers, so the loader reads one batch ahead): the flags still follow the loop.
    for n, b in [(7, 4), (8, 4), (1, 2)]:
        data = Stream(n) if iterable else range(n)
        loader = prepare_dataloader(DataLoader(data, batch_size=b, num_workers=1, shuffle=not iterable))
        batches, flags = _epoch(loader)
        assert sorted(i for x in batches for i in x) == list(range(n))
        assert flags == [(i == len(batches) - 1, 0) for i in range(len(batches))]
    # torch closes its worker queues without waiting for their feeder threads to end.
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join(timeout=10)


def test_skipping_a_stream_reads_past_the_skipped_batches() -> None:
    loader = prepare_dataloader(DataLoader(Stream(10), batch_size=3))
    assert [x.tolist() for x in ak.skip_first_batches(loader, 2)] == [[6, 7, 8], [9]]
    assert [x.tolist() for x in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(range(20), batch_size=4, shuffle=True),
        lambda: DataLoader(range(20), batch_size=3),
        lambda: DataLoader(range(20), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)),
        lambda: DataLoader(Stream(9), batch_size=2),
    ],
    ids=["shuffled", "sequential", "generator", "iterable"],
)
def test_one_process_draws_from_the_global_rng_as_the_plain_loader(make: Any) -> None:
    def run(loader: Any) -> list[Any]:
        seen = []
        for _ in range(3):
            seen.append([x.tolist() for x in loader])
            seen.append(torch.rand(2).tolist())  # the stream user code (dropout, augmentations) sees after it
        return seen

    ak.set_seed(0)
    plain = run(make())
    ak.set_seed(0)
    assert run(prepare_dataloader(make())) == plain  # the same batches, and the same numbers after them


class Noisy(Dataset[torch.Tensor]):
    """Samples drawn from the RNG of the process that loads them (a DataLoader worker's, seeded by the loader)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(())


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_one_process_seeds_its_workers_as_the_plain_loader(persistent: bool) -> None:
    def run(loader: Any) -> list[Any]:
        return [[x.tolist() for x in loader] for _ in range(2)] + [torch.rand(2).tolist()]

    def make() -> DataLoader[Any]:
        return DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2, persistent_workers=persistent)

    threads = set(threading.enumerate())
    ak.set_seed(0)
    loader = make()
    plain = run(loader)
    ak.set_seed(0)
    prepared = prepare_dataloader(make())
    assert run(prepared) == plain
    del loader, prepared  # persistent workers end with their loader: now, not at some later collection
    gc.collect()
    for thread in set(threading.enumerate()) - threads:  # the workers' queues' feeder threads end just after them
        thread.join(timeout=30)


def _loaded_in_workers() -> tuple[list[float], list[float]]:
    ak.set_seed(0)
    mine = [v for x in ak.prepare(DataLoader(Noisy(), batch_size=2, num_workers=1)) for v in x.tolist()]
    ak.set_seed(0)
    plain = [v for x in DataLoader(Noisy(), batch_size=2, num_workers=1) for v in x.tolist()]
    return mine, plain


def test_each_rank_seeds_workers_of_its_own() -> None:
    (zero, plain), (one, _) = run_distributed(_loaded_in_workers)  # the pool's workers cannot start processes
    assert zero == plain[: len(zero)]  # rank 0's workers: the plain loader's seeds
    assert len(one) == len(zero) == 4 and not set(one) & set(zero)  # rank 1's: a stream of their own


def test_a_resumed_epoch_draws_nothing_again() -> None:
    ak.set_seed(0)
    loader = prepare_dataloader(DataLoader(range(20), batch_size=4, shuffle=True))
    whole = [[x.tolist() for x in loader] for _ in range(2)] + [torch.rand(2).tolist()]
    ak.set_seed(0)
    loader = prepare_dataloader(DataLoader(range(20), batch_size=4, shuffle=True))
    seen = []
    for x in loader:  # interrupted after 2 batches; the checkpoint holds the loader and the global RNG
        seen.append(x.tolist())
        if len(seen) == 2:
            state, rng = loader.state_dict(), torch.get_rng_state()
            break
    ak.set_seed(5)
    resumed = prepare_dataloader(DataLoader(range(20), batch_size=4, shuffle=True))
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # saved again before it runs: the same
    torch.set_rng_state(rng)
    rest = [[x.tolist() for x in resumed] for _ in range(2)] + [torch.rand(2).tolist()]
    assert [seen + rest[0], *rest[1:]] == whole


def test_a_user_generator_seeds_the_order() -> None:
    def order(seed: int) -> list[int]:
        sampler = torch.utils.data.RandomSampler(range(10), generator=torch.Generator().manual_seed(seed))
        loader = prepare_dataloader(DataLoader(range(10), batch_size=5, sampler=sampler))
        return [i for x in loader for i in x.tolist()]

    assert order(1) == order(1) != order(2)
    assert sorted(order(1)) == list(range(10))


@pytest.mark.parametrize("on_sampler", [False, True], ids=["loader-generator", "sampler-generator"])
def test_a_reseed_after_prepare_counts_from_the_next_epoch(on_sampler: bool) -> None:
    def make(g: torch.Generator) -> DataLoader[Any]:
        if on_sampler:
            return DataLoader(range(10), batch_size=3, sampler=torch.utils.data.RandomSampler(range(10), generator=g))
        return DataLoader(range(10), batch_size=3, shuffle=True, generator=g)

    g, plain_g = torch.Generator().manual_seed(1), torch.Generator()
    loader, plain = prepare_dataloader(make(g)), make(plain_g)
    for seed in (42, None, 7, None):  # re-seeded before the first and third epochs, as the plain loader's
        if seed is not None:
            g.manual_seed(seed)
            plain_g.manual_seed(seed)
        assert [x.tolist() for x in loader] == [x.tolist() for x in plain]
        assert torch.equal(g.get_state(), plain_g.get_state())  # advanced as the plain loader advances it


def test_active_loader_entries_come_and_go() -> None:
    loader = prepare_dataloader(DataLoader(range(5), batch_size=2))
    assert _epoch(loader)[1] == [(False, 0), (False, 0), (True, 0)]
    active = _state.training.active_loaders
    for _ in loader:
        break
    assert active == []
    it = iter(loader)
    next(it)
    other = prepare_dataloader(DataLoader(range(3), batch_size=3))
    for _ in other:
        assert len(active) == 2 and active[-1].at_last_batch and not active[0].at_last_batch
    assert len(active) == 1
    del it
    assert active == []


def test_batches_are_moved_to_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = dataclasses.replace(ak.state(), device=torch.device("meta"))
    monkeypatch.setattr(_state, "get", lambda: meta)
    samples = [{"x": torch.ones(2), "pair": Pair(torch.zeros(1), "tag"), "ids": [torch.tensor(i)]} for i in range(3)]
    loader = prepare_dataloader(DataLoader(samples, batch_size=3))
    (batch,) = list(loader)
    assert batch["x"].device.type == batch["pair"].left.device.type == batch["ids"][0].device.type == "meta"
    assert isinstance(batch["pair"], Pair) and batch["pair"].right == ("tag",) * 3


def test_gather_for_metrics_on_one_process_returns_the_input() -> None:
    data = {"x": torch.arange(3)}
    assert ak.gather_for_metrics(data) is data
    assert ak.gather_for_metrics(["a"], use_gather_object=True) == ["a"]


def test_bad_input_raises_with_the_value_and_a_fix() -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.utils\.data\.DataLoader, got list"):
        prepare_dataloader([1, 2, 3])  # type: ignore[arg-type]
    loader = prepare_dataloader(DataLoader(range(4)))
    with pytest.raises(ValueError, match=r"num_batches=-1\).*0 or more"):
        ak.skip_first_batches(loader, -1)
    with pytest.raises(TypeError, match=r"returned by ak\.prepare.*loader = ak\.prepare\(loader\)"):
        ak.skip_first_batches(DataLoader(range(4)), 1)
    sampler = DistributedSampler(range(4), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="DistributedSampler"):
        prepare_dataloader(DataLoader(range(4), sampler=sampler))
    with pytest.raises(ValueError, match="batches_yielded"):
        loader.load_state_dict({"epoch": 0})  # type: ignore[arg-type]
