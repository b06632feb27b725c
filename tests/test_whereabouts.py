"""Every failure says where each rank was: a peer that left the group (and after which collective), a backend
abort explained by the collective one rank reached alone (from the stacks and records the ranks left)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from processes import subprocess_env

import accelkit as ak
from accelkit._group import Position
from accelkit._launcher._explain import explain
from accelkit._rundir import Spot
from accelkit.errors import WorkerFailure
from accelkit.testing import run_distributed


def reduce_after_the_peer_returned() -> str:
    for _ in range(3):
        ak.reduce(torch.ones(2))
    if ak.rank() == 1:
        return "left"  # the peer's code returns, and its process ends
    try:
        ak.reduce(torch.ones(2))
    except ak.DistributedOperationError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_a_peer_that_left_is_said_to_be_gone_after_its_last_collective() -> None:
    results = run_distributed(reduce_after_the_peer_returned, num_processes=2)
    message = results[0]
    assert "accelkit.reduce #4 failed on process 0 of 2" in message, message
    assert "process 1: gone: its code returned (after reduce #3)" in message, message
    assert "before its first collective" not in message


ABORT = """
import torch, accelkit as ak
from torch.utils.data import DataLoader, TensorDataset

@ak.distributed(num_processes=2, timeout=90)
def main():
    data = TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = ak.prepare(model, optimizer, DataLoader(data, batch_size=8))
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        ak.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 5 and ak.is_main_process():
            ak.reduce(loss.detach())  # reached by rank 0 alone: it meets rank 1's gradient all-reduce in gloo
    return 0

if __name__ == "__main__":
    main()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_backend_abort_is_explained_by_the_collective_one_rank_reached_alone(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(ABORT))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    error = done.stderr[done.stderr.index("accelkit.errors.WorkerError: ") :]
    headline = error.splitlines()[0]
    # gloo aborts rank 1 ("Received data size doesn't match"), or rank 0's heartbeat finds the deadlock first
    assert ("ak.reduce at" in headline and "job.py:17 in main was reached by rank 0 alone" in headline) or (
        "Cannot complete accelkit.reduce #1" in headline and "process 0 alone reached it" in headline
    ), error
    assert "ak.backward at" in error and "job.py:13 in main" in error, error
    assert took < 45, f"{took:.0f} s"


def _failure(rank: int, exitcode: int, exc_type: str = "", lost_peer: bool = False) -> WorkerFailure:
    return WorkerFailure(rank, rank, 100 + rank, exitcode, exc_type, "", "", 1000.0 + rank, lost_peer)


def test_the_explanation_needs_a_death_in_the_backend_and_ranks_out_of_step() -> None:
    reduce, backward = Spot("ak.reduce", "t.py:16 in main"), Spot("ak.backward", "t.py:14 in main")
    aborted = [_failure(1, -6), _failure(0, -15)]
    said = explain(aborted, {0: reduce, 1: backward}, {})
    assert said.startswith("ak.reduce at t.py:16 in main was reached by rank 0 alone"), said
    assert "rank 1 was in ak.backward at t.py:14 in main (a backward that all-reduces gradients" in said
    assert explain(aborted, {0: reduce, 1: reduce}, {}) == ""  # in step: nothing to explain
    assert explain([_failure(1, 1, "ValueError"), _failure(0, -15)], {0: reduce, 1: backward}, {}) == ""
    # Without a stack, the heartbeat's last position says where a rank was.
    now = time.time()
    waiting = Position(0, "gather", 7, True, now, "t.py:30 in evaluate", now)
    computing = Position(1, "gather", 6, False, now, "t.py:28 in evaluate", now)
    said = explain(aborted, {}, {0: waiting, 1: computing})
    assert said.startswith("ak.gather at t.py:30 in evaluate was reached by rank 0 alone"), said
    assert "rank 1 was in t.py:28 in evaluate" in said


def test_a_deadlock_is_declared_only_on_proof() -> None:
    """The verdict needs every other rank where it cannot go on: another collective, a pass that needs every
    rank (``blocked``), or gone. A rank in its forward (busy, or idle on I/O) or in its own code is waited for."""
    from accelkit._group._board import find_deadlock

    now = time.time()
    waiting = Position(0, "reduce", 7, True, now - 20, "t.py:42 in main", now - 20, "f00d", "accelkit.reduce()")

    def other(**fields: object) -> Position:
        base = {"rank": 1, "op": "reduce", "seq": 6, "inside": False, "since": now - 20, "where": "t.py:38 in main",
                "published": now - 20}  # fmt: skip
        return Position(**{**base, **fields})  # type: ignore[arg-type]

    def verdict(peer: Position) -> str:
        return find_deadlock(0, 7, "f00d", {0: waiting, 1: peer}, 2, 8.0)

    for proof in (
        other(doing="a backward pass that all-reduces gradients", blocked=True),
        other(op="gather", seq=7, inside=True, signature="beef"),  # another collective as #7
        other(gone="it raised ValueError: bad batch"),
    ):
        said = verdict(proof)
        assert said.startswith("Cannot complete accelkit.reduce #7 (t.py:42 in main): process 0 alone reached it"), said
    for maybe_working in (
        other(doing="a forward pass (it may wait for the other processes)"),  # computing, or waiting for I/O
        other(),  # the script's own code between collectives
    ):
        assert verdict(maybe_working) == ""
    assert find_deadlock(0, 7, "f00d", {0: waiting}, 2, 8.0) == ""  # a rank not heard from: no proof
    recent = waiting._replace(since=now - 2)
    assert find_deadlock(0, 7, "f00d", {0: recent, 1: other(gone="its code returned")}, 2, 8.0) == ""  # too soon
