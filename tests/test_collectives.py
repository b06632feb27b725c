"""Collectives: identity and input errors on one process; on two gloo processes, results
against references computed from every rank's input, and debug-mode mismatch reports."""

from __future__ import annotations

import threading
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
from generators import DTYPES, FLOAT_DTYPES, Box, Leaf, blueprints, build, leaves, objects, rebuild, tensors
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import accelkit as ak
from accelkit.testing import WorkerPool

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DEBUG_ERROR = "accelkit.errors.DistributedOperationError"
Batch = namedtuple("Batch", ["inputs", "mask"])
TENSOR_COLLECTIVES = [ak.gather, ak.reduce, ak.broadcast, ak.pad_across_processes]

# --- one process: no process group, the input object itself comes back -------------------


@pytest.mark.parametrize("collective", TENSOR_COLLECTIVES, ids=lambda f: f.__name__)
def test_one_process_returns_the_input_itself(collective: Any) -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    tree = {"x": tensor, "rest": [Batch(tensor, tensor * 2), (tensor[0],)], "box": Box(tensor, tensor)}
    assert collective(tensor) is tensor
    assert collective(tree) is tree
    assert not dist.is_initialized()


def test_one_process_object_collectives() -> None:
    obj = {"a": [1, 2], "b": "text"}
    gathered = ak.gather_object(obj)
    assert gathered == [obj] and gathered[0] is obj
    assert ak.broadcast_object(obj) is obj
    unpicklable = threading.Lock()  # nothing is pickled with one process
    assert ak.gather_object(unpicklable)[0] is unpicklable
    assert not dist.is_initialized()


@pytest.mark.parametrize("collective", TENSOR_COLLECTIVES, ids=lambda f: f.__name__)
def test_non_tensor_leaf_is_named_by_its_path(collective: Any) -> None:
    t = torch.zeros(2)
    with pytest.raises(TypeError, match=r"data\['labels'\]\[2\] is str 'oops', not a tensor"):
        collective({"inputs": t, "labels": [t, t, "oops"]})
    with pytest.raises(TypeError, match=r"data\.mask is NoneType"):
        collective(Batch(t, None))
    with pytest.raises(TypeError, match=rf"accelkit\.{collective.__name__}: data\[0\] is float 1\.0"):
        collective([1.0])


def test_reduce_rejects_unknown_op_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        ak.reduce(torch.zeros(2), op="avg")  # type: ignore[arg-type]
    for op in ("'sum'", "'mean'", "'max'", "'min'", "'product'"):
        assert op in str(info.value)
    assert "op='avg'" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_reduce_mean_of_integers_is_an_error_not_a_truncation(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=rf"data\['n'\] is a {dtype} tensor.*x\.float\(\)"):
        ak.reduce({"loss": torch.zeros(1), "n": torch.ones(1, dtype=dtype)}, op="mean")
    data = torch.ones(1, dtype=dtype)
    assert ak.reduce(data, op="sum") is data


def test_reduce_rejects_ordering_complex_numbers() -> None:
    with pytest.raises(TypeError, match="complex"):
        ak.reduce(torch.zeros(2, dtype=torch.complex64), op="max")


@pytest.mark.parametrize("collective", [ak.broadcast, ak.broadcast_object], ids=lambda f: f.__name__)
def test_bad_src(collective: Any) -> None:
    with pytest.raises(ValueError, match=r"src=1\): the job has 1 process, so src must be between 0 and 0"):
        collective(torch.zeros(1), src=1)
    with pytest.raises(ValueError, match="src=-1"):
        collective(torch.zeros(1), src=-1)
    with pytest.raises(TypeError, match="src='0'"):
        collective(torch.zeros(1), src="0")


