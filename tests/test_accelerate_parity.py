"""Behaviours ported from Accelerate's own test scripts (test_ops, test_sync, test_distributed_data_loop,
test_memory_utils, test_logging, test_utils), where a migrating user expects the same result.

Each bug found by running those scripts against accelkit has a regression test here; each difference
either aligned with Accelerate is tested here, or documented in the README with its fix.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

import accelkit as ak
from accelkit.testing import WorkerPool, run_distributed

# --- collectives of tensors that require grad (bug 1) -------------------------------------------


def collectives_of_a_loss() -> list[list[float]]:
    out = []
    for _ in range(20):
        loss = nn.Linear(3, 1)(torch.ones(4, 3) * (ak.rank() + 1)).pow(2).mean()  # requires grad
        gathered, summed = ak.gather(loss), ak.reduce(loss, op="sum")
        sent = ak.broadcast(loss, src=1)
        tree = ak.gather({"loss": loss, "logits": loss.expand(2)})
        assert not gathered.requires_grad and loss.requires_grad  # new tensors; the input keeps its graph
        out.append([*gathered.tolist(), summed.item(), sent.item(), *tree["logits"].tolist()])
    return out


def test_collectives_take_tensors_that_require_grad(pool: WorkerPool) -> None:
    zero, one = pool.run(collectives_of_a_loss)
    assert zero == one and len(zero) == 20
    for row in zero:
        assert row[2] == pytest.approx(row[0] + row[1]) and row[3] == row[1]  # sum; rank 1's broadcast


# --- a BatchSampler passed as the sampler (bug 2) -----------------------------------------------


def batch_sampler_as_sampler(n: int, shuffle: bool) -> tuple[list[list[int]], list[int]]:
    ak.set_seed(ak.rank())  # different seeds on the ranks: the shuffle must still agree
    ds = TensorDataset(torch.arange(n))
    inner = RandomSampler(ds) if shuffle else SequentialSampler(ds)
    loader = ak.prepare(DataLoader(ds, sampler=BatchSampler(inner, 4, drop_last=False), batch_size=None))
    mine, seen = [], []
    for (x,) in loader:
        mine.append(x.tolist())
        seen.extend(ak.gather_for_metrics(x).tolist())
    return mine, seen


def test_a_batch_sampler_passed_as_sampler_is_sharded_by_batches(pool: WorkerPool) -> None:
    (zero, seen), (one, _) = pool.run(batch_sampler_as_sampler, 10, False)
    assert zero == [[0, 1, 2, 3], [8, 9]] and one == [[4, 5, 6, 7], [0, 1, 2, 3]]  # the last round is padded
    assert seen == list(range(10))  # gather_for_metrics drops the padding, in samples


def test_a_shuffled_batch_sampler_as_sampler_agrees_across_ranks(pool: WorkerPool) -> None:
    (_, seen_0), (_, seen_1) = pool.run(batch_sampler_as_sampler, 22, True)
    assert sorted(seen_0) == list(range(22)) and seen_1 == seen_0  # every sample once, whatever the seeds


# --- unwrap under mixed precision (bug 3) -------------------------------------------------------


def test_unwrap_returns_the_untouched_module_and_the_prepared_one_copies_and_pickles() -> None:
    ak.init(precision="bf16")
    m = nn.Linear(2, 1)
    prepared = ak.prepare(m)
    u = ak.unwrap(prepared)
    assert u is m and "forward" not in vars(u)
    x = torch.ones(3, 2)
    assert u(x).dtype == torch.float32 and prepared(x).dtype == torch.float32
    pickle.dumps(u)
    torch.save(u, io.BytesIO())
    c = copy.deepcopy(prepared)
    with torch.no_grad():
        c.weight.zero_()
        c.bias.zero_()
    assert c(x).abs().sum().item() == 0  # the copy computes with its own weights
    assert prepared(x).abs().sum().item() != 0
    restored = pickle.loads(pickle.dumps(prepared))
    assert torch.equal(restored(x), prepared(x))
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), prepared(x))
    kept = ak.unwrap(prepared, keep_precision=True)
    assert kept is prepared and list(kept.state_dict()) == ["weight", "bias"]


def unwrap_under_ddp() -> list[Any]:
    ak.init(precision="bf16")
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    prepared = ak.prepare(m)
    kept = ak.unwrap(prepared, keep_precision=True)
    return [
        ak.unwrap(prepared) is m,
        "forward" in vars(m),
        type(kept).__name__,
        kept.forward_module is m,
        kept(torch.ones(1, 2)).dtype,
        prepared.module[0] is m[0],  # DDP's .module, through the precision wrapper
        sorted(prepared.state_dict()) == sorted(f"module.{k}" for k in m.state_dict()),
    ]


def test_unwrap_under_ddp_and_mixed_precision(pool: WorkerPool) -> None:
    for result in pool.run(unwrap_under_ddp):
        assert result == [True, False, "MixedPrecisionModule", True, torch.float32, True, True]


# --- reset_state, then a new group, in launched workers (bug 4) ---------------------------------


def ten_rounds_of_reset() -> list[float]:
    totals = []
    for _ in range(10):
        totals.append(ak.gather(torch.ones(1) * (ak.rank() + 1)).sum().item())
        ak.reset_state()
    return totals


def test_reset_state_then_a_new_group_ten_times() -> None:
    assert run_distributed(ten_rounds_of_reset, task_timeout=90) == [[3.0] * 10, [3.0] * 10]


# --- differences aligned with Accelerate ---------------------------------------------------------


def test_an_allocator_message_without_cuda_is_retried_like_accelerate() -> None:
    tried = []

    @ak.find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 2:
            raise RuntimeError("CPU out of memory.")  # how Accelerate's own tests fake an OOM
        return batch_size

    assert train() == 2 and tried == [8, 4, 2]


def test_a_zero_starting_batch_size_fails_at_the_call_like_accelerate() -> None:
    @ak.find_executable_batch_size(starting_batch_size=0)  # no error here
    def train(batch_size: int) -> None:
        raise AssertionError("never called")

    with pytest.raises(ak.NoExecutableBatchSizeError, match=r"no executable batch size found.*starting_batch_size=0"):
        train()


def pad_a_mixed_tree() -> dict[str, list[int]]:
    tree = {"cube": torch.zeros(2, 2, 1 + ak.rank()), "vector": torch.ones(1 + ak.rank()), "scalar": torch.tensor(1)}
    out = ak.pad_across_processes(tree, dim=-4)  # no tensor has a dim -4: all come back unchanged
    assert all(torch.equal(out[k], tree[k]) and out[k] is not tree[k] for k in tree)
    padded = ak.pad_across_processes(tree, dim=2)  # only the cube has a dim 2
    return {k: list(v.shape) for k, v in padded.items()}


def test_pad_leaves_tensors_without_the_dim_unchanged(pool: WorkerPool) -> None:
    zero, one = pool.run(pad_a_mixed_tree)
    assert zero == {"cube": [2, 2, 2], "vector": [1], "scalar": []} and one == {**zero, "vector": [2]}


def _log_through_a_helper(logger: Any) -> None:
    logger.info("from the helper", stacklevel=3)  # as Accelerate counts: 3 names the helper's caller


def test_a_stacklevel_counts_frames_like_accelerate(caplog: pytest.LogCaptureFixture) -> None:
    logger = ak.get_logger("accelkit.tests.parity", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="accelkit.tests.parity"):
        _log_through_a_helper(logger)  # the line the record must name
        logger.info("direct")
    helper, direct = caplog.records
    assert (helper.filename, helper.funcName) == (
        Path(__file__).name,
        "test_a_stacklevel_counts_frames_like_accelerate",
    )
    assert (direct.filename, direct.funcName) == (
        Path(__file__).name,
        "test_a_stacklevel_counts_frames_like_accelerate",
    )


def _epochs(loader: DataLoader[Any], epochs: int = 3) -> list[list[int]]:
    return [[int(i) for batch in loader for i in batch[0]] for _ in range(epochs)]


def test_one_process_sees_the_batches_of_the_plain_loader_with_the_same_generator() -> None:
    ds = TensorDataset(torch.arange(23))
    plain = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    prepared = ak.prepare(DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)))
    assert _epochs(prepared) == _epochs(plain)
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(9))  # a generator on the sampler only
    plain = DataLoader(ds, batch_size=5, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(9)))
    assert _epochs(ak.prepare(DataLoader(ds, batch_size=5, sampler=sampler))) == _epochs(plain)


def resume_a_followed_order(stop: int) -> tuple[list[int], list[int]]:
    """Two epochs from a loader whose order follows the user's generator, interrupted and resumed."""
    ds = TensorDataset(torch.arange(16))

    def make() -> Any:
        return ak.prepare(DataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)))

    uninterrupted = make()
    whole = [int(i) for _ in range(2) for (x,) in uninterrupted for i in x]
    assert whole[:16] != whole[16:]  # a new order each epoch
    loader, seen, n = make(), [], 0
    for (x,) in loader:
        seen.extend(int(i) for i in x)
        n += 1
        if n == stop:
            break
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(2):
        seen.extend(int(i) for (x,) in resumed for i in x)
    return whole, seen[: len(whole)]


