"""A job is ended early only on proof that no rank can go on; a rank that may still be working is waited for.

Each test runs a 2-process job (``@ak.distributed``) in a process of its own, with a collective timeout
of 90 s: a job the heartbeat does not end would take that long (and fail the time check). The proof cases:
a collective that only some ranks reach, inside a loop (the others wait in DDP's own synchronisation, or in a
backward that all-reduces gradients). The cases to wait for: a rank that computes a long forward, and one
whose forward waits for I/O (idle, as a fetch from slow storage is) while the other waits in a collective,
during evaluation and during training with gradient accumulation.
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

# One rank's forward waits for I/O once (idle: a fetch from slow storage) while the other waits in a collective.
IO_SCRIPT = """
import time, torch, accelkit as ak
from torch.utils.data import DataLoader, TensorDataset

class Fetching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.fetched = False

    def forward(self, x):
        if ak.rank() == 1 and self.training == (MODE == "train") and not self.fetched:
            self.fetched = True
            time.sleep(IO_SECONDS)  # the process is idle
        return self.lin(x)

@ak.distributed(num_processes=2, timeout=90)
def run() -> str:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    model = Fetching()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = ak.prepare(model, optimizer, DataLoader(data, batch_size=8))
    losses = []
    for x, y in loader:
        with ak.accumulate(model, steps=2):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            ak.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(ak.reduce(loss.detach(), op="mean").item())  # every micro-step, as a progress bar would
    model.eval()
    predictions = []
    with torch.no_grad():
        for x, _ in loader:
            predictions.append(ak.gather_for_metrics(model(x).argmax(-1)))
    weight = ak.unwrap(model).lin.weight.detach()
    same = ak.reduce(weight, op="max").sum().item() == weight.sum().item()  # every rank's weights, alike
    return f"done {len(losses)} {sum(len(p) for p in predictions)} {same}"

if __name__ == "__main__":
    print(run())
"""


def _run(tmp_path: Path, head: str, script: str) -> tuple[subprocess.CompletedProcess[str], float]:
    path = tmp_path / "job.py"
    path.write_text(head + textwrap.dedent(script))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(path)], env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    return done, time.monotonic() - start


def run(tmp_path: Path, *, one_rank: bool, train: bool = True, busy: float = 0.0) -> tuple[str, float]:
    done, took = _run(tmp_path, f"ONE_RANK, TRAIN, BUSY_RANK_1 = {one_rank}, {train}, {busy}\n", SCRIPT)
    return done.stdout + done.stderr, took


def test_a_collective_only_the_main_process_reaches_fails_in_seconds_with_the_table(tmp_path: Path) -> None:
    """`if ak.is_main_process(): ak.reduce(x)` in a training loop: rank 1 waits in DDP's next pass, for ever."""
    out, took = run(tmp_path, one_rank=True)
    assert took < 45, f"took {took:.0f} s:\n{out}"  # the heartbeat, not the 90 s timeout
    first = out.splitlines()[0]
    assert first.startswith("rank 0 failed: accelkit.errors.DistributedOperationError: Cannot complete"), out
    for part in ("accelkit.reduce #1", "job.py:22 in train", "process 0 alone reached it"):  # the call, line, rank
        assert part in first, out
    assert "- Process 0: accelkit.reduce(op='sum')" in out
    assert "- Process 1: before its first collective, in DDP's forward, synchronising" in out
    assert "job.py:18" in out and "Fix: every process must call the same collectives in the same order" in out


def test_a_rank_that_computes_a_long_forward_is_waited_for(tmp_path: Path) -> None:
    """Rank 0 waits in a collective while rank 1 computes a 20 s forward (busy): no deadlock, the job ends well."""
    done, took = _run(tmp_path, "ONE_RANK, TRAIN, BUSY_RANK_1 = False, False, 20.0\n", SCRIPT)
    assert done.stdout.strip().endswith("done"), done.stdout + done.stderr
    assert "Cannot complete" not in done.stderr and took >= 20


@pytest.mark.parametrize("mode", ["evaluate", "train"])
def test_a_forward_that_waits_for_io_is_waited_for(tmp_path: Path, mode: str) -> None:
    """Rank 1's forward sleeps 20 s (idle, as an I/O wait is) while rank 0 waits in ak.gather_for_metrics
    (evaluating) or ak.reduce (training, with accumulation): the job ends well, with every result."""
    done, took = _run(tmp_path, f"MODE, IO_SECONDS = {mode!r}, 20\n", IO_SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "done 4 64 True", done.stdout  # 4 batches, 64 samples, weights
    assert "still waiting" not in done.stderr or "in a forward pass (it may wait" in done.stderr
    assert took >= 20