def test_headers_are_read_at_their_place_in_views() -> None:
    # The device wire's verdict reads each rank's header where it lies, also inside a view that starts
    # further into its storage (a broadcast receiver's message tail); only the agreed bytes count.
    from accelkit._collectives import _check
    from accelkit._collectives._signature import AGREE, HEADER

    mine = bytes(range(1, HEADER + 1))
    for ranks, width, at, lead in ((1, 100, 36, 0), (3, 80, 16, 0), (2, 70, 6, 11)):
        storage = torch.zeros(lead + ranks * width, dtype=torch.uint8)
        messages = storage[lead:]
        for r in range(ranks):
            messages[r * width + at : r * width + at + HEADER] = torch.tensor(list(mine), dtype=torch.uint8)
        header = torch.tensor(list(mine), dtype=torch.uint8)
        assert bool(_check.headers_agree_on_device(messages, ranks, width, at, header))
        messages[(ranks - 1) * width + at + AGREE - 1] ^= 1  # the last rank's fingerprint differs
        assert not bool(_check.headers_agree_on_device(messages, ranks, width, at, header))
        messages[(ranks - 1) * width + at + AGREE - 1] ^= 1
        messages[(ranks - 1) * width + at + AGREE] ^= 1  # beyond the agreed bytes: the length may differ
        assert bool(_check.headers_agree_on_device(messages, ranks, width, at, header))


@pytest.mark.parametrize("seq", [1, 300, 2**40 + 3])
def test_a_header_is_its_framing_around_the_call_number(seq: int) -> None:
    # A call run again as planned writes its header from the bytes around its number, made once.
    from accelkit._collectives._signature import AGREE, signature

    sig = signature("broadcast", {"src": 1}, [torch.ones(2, 3, dtype=torch.float16)])
    before, after, agreed = sig.framing()
    number = seq.to_bytes(8, "little")
    assert sig.header(seq) == before + number + after
    assert sig.header(seq)[:AGREE] == before + number + agreed


def test_pad_rejects_a_dim_that_is_no_integer() -> None:
    with pytest.raises(TypeError, match=r"dim=1.5.*integer"):
        ak.pad_across_processes(torch.zeros(2), dim=1.5)  # type: ignore[arg-type]


# --- two processes: property tests against references from every rank's input -----------


def _apply(name: str, blueprint: Any, seed: int, kwargs: dict[str, Any], vary_dim: int | None = None) -> Any:
    """In a worker: apply ``ak.<name>`` to this rank's input; report the output and side effects."""
    data = build(blueprint, ak.rank(), seed, vary_dim)
    pristine = build(blueprint, ak.rank(), seed, vary_dim)
    out = getattr(ak, name)(data, **kwargs)
    unchanged = all(torch.equal(a, b) for a, b in zip(tensors(data), tensors(pristine), strict=True))
    storages = {t.untyped_storage().data_ptr() for t in tensors(data) if t.numel()}
    aliased = any(t.untyped_storage().data_ptr() in storages for t in tensors(out) if t.numel())
    return out, unchanged, aliased


def _run(
    pool: WorkerPool, name: str, blueprint: Any, seed: int, vary_dim: int | None = None, **kwargs: Any
) -> list[Any]:
    outputs = []
    for out, unchanged, aliased in pool.run(_apply, name, blueprint, seed, kwargs, vary_dim):
        assert unchanged, f"ak.{name} modified its input"
        assert not aliased, f"ak.{name} returned a tensor that shares memory with its input"
        outputs.append(out)
    return outputs


def _expected(blueprint: Any, seed: int, combine: Any, vary_dim: int | None = None) -> Any:
    inputs = [tensors(build(blueprint, rank, seed, vary_dim)) for rank in range(2)]
    return rebuild(blueprint, [combine(*per_rank) for per_rank in zip(*inputs, strict=True)])


def assert_same_tree(actual: Any, expected: Any, exact: bool = True, path: str = "data") -> None:
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        if exact:
            assert torch.equal(actual, expected), f"{path}: {actual} != {expected}"
        else:
            torch.testing.assert_close(actual, expected, msg=path)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same_tree(actual[key], expected[key], exact, f"{path}[{key!r}]")
    elif isinstance(expected, Box):
        assert_same_tree(actual.value, expected.value, exact, f"{path}.value")
        assert_same_tree(actual.extra, expected.extra, exact, f"{path}.extra")
    else:
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, exact, f"{path}[{i}]")


@pytest.mark.smoke
@pytest.mark.distributed
@PROPERTY
@given(blueprint=blueprints(), seed=st.integers(0, 2**20))
@example(blueprint=Leaf("float32", ()), seed=0)
@example(blueprint={"b": Leaf("bfloat16", (2, 3)), "a": (Leaf("bool", ()), Leaf("int16", (3,)))}, seed=1)
def test_gather_concatenates_in_rank_order(pool: WorkerPool, blueprint: Any, seed: int) -> None:
    expected = _expected(blueprint, seed, lambda *xs: torch.cat([x.reshape(1) if x.dim() == 0 else x for x in xs]))
    for out in _run(pool, "gather", blueprint, seed):
        assert_same_tree(out, expected)


