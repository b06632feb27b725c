"""The checked collectives are memory-safe and keep their history in step whatever a call's outcome.

Reproducers that once crashed or raised falsely, each run 50 times in the same 2-process group
with faulthandler on: a generator's state broadcast and set, refused calls between valid ones,
Accelerate's training check with a DataLoader that has its own generator, plans that a call misses
(a smaller last batch) and points of the program whose calls change; and the switch that leaves
only the backend call.
"""

from __future__ import annotations

import faulthandler
import threading
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak
from accelkit.testing import WorkerPool, run_distributed

RUNS = 50


def generator_states() -> bool:
    faulthandler.enable()
    g = torch.Generator()
    g.manual_seed(42 + ak.rank())
    out = ak.broadcast(g.get_state())  # uint8 [5056]
    torch.Generator().set_state(out)  # refuses a tensor that does not own its storage
    again = ak.broadcast(g.get_state())
    torch.Generator().set_state(again)
    expected = torch.Generator().manual_seed(42).get_state()
    return torch.equal(out, expected) and torch.equal(again, expected)


def refused_between_valid_calls() -> list[float]:
    faulthandler.enable()
    for t, op in ((torch.ones(3, dtype=torch.int32), "mean"),  # TypeError on every rank
                  (torch.ones(1, dtype=torch.bool), "sum"),
                  (torch.ones(3, dtype=torch.int32), "mean")):  # fmt: skip
        try:
            ak.reduce(t, op=op)  # type: ignore[arg-type]
        except TypeError:
            pass
    return ak.reduce(torch.ones(4)).tolist()  # type: ignore[no-any-return]


