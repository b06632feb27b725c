"""A collective that only some ranks reach, inside a loop, fails the job in seconds with every rank's position.

Each test runs a 2-process job (``@ak.distributed``) in a process of its own, with a collective timeout
of 90 s: a job the heartbeat does not end would take that long (and fail the time check).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import subprocess_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = """
import sys, time, torch, accelkit as ak

class Slow(torch.nn.Linear):
    def forward(self, x):
        if ak.rank() == 1 and BUSY_RANK_1 and not hasattr(self, "slow_once"):
            self.slow_once = True
            end = time.process_time() + BUSY_RANK_1
            while time.process_time() < end:  # a long first forward that computes: busy, not waiting
                torch.ones(64, 64) @ torch.ones(64, 64)
        return super().forward(x)

@ak.distributed(num_processes=2, timeout=90)
def train() -> str:
    model = ak.prepare(Slow(4, 1))
    for i in range(3):
        loss = model(torch.ones(8, 4)).sum()
        if TRAIN:
            ak.backward(loss)
        if ak.is_main_process() or not ONE_RANK:
            ak.reduce(loss.detach())
    return "done"

if __name__ == "__main__":
    try:
        print(train())
    except ak.WorkerError as exc:
        print(exc)
"""


def run(tmp_path: Path, *, one_rank: bool, train: bool = True, busy: float = 0.0) -> tuple[str, float]:
    script = tmp_path / "job.py"
    head = f"ONE_RANK, TRAIN, BUSY_RANK_1 = {one_rank}, {train}, {busy}\n"
    script.write_text(head + textwrap.dedent(SCRIPT))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    return done.stdout + done.stderr, time.monotonic() - start


def test_a_collective_only_the_main_process_reaches_fails_in_seconds_with_the_table(tmp_path: Path) -> None:
    """`if ak.is_main_process(): ak.reduce(x)` in a training loop: rank 1 waits in DDP's next pass, for ever."""
    out, took = run(tmp_path, one_rank=True)
    assert took < 45, f"took {took:.0f} s:\n{out}"  # the heartbeat, not the 90 s timeout
    assert "rank 0 failed: accelkit.errors.DistributedOperationError: Cannot complete accelkit.reduce #1" in out, out
    assert "- Process 0: accelkit.reduce(op='sum')" in out
    assert "- Process 1: before its first collective, in a forward or backward pass that waits" in out
    assert "job.py:" in out and "Fix: every process must call the same collectives in the same order" in out


def test_a_rank_that_computes_a_long_forward_is_waited_for(tmp_path: Path) -> None:
    """Rank 0 waits in a collective while rank 1 computes a 20 s forward (busy): no deadlock, the job ends well."""
    out, took = run(tmp_path, one_rank=False, train=False, busy=20.0)
    assert out.strip().endswith("done"), out
    assert "Cannot complete" not in out and took >= 20