REDUCERS = {"sum": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}


@pytest.mark.smoke
@pytest.mark.distributed
@PROPERTY
@given(blueprint=blueprints(), seed=st.integers(0, 2**20), op=st.sampled_from(sorted(REDUCERS)))
@example(blueprint=[Leaf("bool", (3,)), Leaf("int16", ()), Leaf("uint8", (2,))], seed=3, op="sum")
def test_reduce_matches_the_elementwise_reference(pool: WorkerPool, blueprint: Any, seed: int, op: str) -> None:
    expected = _expected(blueprint, seed, REDUCERS[op])
    for out in _run(pool, "reduce", blueprint, seed, op=op):
        assert_same_tree(out, expected, exact=False)


@pytest.mark.distributed
@PROPERTY
@given(blueprint=blueprints(leaves(FLOAT_DTYPES)), seed=st.integers(0, 2**20))
def test_reduce_mean(pool: WorkerPool, blueprint: Any, seed: int) -> None:
    expected = _expected(blueprint, seed, lambda a, b: (a + b) / 2)
    for out in _run(pool, "reduce", blueprint, seed, op="mean"):
        assert_same_tree(out, expected, exact=False)


@pytest.mark.smoke
@pytest.mark.distributed
@PROPERTY
@given(blueprint=blueprints(), seed=st.integers(0, 2**20), src=st.sampled_from([0, 1]))
def test_broadcast_sends_the_source_tree(pool: WorkerPool, blueprint: Any, seed: int, src: int) -> None:
    expected = build(blueprint, src, seed)
    for out in _run(pool, "broadcast", blueprint, seed, src=src):
        assert_same_tree(out, expected)


@pytest.mark.smoke
@pytest.mark.distributed
@PROPERTY
@given(
    data=st.data(),
    seed=st.integers(0, 2**20),
    dim=st.sampled_from([0, 1, -1]),
    pad_index=st.sampled_from([0, 1, 3]),
    pad_first=st.booleans(),
)
def test_pad_across_processes(
    pool: WorkerPool, data: Any, seed: int, dim: int, pad_index: int, pad_first: bool
) -> None:
    blueprint = data.draw(blueprints(leaves(DTYPES, min_dims=2 if dim == 1 else 1)))
    for rank, out in enumerate(_run(pool, "pad_across_processes", blueprint, seed, dim, dim=dim,
                                    pad_index=pad_index, pad_first=pad_first)):  # fmt: skip

        def padded(*xs: torch.Tensor, rank: int = rank) -> torch.Tensor:
            size, x = max(x.shape[dim] for x in xs), xs[rank]
            filler = torch.full((*x.shape[:dim % x.dim()], size - x.shape[dim], *x.shape[dim % x.dim() + 1 :]),
                                pad_index, dtype=x.dtype)  # fmt: skip
            return torch.cat([filler, x] if pad_first else [x, filler], dim=dim)

        assert_same_tree(out, _expected(blueprint, seed, padded, vary_dim=dim))


def _gather_object(objs: list[Any]) -> list[Any]:
    return ak.gather_object(objs[ak.rank()])


def _broadcast_object(objs: list[Any], src: int) -> Any:
    return ak.broadcast_object(objs[ak.rank()], src=src)


@pytest.mark.smoke
@pytest.mark.distributed
@PROPERTY
@given(objs=st.lists(objects(), min_size=2, max_size=2))
@example(objs=[{"a": 1, "b": 2}, "a string stays whole"])
def test_gather_object_returns_one_entry_per_rank(pool: WorkerPool, objs: list[Any]) -> None:
    assert pool.run(_gather_object, objs) == [objs, objs]


@pytest.mark.smoke
@pytest.mark.distributed
@PROPERTY
@given(objs=st.lists(objects(), min_size=2, max_size=2), src=st.sampled_from([0, 1]))
def test_broadcast_object(pool: WorkerPool, objs: list[Any], src: int) -> None:
    assert pool.run(_broadcast_object, objs, src) == [objs[src], objs[src]]


