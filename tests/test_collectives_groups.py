"""Collectives over a process group (``group=``), on 4 gloo processes: each group checked with its own sequence.

The groups are the rows ({0, 1}, {2, 3}) and columns ({0, 2}, {1, 3}) of a 2 x 2 mesh, made once per
process group of the pool. Results are compared with values computed from every rank's input; a
disagreement inside a group is raised, with its table, by that group's ranks only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from meshes import row_and_column

import accelkit as ak
from accelkit.testing import WorkerPool

pytestmark = pytest.mark.distributed

DEBUG_ERROR = "accelkit.errors.DistributedOperationError"


def interleaved() -> list[Any]:
    """Calls over the row, the column and every process, interleaved, each group's count of calls its own."""
    mesh, rank = row_and_column(), ak.rank()
    x = torch.tensor([float(rank)])
    out: list[Any] = []
    for i in range(3):
        for _ in range(1 + rank // 2):  # the rows make different numbers of calls: each has its own count
            assert ak.reduce(x, op="max", group=mesh["row"]).item() == (1.0 if rank < 2 else 3.0)
        out.append(ak.gather(x, group=mesh["row"]).tolist())
        out.append(ak.reduce(x, op="mean", group=mesh["row"]).tolist())
        out.append(ak.reduce({"n": torch.tensor([rank + i])}, group=mesh["column"])["n"].tolist())
        out.append(ak.broadcast(x + i, src=(0, 1)[rank % 2] if i % 2 else (2, 3)[rank % 2], group=mesh["column"]))
        out[-1] = out[-1].tolist()
        out.append(ak.reduce(x).tolist())  # every process
    out.append(ak.gather_object({"rank": rank}, group=mesh["column"]))
    out.append(ak.broadcast_object(f"from {rank}", src=2 * (rank // 2), group=mesh["row"]))
    out.append(ak.pad_across_processes(torch.ones(1 + rank), group=mesh["row"]).tolist())
    out.append(ak.gather(torch.tensor([rank]), group="dp").tolist())  # no mesh: "dp" is every process
    return out


def test_calls_over_rows_columns_and_every_process_interleave(pool4: WorkerPool) -> None:
    for rank, out in enumerate(pool4.run(interleaved)):
        row, column = (0, 1) if rank < 2 else (2, 3), (0, 2) if rank % 2 == 0 else (1, 3)
        expected: list[Any] = []
        for i in range(3):
            source = (column[0] if i % 2 else column[1]) + i
            expected += [[float(r) for r in row], [sum(row) / 2], [sum(column) + 2 * i], [float(source)], [6.0]]
        expected.append([{"rank": r} for r in column])
        expected.append(f"from {row[0]}")
        expected.append([1.0] * (1 + rank) + [0.0] * (row[1] - rank))
        expected.append([0, 1, 2, 3])
        assert out == expected, f"rank {rank}"


def disagree_in_a_row() -> str:
    """Processes 0 and 1 pass different shapes over their row; 2 and 3 agree over theirs."""
    mesh, rank = row_and_column(), ak.rank()
    ak.reduce(torch.ones(2), group=mesh["row"])  # a plan at this point
    ak.reduce(torch.ones(2), group=mesh["row"])
    shape = 2 + (rank == 1)
    return str(ak.gather(torch.zeros(shape), group=mesh["row"]).tolist())


def test_a_disagreement_inside_a_group_is_raised_by_its_processes_with_their_table(pool4: WorkerPool) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool4.run(disagree_in_a_row, task_timeout=60)
    failures = {f.rank: f for f in info.value.failures}
    assert sorted(failures) == [0, 1], info.value  # the other row's gather went through
    for rank, failure in failures.items():
        assert failure.exc_type == DEBUG_ERROR
        lines = failure.message.splitlines()
        assert lines[0] == (
            "Cannot apply accelkit.gather over the process group of processes 0, 1: the inputs differ across processes."
        ), f"rank {rank}: {failure.message}"
        assert lines[1:3] == ["  - Process 0: float32 [2]", "  - Process 1: float32 [3]"]
    assert pool4.run(interleaved)[0][0] == [0.0, 1.0]  # the groups are still in step


def bad_groups(case: str) -> Any:
    mesh = row_and_column()
    if case == "name":
        return ak.gather(torch.zeros(1), group="tp")
    if case == "type":
        return ak.reduce(torch.zeros(1), group=3)  # type: ignore[arg-type]
    if case == "outsider":
        group = dist.new_group([0, 1])  # every process makes it; 2 and 3 are not in it
        return ak.gather(torch.zeros(1), group=group) if ak.rank() >= 2 else None
    return ak.broadcast(torch.zeros(1), src=1, group=mesh["column"])  # src 1 is in no column of 0 and 2


@pytest.mark.parametrize(
    ("case", "ranks", "kind", "words"),
    [
        ("name", [0, 1, 2, 3], "ValueError", ["group='tp'", "'dp_shard'", "dp_shard, dp_replicate and tp options"]),
        ("type", [0, 1, 2, 3], "TypeError", ["group=3", "ProcessGroup", "'dp'"]),
        ("outsider", [2, 3], "ValueError", ["process ", "is not in the process group passed as group=", "new_group"]),
        ("src", [0, 2], "ValueError", ["src=1", "global rank", "the processes 0, 2"]),
    ],
)
def test_a_group_the_process_cannot_use_is_refused(
    pool4: WorkerPool, case: str, ranks: list[int], kind: str, words: list[str]
) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool4.run(bad_groups, case, task_timeout=60)
    failures = {f.rank: f for f in info.value.failures if f.rank in ranks}
    assert sorted(failures) == ranks, info.value
    for failure in failures.values():
        assert failure.exc_type.endswith(kind), failure
        for word in words:
            assert word in failure.message, failure.message


def test_one_process_checks_a_mesh_dimension_name() -> None:
    x = torch.zeros(2)
    assert ak.gather(x, group="dp") is x
    with pytest.raises(ValueError, match=r"group='tp'.*no device mesh.*'dp', 'dp_replicate', 'dp_shard', 'tp'"):
        ak.reduce(x, group="tp")
    with pytest.raises(TypeError, match=r"group=\[0, 1\]: expected None"):
        ak.broadcast(x, group=[0, 1])  # type: ignore[arg-type]
