"""Process control on the shared 2-worker gloo group (and on one process)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import accelkit as ak
from accelkit.testing import WorkerPool


def state_facts() -> dict[str, Any]:
    s = ak.state()
    return {
        "rank": (s.rank, ak.rank()),
        "world": (s.world_size, ak.world_size()),
        "local": (s.local_rank, s.local_world_size, ak.local_rank()),
        "node": (s.node_rank, s.num_nodes),
        "device": str(ak.device()),
        "backend": s.backend,
        "flags": (s.distributed, s.is_main_process, ak.is_main_process(), s.is_local_main_process),
    }


@ak.on_main_process
def main_only(value: int) -> int:
    return value + ak.rank()


@ak.on_local_main_process()
def local_main_only() -> int:
    return ak.rank()


@ak.on_process(1)
def rank_one_only() -> int:
    return ak.rank()


def decorated_calls() -> tuple[Any, Any, Any]:
    return main_only(10), local_main_only(), rank_one_only()


def ordered_writes(path: str, raise_on_main: bool = False) -> None:
    with ak.main_process_first():
        if ak.is_main_process():
            time.sleep(0.3)  # were the order not enforced, rank 1 would write first
            with open(path, "a") as f:
                f.write("0")
            if raise_on_main:
                raise RuntimeError("main failed inside main_process_first")
        else:
            with open(path, "a") as f:
                f.write("1")


def split(inputs: Any, apply_padding: bool) -> Any:
    with ak.split_between_processes(inputs, apply_padding=apply_padding) as mine:
        return mine


def breakpoints() -> tuple[bool, bool]:
    if ak.rank() == 1:
        ak.set_breakpoint()
    return ak.check_breakpoint(), ak.check_breakpoint()


def printed() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ak.print("hello from", ak.rank())
    ak.wait_for_everyone()
    return out.getvalue()


def seeded(device_specific: bool) -> tuple[float, float]:
    ak.set_seed(1234, device_specific=device_specific)
    return random.random(), torch.rand(1).item()


def test_state_fields_are_consistent_across_ranks(pool: WorkerPool) -> None:
    zero, one = pool.run(state_facts)
    assert zero["rank"] == (0, 0) and one["rank"] == (1, 1)
    assert zero["world"] == one["world"] == (2, 2)
    assert zero["local"] == (0, 2, 0) and one["local"] == (1, 2, 1)
    assert zero["node"] == one["node"] == (0, 1)
    assert zero["device"] == one["device"] == "cpu"
    assert zero["backend"] == one["backend"] == "gloo"
    assert zero["flags"] == (True, True, True, True) and one["flags"] == (True, False, False, False)


def test_decorators_run_on_the_right_ranks(pool: WorkerPool) -> None:
    assert pool.run(decorated_calls) == [(10, 0, None), (None, None, 1)]


def test_main_process_first_orders_side_effects(pool: WorkerPool, tmp_path: Any) -> None:
    path = str(tmp_path / "order.txt")
    pool.run(ordered_writes, path)
    assert open(path).read() == "01"


def test_main_process_first_releases_the_others_when_the_body_raises(pool: WorkerPool, tmp_path: Any) -> None:
    path = str(tmp_path / "order.txt")
    with pytest.raises(ak.WorkerError) as err:
        pool.run(ordered_writes, path, True)
    assert err.value.ranks == [0] and "main failed inside" in str(err.value)
    assert open(path).read() == "01"
    assert pool.run(ak.rank) == [0, 1]  # the group is still usable


items = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=9)


@settings(max_examples=30, deadline=None)
@given(values=items, apply_padding=st.booleans(), as_tensor=st.booleans())
def test_split_between_processes_partitions_exactly(
    pool: WorkerPool, values: list[int], apply_padding: bool, as_tensor: bool
) -> None:
    inputs: Any = torch.tensor(values, dtype=torch.long) if as_tensor else values
    if apply_padding and not values:
        with pytest.raises(ak.WorkerError, match="nothing to pad"):
            pool.run(split, inputs, apply_padding)
        return
    first, second = (list(map(int, p)) for p in pool.run(split, inputs, apply_padding))
    if apply_padding:
        assert len(first) == len(second) == (len(values) + 1) // 2
        real = len(values) - len(values) // 2  # rank 0 takes the extra item
        assert first + second[: len(values) - real] == values
        assert all(v == values[-1] for v in second[len(values) - real :])
    else:
        assert first + second == values
        assert len(first) - len(second) in (0, 1)


def test_split_dicts_and_tuples(pool: WorkerPool) -> None:
    inputs = {"a": [1, 2, 3], "b": ("x", "y", "z")}
    assert pool.run(split, inputs, False) == [{"a": [1, 2], "b": ("x", "y")}, {"a": [3], "b": ("z",)}]


def test_split_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        with ak.split_between_processes({"a": [1, 2], "b": [1]}):
            pass
    with pytest.raises(TypeError, match="cannot split str"):
        with ak.split_between_processes("abc"):
            pass


def test_breakpoint_is_seen_by_every_rank_then_cleared(pool: WorkerPool) -> None:
    assert pool.run(breakpoints) == [(True, False), (True, False)]


def test_print_only_on_the_main_process(pool: WorkerPool) -> None:
    assert pool.run(printed) == ["hello from 0\n", ""]


def test_set_seed(pool: WorkerPool) -> None:
    same = pool.run(seeded, False)
    assert same[0] == same[1]
    different = pool.run(seeded, True)
    assert different[0] != different[1] and different[0] == same[0]


def test_single_process_control() -> None:
    assert decorated_calls() == (10, 0, None)
    ak.wait_for_everyone()
    ak.set_breakpoint()
    assert (ak.check_breakpoint(), ak.check_breakpoint()) == (True, False)
    with ak.main_process_first(), ak.local_main_process_first():
        pass
    with ak.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]


def test_on_process_misuse() -> None:
    with pytest.raises(TypeError, match=r"@ak.on_process\(0\)"):
        ak.on_process(main_only)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank=-1"):
        ak.on_process(-1)


def test_set_seed_rejects_non_integers() -> None:
    with pytest.raises(TypeError, match="seed='42'"):
        ak.set_seed("42")  # type: ignore[arg-type]


def test_pool_survives_a_rank_that_dies(pool: WorkerPool) -> None:
    with pytest.raises(ak.WorkerError) as err:
        pool.run(os._exit, 3)
    assert "exited with code 3" in str(err.value)
    assert pool.run(ak.world_size) == [2, 2]


def barrier_against_gather() -> None:
    if ak.rank() == 0:
        ak.wait_for_everyone()
    else:
        ak.gather(torch.ones(1))


def test_debug_mode_names_a_barrier_met_by_another_collective(debug_pool: WorkerPool) -> None:
    with pytest.raises(ak.WorkerError) as err:
        debug_pool.run(barrier_against_gather)
    assert sorted(err.value.ranks) == [0, 1]
    for failure in err.value.failures:
        assert "wait_for_everyone" in failure.message and "gather" in failure.message