# --- two processes: mismatches become errors on every rank ------------------------------

MISMATCH_DEADLINE = 20.0  # seconds; a hang fails the test through the pool's timeout


def _rank_specific(case: str) -> Any:
    """In a worker: a collective called differently on the two ranks."""
    rank = ak.rank()
    if case == "gather shapes":
        return ak.gather(torch.zeros(2 + rank, 3))
    if case == "reduce dtypes":
        return ak.reduce(torch.zeros(4, dtype=(torch.float32, torch.int32)[rank]), op="sum")
    if case == "broadcast shapes":
        return ak.broadcast(torch.zeros([(1, 5), (1, 2, 5)][rank]))
    if case == "pad off dim":
        return ak.pad_across_processes({"x": torch.zeros(2 + rank, 3), "y": torch.zeros(2, 3 + rank)}, dim=0)
    if case == "different operations":
        return ak.gather(torch.zeros(3)) if rank == 0 else ak.reduce({"a": torch.zeros(3)}, op="sum")
    if case == "structure":
        return ak.gather({("a", "b")[rank]: torch.zeros(2)})
    if case == "reduce op":
        return ak.reduce(torch.zeros(2), op=("sum", "max")[rank])
    if case == "broadcast_object src":
        return ak.broadcast_object("x", src=rank)
    raise AssertionError(case)


def _errors(pool: WorkerPool, *args: Any) -> dict[int, str]:
    """Run a task that must fail on every rank with DistributedOperationError; the messages by rank."""
    with pytest.raises(ak.WorkerError) as info:
        pool.run(*args, task_timeout=MISMATCH_DEADLINE)
    failures = {f.rank: f for f in info.value.failures}
    assert sorted(failures) == [0, 1], info.value
    assert {f.exc_type for f in failures.values()} == {DEBUG_ERROR}, info.value
    return {rank: f.message for rank, f in failures.items()}


MISMATCHES = {
    "gather shapes": ["Cannot apply accelkit.gather: the inputs differ across processes.",
                      "  - Process 0: float32 [2, 3]", "  - Process 1: float32 [3, 3]", "pad_across_processes"],
    "reduce dtypes": ["Cannot apply accelkit.reduce: the inputs differ across processes.",
                      "  - Process 0: float32 [4]", "  - Process 1: int32 [4]"],
    "broadcast shapes": ["Cannot apply accelkit.broadcast: the inputs differ across processes.\n"
                         "  - Process 0: float32 [1, 5]\n  - Process 1: float32 [1, 2, 5]\n"],
    "pad off dim": ["Cannot apply accelkit.pad_across_processes: the inputs differ across processes.",
                    "  - Process 1: {'x': float32 [3, 3], 'y': float32 [2, 4]}",
                    "data['y'] is float32 [2, 3] on process 0, float32 [2, 4] on process 1", "dim=0"],
    "structure": ["Cannot apply accelkit.gather: the inputs differ across processes.",
                  "  - Process 0: {'a': float32 [2]}", "  - Process 1: {'b': float32 [2]}"],
    "reduce op": ["Cannot apply accelkit.reduce: the processes passed different arguments.",
                  "  - Process 0: accelkit.reduce(op='sum') float32 [2]",
                  "  - Process 1: accelkit.reduce(op='max') float32 [2]"],
    "broadcast_object src": ["Cannot apply accelkit.broadcast_object: the processes passed different arguments.",
                             "  - Process 0: accelkit.broadcast_object(src=0)",
                             "  - Process 1: accelkit.broadcast_object(src=1)"],
}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_debug_mode_reports_a_mismatch_on_every_rank(debug_pool: WorkerPool, case: str) -> None:
    for rank, message in _errors(debug_pool, _rank_specific, case).items():
        for part in MISMATCHES[case]:
            assert part in message, f"rank {rank}: {part!r} not in\n{message}"


@pytest.mark.distributed
def test_debug_mode_reports_different_operations(debug_pool: WorkerPool) -> None:
    messages = _errors(debug_pool, _rank_specific, "different operations")
    for rank, op in ((0, "gather"), (1, "reduce")):  # each rank names the operation it called
        assert messages[rank].startswith(f"Cannot apply accelkit.{op}: the processes called different operations.")
        assert "  - Process 0: accelkit.gather() float32 [3]" in messages[rank]
        assert "  - Process 1: accelkit.reduce(op='sum') {'a': float32 [3]}" in messages[rank]