def accelerate_training_check(precision: str) -> list[float]:
    """Accelerate's test_script training check: a shuffled loader with its own generator, prepared."""
    ak.init(precision=precision)
    g = torch.Generator().manual_seed(42)
    x = torch.arange(64, dtype=torch.float32).unsqueeze(1) / 64
    dl = DataLoader(TensorDataset(x, 2 * x + 1), batch_size=16, shuffle=True, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    dl, model, opt = ak.prepare(dl, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for xb, yb in dl:
        opt.zero_grad()
        ak.backward(torch.nn.functional.mse_loss(model(xb).float(), yb))
        opt.step()
    return [p.item() for p in ak.unwrap(model).parameters()]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("task", [generator_states, refused_between_valid_calls], ids=lambda f: f.__name__)
def test_the_reproducers_pass_fifty_runs_of_fifty(pool: WorkerPool, task: Any) -> None:
    results = [pool.run(task) for _ in range(RUNS)]
    assert all(r == results[0] for r in results)
    assert results[0][0] in (True, [2.0] * 4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_a_loader_with_its_own_generator_prepares_fifty_times(pool: WorkerPool, precision: str) -> None:
    runs = RUNS if precision == "no" else 5
    results = [pool.run(accelerate_training_check, precision) for _ in range(runs)]
    assert all(r == results[0] for r in results)
    assert results[0][0] == results[0][1], "the ranks trained the same model"


def misses_and_changes() -> list[Any]:
    """A plan missed by every rank alike (the last batch), a point whose calls alternate, a reduction of
    another dtype and op at a planned point, objects between tensors."""
    out: list[Any] = []
    for n in (4, 4, 4, 3, 4, 2):
        out.append(ak.gather(torch.arange(n) + 10 * ak.rank()).tolist())
    for i in range(6):
        out.append(ak.reduce(torch.ones(2 + i % 2) * (ak.rank() + 1)).tolist())
    for op in ("sum", "max", "sum", "product"):
        out.append(ak.reduce(torch.tensor([ak.rank() + 2], dtype=torch.int64), op=op).tolist())
    for i in range(3):
        out.append(ak.gather_object({"rank": ak.rank(), "i": i}))
        out.append(ak.broadcast(torch.full((3,), float(ak.rank())), src=i % 2).tolist())
    big = torch.arange(200_000, dtype=torch.float64) * (ak.rank() + 1)  # beyond the token's ride in the data
    out.extend(float(ak.reduce(big).sum()) for _ in range(3))
    out.extend(float(ak.broadcast(big, src=1).sum()) for _ in range(3))
    return out


@pytest.mark.distributed
def test_plans_that_calls_miss_or_change_give_the_right_results(pool: WorkerPool) -> None:
    first, second = pool.run(misses_and_changes)
    assert first == second
    expected: list[Any] = [[0, 1, 2, 3, 10, 11, 12, 13]] * 3 + [[0, 1, 2, 10, 11, 12], [0, 1, 2, 3, 10, 11, 12, 13],
                                                            [0, 1, 10, 11]]  # fmt: skip
    expected += [[3.0] * (2 + i % 2) for i in range(6)]
    expected += [[5], [3], [5], [6]]
    for i in range(3):
        expected += [[{"rank": 0, "i": i}, {"rank": 1, "i": i}], [float(i % 2)] * 3]
    expected += [3.0 * sum(range(200_000))] * 3 + [2.0 * sum(range(200_000))] * 3
    assert first == expected


def _raw_result(op: str, arg: Any, x: torch.Tensor) -> torch.Tensor:
    """What raw torch.distributed gives for one bare call (the reference)."""
    import torch.distributed as dist

    x = x.detach().contiguous()
    if op == "gather":
        out = x.new_empty((2 * x.shape[0], *x.shape[1:]) if x.dim() else (2,))
        dist.all_gather_into_tensor(out, x.reshape(-1) if x.dim() == 0 else x)
        return out
    if op == "broadcast":
        out = x.clone()
        dist.broadcast(out, arg)
        return out
    if x.dtype == torch.bool:  # (gloo sums booleans as bytes; it cannot reduce int16 at all)
        return _raw_result(op, arg, x.to(torch.uint8)).clamp(max=1).bool()
    if x.dtype == torch.int16:
        return _raw_result(op, arg, x.to(torch.int32)).to(torch.int16)
    out = x.clone()
    dist.all_reduce(out, {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                          "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[arg])  # fmt: skip
    return out / 2 if arg == "mean" else out


REPEATED = [("reduce", op, dtype, n) for op in ("sum", "mean", "max", "min", "product")
            for dtype, n in ((torch.float32, 7), (torch.float16, 3), (torch.float64, 30_000))]  # fmt: skip
REPEATED += [("reduce", op, torch.int64, 5) for op in ("sum", "max", "product")]
REPEATED += [("reduce", "sum", torch.bool, 9), ("reduce", "max", torch.int16, 4)]
REPEATED += [("broadcast", src, dtype, n) for src in (0, 1) for dtype, n in
             ((torch.float32, 5), (torch.int8, 3), (torch.float64, 20_000), (torch.bool, 6))]  # fmt: skip
REPEATED += [("gather", None, dtype, n) for dtype, n in ((torch.float32, 4), (torch.bfloat16, 0), (torch.int64, 1))]


def repeated_bare_calls() -> list[str]:
    """Each bare call four times at its point (the later ones run again as planned, as the wire prepared them),
    on new values each time, laid out four ways (1-d or 0-d, every other element, one row, requiring grad): every
    result against raw torch.distributed's, each its own tensor, none changed by the calls after it."""
    problems: list[str] = []
    for op, arg, dtype, n in REPEATED:
        kept = []
        for layout in ("flat", "strided", "row", "grad"):
            if layout == "grad" and not dtype.is_floating_point:
                continue
            for i in range(4):
                values = (torch.arange(2 * n) % 5 + ak.rank() + i + 1).to(dtype)
                if layout == "grad":
                    x = values[:n].clone().requires_grad_()
                else:
                    x = {"flat": values[:n] if n != 1 else values[:1].reshape(()), "strided": values[::2],
                         "row": values[:n].view(1, n)}[layout]  # fmt: skip
                got = ak.reduce(x, op=arg) if op == "reduce" else ak.broadcast(x, src=arg) if op == "broadcast" \
                    else ak.gather(x)  # fmt: skip
                kept.append((got, _raw_result(op, arg, x), f"{op}({arg}) {dtype} [{n}] {layout} #{i}"))
        seen: set[int] = set()
        for got, expected, name in kept:
            if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
                problems.append(f"{name}: {got} != {expected}")
            if got.requires_grad or got.storage_offset():
                problems.append(f"{name}: a view or with history")
            if got.numel() and got.untyped_storage().data_ptr() in seen:
                problems.append(f"{name}: shares its storage with an earlier result")
            seen.add(got.untyped_storage().data_ptr())
    return problems


@pytest.mark.distributed
def test_a_bare_call_run_again_as_planned_gives_raw_torchs_result(pool: WorkerPool) -> None:
    assert pool.run(repeated_bare_calls) == [[], []]


def float8_misses_and_pads() -> list[Any]:
    f8 = torch.float8_e4m3fn
    calls = [torch.zeros(n, dtype=torch.uint8).view(f8) for n in (0, 0, 0, 2)]  # the last misses its plan
    out: list[Any] = [ak.gather(x).shape[0] for x in calls]
    out.append(ak.pad_across_processes(torch.ones(1 + ak.rank()).to(f8)).float().tolist())
    return out


@pytest.mark.smoke
@pytest.mark.distributed
def test_a_float8_call_that_misses_its_plan_and_a_float8_pad(pool: WorkerPool) -> None:
    # The planned message of a call that misses is zeros shaped like the plan's (here an empty float8 tensor),
    # and a pad fills with pad_index: torch 2.4 cannot fill an empty float8 tensor, nor any on the CPU.
    first, second = pool.run(float8_misses_and_pads)
    assert first == [0, 0, 0, 4, [1.0, 0.0]] and second == [0, 0, 0, 4, [1.0, 1.0]]


def replans_of_alternating_calls() -> int:
    """Runs of three broadcasts and three reductions, six times: how often every rank learned a call anew
    (a first call at a point, or a plan missed)."""
    from accelkit._collectives import _checked

    learned = 0
    original = _checked._agreed

    def counted(*args: Any) -> Any:
        nonlocal learned
        learned += 1
        return original(*args)

    _checked._agreed = counted
    try:
        x = torch.ones(8) * ak.rank()
        for _ in range(6):
            for _ in range(3):
                assert ak.broadcast(x).tolist() == [0.0] * 8
            for _ in range(3):
                assert ak.reduce(x).tolist() == [1.0] * 8
    finally:
        _checked._agreed = original
    return learned


@pytest.mark.distributed
def test_a_point_followed_by_two_calls_plans_the_usual_one(pool: WorkerPool) -> None:
    # After a broadcast comes a broadcast twice as often as a reduction (and the other way round): each
    # point keeps planning its usual call, so each run's first call misses once, not its first two.
    first, second = pool.run(replans_of_alternating_calls)
    assert first == second
    assert first <= 4 + 2 * 5  # the first cycle learns four calls; each later one misses twice


def kept_after_many_calls() -> list[list[int]]:
    """After many collectives of big tensors whose results are dropped: the messages the ranks still hold."""
    from accelkit._collectives import _exchange, _scratch

    held = []
    for call in (ak.reduce, ak.broadcast, ak.gather):
        for _ in range(10):
            call(torch.ones(100_000))
        mine = _exchange._KEPT[threading.get_ident()]  # other threads (a background save's) keep their own
        kept = [t for args in mine for t in args if isinstance(t, torch.Tensor)]
        held.append(sorted(t.numel() for t in kept))
    # A small gather's message is this thread's reused buffer: its results are copies, each with storage of its own.
    first, second = ak.gather(torch.ones(1000)), ak.gather(torch.ones(1000))
    buffer = _scratch.mine()
    assert buffer is not None
    buffers = {buffer.tensor.untyped_storage().data_ptr()}
    storages = {t.untyped_storage().data_ptr() for t in (first, second)}
    held.append([len(buffers), len(storages), len(buffers | storages)])
    return held


@pytest.mark.distributed
def test_a_message_is_let_go_when_the_next_collective_begins(pool: WorkerPool) -> None:
    # Each backend call's tensors are kept alive from Python (see _exchange._KEPT) until the next collective
    # begins: not the last eight calls' (800 kB each here, held for nothing), and a new message can reuse
    # the memory of the one before, as raw code's clone does, instead of faulting in fresh pages.
    for reduced, broadcast, gathered, storages in pool.run(kept_after_many_calls):
        assert reduced == [100_064]  # the data and the token's 64 bits, one message
        assert broadcast == [100_016]  # the data and a 64-byte header (16 floats), one message
        assert gathered == [400_064, 800_128]  # this rank's message, every rank's (views of one reused buffer)
        assert storages == [1, 2, 3]  # one reused buffer; two results, each with storage of its own


def gathers_without_the_reused_buffer() -> list[Any]:
    """The same gathers through this thread's reused buffer and without it (the host wire's way for messages beyond
    its limit: the data as raw code moves it, the check beside), then a planned call that differs on one rank,
    without it. The second half runs over a process group of the same two processes: a channel of its own, whose
    plans are made while the buffer's limit is 0."""
    import torch.distributed as dist

    from accelkit import _state, _tree
    from accelkit._collectives import _scratch

    r = ak.rank()
    data = [
        torch.arange(6.0).view(2, 3) + r,
        torch.tensor(r, dtype=torch.int16),
        {"a": torch.ones(3) * r, "b": torch.zeros(0)},
    ]
    lean = [ak.gather(d) for _ in range(3) for d in data]  # from the second round, each call rides in its plan
    group = dist.new_group([0, 1])
    limit, _scratch.LIMIT = _scratch.LIMIT, 0
    try:
        alone = [ak.gather(d, group=group) for _ in range(3) for d in data]
        plans = _state.group.channels.groups[group].plans  # (a disagreement forgets them)
        ways = sorted({p.tail for point in plans.values() for p in point.plans.values()})
        try:
            ak.gather(data[0] if r == 0 else data[0].double(), group=group)
            caught = "nothing"
        except ak.DistributedOperationError as exc:
            caught = str(exc)
    finally:
        _scratch.LIMIT = limit
    same = [all(torch.equal(a, b) for a, b in zip(_tree.flatten(x, "")[0], _tree.flatten(y, "")[0], strict=True))
            for x, y in zip(lean, alone, strict=True)]  # fmt: skip
    return [same, [t.tolist() for t in lean[3:5]], caught, ways]


@pytest.mark.distributed
def test_a_gather_without_the_reused_buffer_is_the_same_gather(pool: WorkerPool) -> None:
    for same, values, caught, ways in pool.run(gathers_without_the_reused_buffer):
        assert same == [True] * 9
        assert values == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [0, 1]]
        assert "float64" in caught and "float32" in caught and "over the process group of processes 0, 1" in caught
        assert ways == [False]  # the group's plans moved their data beside the check


def test_what_is_kept_for_a_thread_that_ended_goes() -> None:
    # A background save's thread keeps its last calls' tensors and ends; the next thread's first entry drops them.
    from accelkit._collectives import _exchange

    table: dict[int, Any] = {}
    worker = threading.Thread(target=_exchange.mine, args=(table, list))
    worker.start()
    worker.join()
    assert len(table) == 1 and threading.get_ident() not in table
    _exchange.mine(table, list)
    assert list(table) == [threading.get_ident()]


def unchecked() -> list[Any]:
    x = torch.arange(3.0) + ak.rank()
    out = [ak.reduce(x).tolist(), ak.gather(x).tolist(), ak.broadcast(x, src=1).tolist()]
    out.append(ak.pad_across_processes(torch.ones(1 + ak.rank())).tolist())
    out.append(ak.gather_object(ak.rank()))
    ak.wait_for_everyone()
    return out


@pytest.mark.distributed
def test_check_collectives_false_leaves_the_backend_call_alone() -> None:
    results = run_distributed(unchecked, num_processes=2, check_collectives=False)
    common = [[1.0, 3.0, 5.0], [0.0, 1.0, 2.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    assert results == [[*common, [1.0, 0.0], [0, 1]], [*common, [1.0, 1.0], [0, 1]]]


def test_check_collectives_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_CHECK_COLLECTIVES", "0")
    assert ak.state().options.check_collectives is False
    ak.reset_state()
    monkeypatch.setenv("ACCELKIT_CHECK_COLLECTIVES", "maybe")
    with pytest.raises(ak.ConfigurationError, match="ACCELKIT_CHECK_COLLECTIVES"):
        ak.state()


def _over(wire: str) -> Any:
    """The channels anew, over the ``wire`` given (the device wire here on the CPU, each verdict read at the next
    collective), alike on every rank."""
    from accelkit import _state
    from accelkit._collectives import _channel, _device

    st = ak.state()
    assert st.hardware is not None
    channels = _state.group.channels = _channel.Channels(st)
    if wire == "device":

        def later(flag: torch.Tensor) -> Any:
            value = bool(flag)
            return lambda: value

        channels.wire = channels.world.wire = _device.DeviceWire(st.device, later, st.hardware.to_device)
    return channels


CHANGES = {  # a call repeated at its point, then made otherwise by rank 1, and what its table says
    "reduce shape": (lambda r: ak.reduce(torch.ones(4 + 4 * r)), ["  - Process 0: float32 [4]",
                                                                   "  - Process 1: float32 [8]"]),
    "reduce op": (lambda r: ak.reduce(torch.ones(4), op=("sum", "max")[r]),
                  ["the processes passed different arguments", "  - Process 1: accelkit.reduce(op='max') float32 [4]"]),
    "gather dtype": (lambda r: ak.gather(torch.ones(4, dtype=(torch.float32, torch.float64)[r])),
                     ["  - Process 0: float32 [4]", "  - Process 1: float64 [4]"]),
    "large reduce shape": (lambda r: ak.reduce(torch.ones(20_000 + r)), ["  - Process 0: float32 [20000]",
                                                                         "  - Process 1: float32 [20001]"]),
}  # fmt: skip


def repeated_then_changed(case: str, wire: str) -> list[Any]:
    """In a worker: a call made three times alike (the later ones run again as planned, nothing described anew),
    then otherwise on rank 1; the table, where each rank raised it, and the calls after it."""
    from accelkit import _state

    call = CHANGES[case][0]
    _over(wire)
    try:
        for _ in range(3):
            call(0)
        try:
            call(ak.rank())
            ak.wait_for_everyone()  # (on the device wire the verdict is read here)
            caught = "nothing"
        except ak.DistributedOperationError as exc:
            caught = str(exc)
        return [caught, ak.reduce(torch.ones(2)).tolist(), ak.reduce(torch.ones(2)).tolist()]
    finally:
        _state.group.channels = None


@pytest.mark.distributed
@pytest.mark.parametrize("wire", ["host", "device"])
@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_call_run_again_that_one_rank_changes_raises_the_table_on_every_rank(
    pool: WorkerPool, case: str, wire: str
) -> None:
    for rank, (caught, after, again) in enumerate(pool.run(repeated_then_changed, case, wire)):
        for line in CHANGES[case][1]:
            assert line in caught, f"rank {rank}: {line!r} not in\n{caught}"
        assert after == again == [2.0, 2.0]


def broadcast_repeated_then_changed(changes: int, wire: str, n: int) -> Any:
    """A broadcast made three times alike, then of another shape on rank ``changes`` (the source or a receiver);
    the receiver finds it, and the source hears of it at its next collective."""
    _over(wire)
    for _ in range(3):
        ak.broadcast(torch.ones(1, n))
    ak.broadcast(torch.ones((1, n) if ak.rank() != changes else (1, 2, n)))
    return ak.gather(torch.zeros(1))


@pytest.mark.distributed
@pytest.mark.parametrize("n", [5, 20_000], ids=["small", "large"])
@pytest.mark.parametrize("wire", ["host", "device"])
@pytest.mark.parametrize("changes", [0, 1], ids=["source", "receiver"])
def test_a_broadcast_run_again_that_one_rank_changes_raises_on_every_rank(
    pool: WorkerPool, changes: int, wire: str, n: int
) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool.run(broadcast_repeated_then_changed, changes, wire, n, task_timeout=60)
    failures = {f.rank: f for f in info.value.failures}
    assert sorted(failures) == [0, 1], info.value
    table = ["Cannot apply accelkit.broadcast: the inputs differ across processes.", f"float32 [1, {n}]",
             f"float32 [1, 2, {n}]"]  # fmt: skip
    for rank, failure in failures.items():
        assert failure.exc_type == "accelkit.errors.DistributedOperationError", failure.message
        assert all(line in failure.message for line in table), f"rank {rank}:\n{failure.message}"
    if changes == 1:  # the source went on unaware: it hears of it at its next collective
        assert failures[0].message.startswith("accelkit.gather #"), failures[0].message
    elif wire == "host":  # every receiver sees that the source sent another call than planned: both compare at once
        assert failures[0].message.startswith("Cannot apply accelkit.broadcast"), failures[0].message
    # (On the device wire a receiver reads it at its next collective and closes the group: the source, which sends
    # its own call meanwhile, fails quoting the receiver's table.)
    assert pool.run(ak.world_size) == [2, 2]


def dataclass_inputs_are_let_go() -> list[bool]:
    """A dataclass's tensors after a collective of it returned, the caller dropped them and the next collective
    began: gone (the structure of the call is remembered, for the next call like it, without the instance it was
    read from)."""
    import dataclasses
    import gc
    import weakref

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: list[torch.Tensor]

    gone = []
    for op in (ak.gather, ak.reduce, ak.broadcast):
        batch = Batch(torch.ones(3), [torch.zeros(2)])
        watched = weakref.ref(batch.x)
        out = op(batch)
        assert type(out) is Batch and out.x is not batch.x
        del batch, out
        ak.wait_for_everyone()  # (a backend call's tensors are let go as the next collective begins)
        gc.collect()
        gone.append(watched() is None)
    return gone


@pytest.mark.distributed
def test_the_tensors_of_a_dataclass_are_not_kept_by_a_collective(pool: WorkerPool) -> None:
    assert pool.run(dataclass_inputs_are_let_go) == [[True] * 3] * 2