def test_a_followed_order_resumes_exactly() -> None:
    whole, resumed = resume_a_followed_order(stop=3)
    assert resumed == whole


# --- the options migrating users reach for ----------------------------------------------------


def split_batches_run(split: bool) -> list[Any]:
    ds = TensorDataset(torch.arange(16.0))
    loader = ak.prepare(DataLoader(ds, batch_size=8 if split else 4), split_batches=split)
    return [len(loader), [x.tolist() for (x,) in loader], loader.batch_size]


def test_split_batches_splits_the_global_batch(pool: WorkerPool) -> None:
    zero, one = pool.run(split_batches_run, True)
    assert zero == [2, [[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0]], 4]
    assert one == [2, [[4.0, 5.0, 6.0, 7.0], [12.0, 13.0, 14.0, 15.0]], 4]
    assert pool.run(split_batches_run, False) == [zero, one]  # the same as per-process batches of 4
    with pytest.raises(ak.WorkerError, match="batch_size=7 does not split evenly between 2 processes"):
        pool.run(_split_an_odd_batch)


def _split_an_odd_batch() -> None:
    ak.prepare(DataLoader(TensorDataset(torch.arange(14)), batch_size=7), split_batches=True)


def shuffled_with_a_data_seed(seed: int | None) -> list[int]:
    ak.set_seed(ak.rank() * 100 + 7)
    ds = TensorDataset(torch.arange(12))
    loader = ak.prepare(DataLoader(ds, batch_size=3, shuffle=True), data_seed=seed)
    return [int(i) for (x,) in loader for i in x]