def _invalid_on_rank_1(collective: str) -> Any:
    if collective == "broadcast_object":
        return ak.broadcast_object(lambda: 0 if ak.rank() == 0 else None)  # rank 0 cannot pickle it
    labels = [torch.zeros(1), "oops" if ak.rank() == 1 else torch.zeros(1)]
    return getattr(ak, collective)({"labels": labels})


@pytest.mark.distributed
@pytest.mark.parametrize("collective", ["gather", "reduce", "broadcast", "pad_across_processes", "broadcast_object"])
def test_debug_mode_turns_one_rank_s_bad_input_into_errors_everywhere(debug_pool: WorkerPool, collective: str) -> None:
    with pytest.raises(ak.WorkerError) as info:
        debug_pool.run(_invalid_on_rank_1, collective, task_timeout=MISMATCH_DEADLINE)
    failures = {f.rank: f for f in info.value.failures}
    bad, other = (0, 1) if collective == "broadcast_object" else (1, 0)
    assert sorted(failures) == [0, 1] and failures[bad].exc_type == "TypeError", info.value
    assert failures[other].exc_type == DEBUG_ERROR
    assert (
        f"Cannot apply accelkit.{collective}: process {bad} could not apply it to its input." in failures[other].message
    )
    assert failures[bad].message in failures[other].message  # quoted: the root cause on every rank


def _matching_calls() -> list[Any]:
    """Calls that agree across ranks (pad differs only along dim; dict orders differ)."""
    rank = ak.rank()
    items = [("a", torch.full((2,), rank)), ("b", torch.tensor(rank + 1.0))]
    tree = dict(items if rank == 0 else items[::-1])  # another insertion order on rank 1
    ragged = torch.arange(2.0 + rank).reshape(-1, 1)
    return [ak.gather(tree), ak.reduce(tree, op="sum"), ak.broadcast(tree, src=1),
                         ak.pad_across_processes(ragged, pad_index=-1, pad_first=True),
                         ak.gather_object(tree), ak.broadcast_object(rank, src=1)]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["pool", "debug_pool"])
def test_matching_calls_pass_the_debug_check(mode: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(mode).run(_matching_calls)
    for rank, (gathered, summed, sent, padded, objs, obj) in enumerate(results):
        assert list(gathered) == (["a", "b"] if rank == 0 else ["b", "a"])  # each rank keeps its order
        assert torch.equal(gathered["a"], torch.tensor([0, 0, 1, 1])) and torch.equal(
            gathered["b"], torch.tensor([1.0, 2.0])
        )
        assert torch.equal(summed["a"], torch.tensor([1, 1])) and torch.equal(summed["b"], torch.tensor(3.0))
        assert torch.equal(sent["a"], torch.tensor([1, 1])) and torch.equal(sent["b"], torch.tensor(2.0))
        assert torch.equal(
            padded, torch.tensor([[-1.0], [0.0], [1.0]]) if rank == 0 else torch.tensor([[0.0], [1.0], [2.0]])
        )
        assert [list(o) for o in objs] == [["a", "b"], ["b", "a"]] and obj == 1


def _bad_src() -> Any:
    return ak.broadcast(torch.zeros(1), src=2)


@pytest.mark.distributed
def test_bad_src_fails_on_every_rank(pool: WorkerPool) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool.run(_bad_src, task_timeout=MISMATCH_DEADLINE)
    assert [f.exc_type for f in info.value.failures] == ["ValueError", "ValueError"]
    assert "the job has 2 processes, so src must be between 0 and 1" in info.value.failures[0].message


@pytest.mark.distributed
def test_without_debug_mode_a_mismatch_still_raises_the_table_on_every_rank(pool: WorkerPool) -> None:
    messages = _errors(pool, _rank_specific, "different operations")  # no timeout: found in the first message
    for rank, op in ((0, "gather"), (1, "reduce")):
        assert messages[rank].startswith(f"Cannot apply accelkit.{op}: the processes called different operations.")
        assert "  - Process 1: accelkit.reduce(op='sum') {'a': float32 [3]}" in messages[rank]