def test_a_data_seed_fixes_the_order_whatever_the_other_seeds(pool: WorkerPool) -> None:
    first = pool.run(shuffled_with_a_data_seed, 11)
    assert sorted(first[0] + first[1]) == list(range(12))
    assert pool.run(shuffled_with_a_data_seed, 11) == first
    assert pool.run(shuffled_with_a_data_seed, 12) != first
    with pytest.raises(ValueError, match="data_seed=-1"):
        ak.prepare(DataLoader(TensorDataset(torch.arange(4))), data_seed=-1)


def train_on_uneven_loaders(join: bool) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 8 if ak.rank() == 0 else 4  # rank 0 has twice the batches of rank 1
    loader = DataLoader(TensorDataset(torch.ones(n, 2) * (ak.rank() + 1), torch.ones(n, 1)), batch_size=2)
    model, opt, loader = ak.prepare(model, opt, loader, even_batches=False, join_uneven_inputs=join)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        ak.backward(loss)
        opt.step()
        opt.zero_grad()
    return [p.item() for p in model.parameters() for p in p.flatten()]


def test_join_uneven_inputs_lets_ranks_with_fewer_batches_finish(pool: WorkerPool) -> None:
    zero, one = pool.run(train_on_uneven_loaders, True, task_timeout=60)
    assert zero == one  # rank 1 shadowed rank 0's last two all-reduces: the replicas stayed equal


def accumulate_with(sync_each_batch: bool) -> list[Any]:
    ak.init(sync_each_batch=sync_each_batch)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ak.prepare(model, opt)
    synced = []
    for step in range(4):
        x = torch.full((2, 3), float(ak.rank() + step + 1))
        with ak.accumulate(model, steps=2):
            ak.backward(model(x).sum())
            synced.append(model.module.weight.grad.clone().tolist())  # after this micro-step's backward
            opt.step()
            opt.zero_grad()
    return [synced, [v for p in model.parameters() for v in p.flatten().tolist()]]


def test_sync_each_batch_synchronises_every_micro_step(pool: WorkerPool) -> None:
    (grads_0, params_0), (grads_1, params_1) = pool.run(accumulate_with, True)
    assert grads_0 == grads_1  # every micro-step all-reduced: the ranks' gradients agree at once
    (plain_0, ref_0), (plain_1, _) = pool.run(accumulate_with, False)
    assert plain_0[0] != plain_1[0]  # without it, a micro-step's gradients are each rank's own
    assert params_0 == params_1 == pytest.approx(ref_0)  # the same training either way


# --- differences kept, and documented ------------------------------------------------------------


def save_to_a_directory_per_rank(root: str) -> str:
    model = nn.Linear(2, 1)
    try:
        ak.save_state(f"{root}/rank{ak.rank()}", model=model)
    except ak.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_checkpoint_directory_per_rank_fails_on_every_rank_with_the_fix(pool: WorkerPool, tmp_path: Path) -> None:
    for message in pool.run(save_to_a_directory_per_rank, str(tmp_path)):
        assert "rank 1: CheckpointError" in message and "pass the same path on every rank" in message
    assert not any(tmp_path.iterdir())  # nothing was written
