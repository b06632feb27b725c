"""Reliability: one test per promise, each with its time bound, its message (rank, cause) and no process left.

| promise                                                    | here                                        |
| ---------------------------------------------------------- | ------------------------------------------- |
| a mismatched collective raises the table, without debug    | test_a_mismatch_raises_the_table_*          |
| a hang names the rank that never came, and where it is     | test_a_hang_names_the_missing_rank          |
| the default timeout is finite, and said by accelkit env    | test_env_prints_versions_and_sections       |
| save and load without numpy                                | test_checkpoints_need_no_numpy, ..._missing |
| every successful run exits 0, under every launcher         | test_no_gloo_thread_outlives_the_exit_hooks |
|                                                            | test_twenty_runs_exit_cleanly (slow)        |
| workers die with their launcher, also while they start     | test_kill_9_..., test_sigterm_...           |
| signals stop everything                                    |                                             |
| ranks that differ in versions or options refuse to start   | test_ranks_that_differ_refuse_to_start      |
| a lost peer never outranks the rank that died              | test_a_lost_peer_never_outranks_a_death     |
| crash, SIGKILL, restart resume                             | test_a_crash_..., test_a_sigkill_..., ...   |
| kill -9 during a save, corruption, malicious pickle        | test_a_kill_during_..., test_a_damaged_...  |
| rotation, disk full                                        | test_rotation_and_a_full_disk_...           |
| bad config, port in use, a node that never comes           | test_a_bad_launch_stops_before_anything_... |

The scenarios of test_launcher.py, test_checkpoint.py and test_cli_launch.py are reused through
their helpers, once each, with the bounds this suite promises.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import RUNS_OF_TWENTY, alive, subprocess_env

import accelkit as ak
from accelkit._launcher._failures import collect_failures
from accelkit._rundir import lost_peer, record_failure
from accelkit.errors import WorkerFailure
from accelkit.testing import WorkerPool, free_port, run_distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
DOE = "accelkit.errors.DistributedOperationError"


def _wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def session() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts in their own sessions; each session is SIGKILLed afterwards, whatever happened."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()


def _temp_dir(tmp_path: Path) -> str:
    """A temporary directory for a launcher a test kills: a kill -9 leaves its run directory (as torchrun's), here."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    return str(temp)


def _start(session: list[subprocess.Popen[str]], argv: list[str], **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, *argv],
        env=subprocess_env(**env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    session.append(proc)
    return proc


# --- 1. a mismatched collective, without debug mode -----------------------------------------------


def mismatch(case: str) -> Any:
    """In a worker: a collective the two ranks call differently."""
    rank = ak.rank()
    if case == "sizes":  # gloo would abort the process receiving more than it posted
        return ak.reduce(torch.zeros(4 if rank == 0 else 8), op="sum")
    if case == "large sizes":  # beyond one message
        return ak.gather(torch.zeros(300_000 if rank == 0 else 600_000))
    if case == "dtypes":  # the same bytes: gloo would mix float and int bits silently
        return ak.reduce(torch.ones(4, dtype=(torch.float32, torch.int32)[rank]), op="sum")
    if case == "transposed":  # the same size: a silent wrong answer
        return ak.reduce(torch.zeros((2, 4) if rank == 0 else (4, 2)), op="sum")
    if case == "operations":
        return ak.gather(torch.zeros(3)) if rank == 0 else ak.reduce(torch.zeros(3), op="sum")
    if case == "broadcast against gather":  # different backend calls, which would never meet
        return ak.broadcast(torch.zeros(3)) if rank == 0 else ak.gather(torch.zeros(3))
    if case == "two sources":
        return ak.broadcast_object("x", src=rank)
    raise AssertionError(case)


TABLES = {
    "sizes": ["Cannot apply accelkit.reduce: the inputs differ across processes.",
              "  - Process 0: float32 [4]", "  - Process 1: float32 [8]"],
    "large sizes": ["Cannot apply accelkit.gather: the inputs differ across processes.",
                    "  - Process 0: float32 [300000]", "  - Process 1: float32 [600000]"],
    "dtypes": ["  - Process 0: float32 [4]", "  - Process 1: int32 [4]"],
    "transposed": ["  - Process 0: float32 [2, 4]", "  - Process 1: float32 [4, 2]"],
    "operations": ["the processes called different operations.", "  - Process 0: accelkit.gather() float32 [3]",
                   "  - Process 1: accelkit.reduce(op='sum') float32 [3]"],
    "broadcast against gather": ["the processes called different operations.",
                                 "  - Process 0: accelkit.broadcast(src=0) float32 [3]",
                                 "  - Process 1: accelkit.gather() float32 [3]"],
    "two sources": ["  - Process 0: accelkit.broadcast_object(src=0)",
                    "  - Process 1: accelkit.broadcast_object(src=1)"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TABLES))
def test_a_mismatch_raises_the_table_on_every_rank_without_debug_mode(pool: WorkerPool, case: str) -> None:
    started = time.monotonic()
    with pytest.raises(ak.WorkerError) as info:
        pool.run(mismatch, case, task_timeout=60)
    assert time.monotonic() - started < 20, "found in the first message, or by the heartbeat within seconds"
    failures = {f.rank: f for f in info.value.failures}
    assert sorted(failures) == [0, 1] and {f.exc_type for f in failures.values()} == {DOE}, info.value
    for rank, failure in failures.items():
        for line in TABLES[case]:
            assert line in failure.message, f"rank {rank}: {line!r} not in\n{failure.message}"
    assert pool.run(ak.world_size) == [2, 2], "the pool's group goes on (or was started again)"


def broadcast_then_gather() -> Any:
    """A planned broadcast is one-way: the receiver finds the mismatch; the source hears of it at its next
    collective. (The first call at a point of the program is checked both ways; the second plans the third.)"""
    for _ in range(2):
        ak.broadcast(torch.zeros(1, 5))
    ak.broadcast(torch.zeros((1, 5) if ak.rank() == 0 else (1, 2, 5)))
    return ak.gather(torch.zeros(1))


def test_a_broadcast_mismatch_reaches_the_source_at_its_next_collective(pool: WorkerPool) -> None:
    started = time.monotonic()
    with pytest.raises(ak.WorkerError) as info:
        pool.run(broadcast_then_gather, task_timeout=60)
    assert time.monotonic() - started < 20
    failures = {f.rank: f for f in info.value.failures}
    assert {f.exc_type for f in failures.values()} == {DOE} and sorted(failures) == [0, 1], info.value
    table = ["Cannot apply accelkit.broadcast: the inputs differ across processes.",
             "  - Process 0: accelkit.broadcast #", "float32 [1, 5]", "float32 [1, 2, 5]"]  # fmt: skip
    assert all(line in failures[1].message for line in table), failures[1].message
    assert failures[0].message.startswith("accelkit.gather #"), failures[0].message
    assert "process 1 stopped the group first:" in failures[0].message
    assert all(line in failures[0].message for line in table), failures[0].message
    assert pool.run(ak.world_size) == [2, 2]


@pytest.mark.slow
def test_a_launch_whose_ranks_call_different_collectives_ends_promptly(session: list[subprocess.Popen[str]]) -> None:
    # Found by the check before any data moves: both ranks raise the table at once.
    script = str(SCRIPTS / "different_collectives.py")
    proc = _start(session, ["-m", "accelkit", "launch", "-n", "2", "--cpu", script])
    started = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - started < 30 and proc.returncode == 1, err[-3000:]
    assert re.search(r"accelkit: rank [01] failed: accelkit\.errors\.DistributedOperationError: Cannot apply", err)
    for table in ("Cannot apply accelkit.broadcast: the processes called different operations.",
                  "Cannot apply accelkit.gather: the processes called different operations."):  # fmt: skip
        assert table in err, err[-3000:]


# --- 2. a hang names the rank that never came ---------------------------------------------------------


def hang_in(op: str) -> None:
    if ak.rank() == 1:
        time.sleep(6)  # never reaches the collective: rank 0 times out
        return
    if op == "reduce":
        ak.reduce(torch.ones(2), op="sum")
    else:
        ak.wait_for_everyone()


@pytest.mark.slow
@pytest.mark.parametrize(("op", "label"), [("reduce", "reduce"), ("barrier", "wait_for_everyone")])
def test_a_hang_names_the_missing_rank(
    op: str, label: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ACCELKIT_WAIT_LOG_INTERVAL", "1")  # the workers' "still waiting" lines, every second
    with WorkerPool(2, timeout=3.0) as workers:  # collectives wait 3 s
        workers.run(ak.world_size)
        started = time.monotonic()
        with pytest.raises(ak.WorkerError) as info:
            workers.run(hang_in, op, task_timeout=60)
        waited = time.monotonic() - started
    assert waited < 30, f"the timeout fired after {waited:.1f} s"  # 3 s, not the task's 60 s
    first = info.value.failures[0]
    assert first.rank == 0 and first.exc_type == DOE, info.value
    lines = first.message.splitlines()
    assert lines[0].startswith(f"accelkit.{label} #1 failed on process 0 of 2: "), first.message
    assert lines[1] == "process 1 never reached it", first.message
    assert lines[2].startswith("  - process 1: before its first collective, running "), first.message
    assert lines[2].endswith("in hang_in"), "where rank 1 is: the line of hang_in that sleeps"
    assert "wait at most 3 s" in first.message
    headline = str(info.value).splitlines()[0]  # the rank that hangs leads, with where it is
    assert headline.startswith(f"rank 1 never reached accelkit.{label} #1: it is before its first collective"), headline
    assert headline.endswith("in hang_in; rank 0 gave up waiting"), headline
    err = capfd.readouterr().err
    assert re.search(rf"accelkit: rank 0: still waiting for rank 1 at {label} #1 \(\d s\)", err), err[-2000:]


def test_a_timeout_shorter_than_the_wait_line_interval_still_says_whom_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # The "still waiting" lines come every 30 s; a 3 s timeout still gets one, before it fires.
    monkeypatch.delenv("ACCELKIT_WAIT_LOG_INTERVAL", raising=False)
    with WorkerPool(2, timeout=3.0) as workers:
        workers.run(ak.world_size)
        with pytest.raises(ak.WorkerError):
            workers.run(hang_in, "barrier", task_timeout=60)
    err = capfd.readouterr().err
    waiting = re.findall(r"accelkit: rank 0: still waiting for rank 1 at wait_for_everyone #1 \((\d+) s\)\n(.*)", err)
    assert len(waiting) == 1, err[-2000:]
    waited, where = waiting[0]
    assert int(waited) < 3, "the line comes before the timeout"
    assert where.startswith("accelkit: rank 0: - process 1: before its first collective, running "), where
    assert where.endswith("in hang_in"), where


def test_a_rank_that_stays_on_one_line_is_said_to_be_there_since_then() -> None:
    # Its heartbeat publishes when its place changes: a rank asleep on one line is not "last heard" long ago.
    from accelkit._group import Position

    now = time.time()
    asleep = Position(1, "reduce", 1, False, now - 25, "train.py:12 in train", published=now - 20)
    assert asleep.describe(now) == "at reduce #1 (left it 25 s ago), running train.py:12 in train (there for 20 s)"


# --- 3. numpy is optional -------------------------------------------------------------------------

# Runs a script where `import numpy` fails, as on a machine with only accelkit's dependencies.
WITHOUT_NUMPY = "import runpy, sys; sys.modules['numpy'] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0])"

ROUND_TRIP = """
import random, sys, torch
import accelkit as ak
try:
    import numpy
except ImportError:
    numpy = None
assert numpy is None, "numpy must not be importable here"
model = ak.prepare(torch.nn.Linear(3, 2))
ak.set_seed(3)
ak.save_state(sys.argv[1], model=model, step=7)
expected = (random.random(), torch.rand(2).tolist())
values = ak.load_state(sys.argv[1], model=model)
assert values == {"step": 7}, values
assert (random.random(), torch.rand(2).tolist()) == expected, "the RNG states were not restored"
print("ok")
"""

LOAD = """
import sys, torch
import accelkit as ak
model = torch.nn.Linear(3, 2)
try:
    ak.load_state(sys.argv[1], model=model)
except ak.CheckpointError as exc:
    print("refused:", exc)
print("lenient:", ak.load_state(sys.argv[1], model=model, strict=False))
"""


def _python_without_numpy(code: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_NUMPY, str(script), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_checkpoints_need_no_numpy(tmp_path: Path) -> None:
    done = _python_without_numpy(ROUND_TRIP, str(tmp_path / "ckpt"), tmp_path=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "nothing left of a failed save"


def test_numpy_state_where_numpy_is_missing_is_named(tmp_path: Path) -> None:
    pytest.importorskip("numpy")  # this process saves NumPy's state
    ak.save_state(tmp_path / "ckpt", model=torch.nn.Linear(3, 2), step=1)
    done = _python_without_numpy(LOAD, str(tmp_path / "ckpt"), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "holds NumPy's random state, but numpy cannot be imported here" in done.stdout
    assert "pip install numpy, or pass strict=False" in done.stdout
    assert "lenient: {'step': 1}" in done.stdout


# --- 4. every successful run exits 0 ---------------------------------------------------------------

# The root cause, checked deterministically: a gloo group whose threads outlive the atexit hooks is torn
# down with the interpreter, and a thread that takes the GIL then is killed mid-unwind: SIGABRT, now
# and then. This hook is registered first, so it runs last: after accelkit's, before the teardown.
THREADS_AT_TEARDOWN = """
import atexit, os, runpy, sys
def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:
            pass
    return [name for name in names if "gloo" in name]
atexit.register(lambda: print("gloo threads at teardown:", gloo_threads(), flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _plain_run(session: list[subprocess.Popen[str]], argv: list[str]) -> list[tuple[int, str, str]]:
    """Two plain processes with torchrun's variables; each one's (exit code, stdout, stderr)."""
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "ACCELKIT_CPU": "1"}
    procs = [_start(session, argv, RANK=str(rank), LOCAL_RANK=str(rank), **common) for rank in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]


@pytest.mark.parametrize("group", ["formed by accelkit", "formed by the script"])
def test_no_gloo_thread_outlives_the_exit_hooks(group: str, session: list[subprocess.Popen[str]]) -> None:
    script = [str(SCRIPTS / "clean_exit.py"), *(["--user-group"] if group == "formed by the script" else [])]
    for _code, out, err in _plain_run(session, ["-c", THREADS_AT_TEARDOWN, *script]):
        assert "gloo threads at teardown: []" in out, (out, err[-2000:])
        assert "terminate called" not in err


LAUNCHERS = {
    "torchrun": lambda port: ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port],
    "accelkit launch": lambda port: ["-m", "accelkit", "launch", "-n", "2", "--cpu", "--main-process-port", port],
}


@pytest.mark.slow
@pytest.mark.parametrize("runs", RUNS_OF_TWENTY)
@pytest.mark.parametrize("launcher", ["plain processes", *LAUNCHERS])
def test_twenty_runs_exit_cleanly(launcher: str, runs: range, session: list[subprocess.Popen[str]]) -> None:
    # @ak.distributed: test_runs.py::test_twenty_runs_exit_cleanly. Without DDP (whose import
    # of torch._dynamo doubles the time of a run): test_no_gloo_thread_outlives_the_exit_hooks checks DDP.
    # Plain processes form their own group, which accelkit adopts, and which nothing destroyed before.
    script = str(SCRIPTS / "clean_exit.py")
    for run in runs:
        if launcher == "plain processes":
            results = _plain_run(session, [script, "--user-group", "--no-ddp"])
        else:
            done = subprocess.run(
                [sys.executable, *LAUNCHERS[launcher](str(free_port())), script, "--no-ddp"],
                env=subprocess_env(),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=180,
            )
            results = [(done.returncode, done.stdout, done.stderr)]
        assert "total 3" in "".join(out for _, out, _ in results), results
        for code, _, err in results:
            assert code == 0, f"run {run}: exit {code}\n{err[-3000:]}"
            assert "terminate called" not in err, err[-3000:]


# --- 5. workers die with their launcher; signals stop everything ---------------------------------


def _probe_pids(report_dir: Path, proc: subprocess.Popen[str]) -> list[int]:
    """Wait until both ranks and their DataLoader workers reported their pids; those pids."""

    def ready() -> bool:
        return len(list(report_dir.glob("rank*.json"))) == 2 and len(list(report_dir.glob("loader-*.pid"))) == 2

    if not _wait_until(lambda: ready() or proc.poll() is not None, 120) or not ready():
        raise AssertionError(f"the probe did not start: {proc.communicate(timeout=10)[1][-3000:]}")
    ranks = [json.loads(p.read_text())["pid"] for p in report_dir.glob("rank*.json")]
    return ranks + [int(p.read_text()) for p in report_dir.glob("loader-*.pid")]


LIFELINE_PROBES = {
    "accelkit launch": ["-m", "accelkit", "launch", "-n", "2", "--cpu", str(SCRIPTS / "lifeline_probe.py")],
    "@ak.distributed": [str(SCRIPTS / "lifeline_probe.py"), "--distributed"],
}


@pytest.mark.parametrize("launcher", sorted(LIFELINE_PROBES))
def test_kill_9_of_the_launcher_takes_every_worker_along(
    launcher: str, tmp_path: Path, session: list[subprocess.Popen[str]]
) -> None:
    proc = _start(session, LIFELINE_PROBES[launcher], REPORT_DIR=str(tmp_path), TMPDIR=_temp_dir(tmp_path))
    pids = _probe_pids(tmp_path, proc)
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    gone = _wait_until(lambda: not any(alive(pid) for pid in pids), 15)
    elapsed = time.monotonic() - killed
    assert gone and elapsed < 5, f"still alive after {elapsed:.1f} s: {[p for p in pids if alive(p)]}"


def test_kill_9_of_the_launcher_while_its_workers_start_takes_them_along(
    tmp_path: Path, session: list[subprocess.Popen[str]]
) -> None:
    # The workers are still importing the script (as after a slow `import torch`): none has run accelkit's code.
    proc = _start(session, [str(SCRIPTS / "slow_start_probe.py")], REPORT_DIR=str(tmp_path), TMPDIR=_temp_dir(tmp_path))
    if not _wait_until(lambda: len(list(tmp_path.glob("starting-*.pid"))) == 2 or proc.poll() is not None, 120):
        raise AssertionError("the workers did not start")
    pids = [int(p.read_text()) for p in tmp_path.glob("starting-*.pid")]
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    gone = _wait_until(lambda: not any(alive(pid) for pid in pids), 15)
    elapsed = time.monotonic() - killed
    assert gone and elapsed < 5, f"still alive after {elapsed:.1f} s: {[p for p in pids if alive(p)]}"


SIGNALS = [("accelkit launch", signal.SIGTERM), ("@ak.distributed", signal.SIGTERM), ("@ak.distributed", signal.SIGINT)]


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "signum"), SIGNALS)
def test_sigterm_stops_every_rank_and_loader_worker(
    launcher: str, signum: int, tmp_path: Path, session: list[subprocess.Popen[str]]
) -> None:
    temp = _temp_dir(tmp_path)
    proc = _start(session, LIFELINE_PROBES[launcher], REPORT_DIR=str(tmp_path), TMPDIR=temp)
    pids = _probe_pids(tmp_path, proc)
    sent = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert elapsed < 35, f"the launcher took {elapsed:.1f} s (the agent's grace period is 30 s)"
    assert proc.returncode in (128 + signum, -signum), (proc.returncode, err[-3000:])
    left = [name for name in os.listdir(temp) if name.startswith("accelkit-")]  # pymp-*: the killed ranks' loaders
    assert not left, f"the launcher left {left} behind"
    assert _wait_until(lambda: not any(alive(pid) for pid in pids), 5), [p for p in pids if alive(p)]
    if launcher == "accelkit launch":
        assert "a collective that waits" not in err  # said with --debug and by `accelkit env` only
        assert "accelkit: stopped by SIGTERM; every worker was stopped" in err


# --- 6. ranks that differ refuse to start ---------------------------------------------------------

PROBE_STATE = "import accelkit as ak; ak.state(); print('started')"
OLDER_ACCELKIT = "import accelkit._version as v; v.__version__ = '0.0.1'; " + PROBE_STATE


@pytest.mark.parametrize(
    ("code", "env", "expected"),
    [
        (PROBE_STATE, {"ACCELKIT_PRECISION": "bf16"}, "  - rank 1 has precision 'bf16', rank 0 has 'no'"),
        (OLDER_ACCELKIT, {}, "  - rank 1 has accelkit '0.0.1', rank 0 has "),
        (PROBE_STATE, {"ACCELKIT_TP": "2"}, "  - rank 1 has mesh 'dp_replicate=1 dp_shard=-1 tp=2 cp=1', rank 0 has"),
    ],
    ids=["precision", "accelkit version", "mesh"],
)
def test_ranks_that_differ_refuse_to_start(
    code: str, env: dict[str, str], expected: str, session: list[subprocess.Popen[str]]
) -> None:
    port = str(free_port())
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ACCELKIT_CPU": "1"}
    started = time.monotonic()
    ranks = [
        _start(session, ["-c", PROBE_STATE], RANK="0", **common),
        _start(session, ["-c", code], RANK="1", **common, **env),
    ]
    outputs = [proc.communicate(timeout=120) for proc in ranks]
    assert time.monotonic() - started < 60
    for rank, (proc, (out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 1 and "started" not in out, f"rank {rank} started: {err[-2000:]}"
        assert f"accelkit.errors.ConfigurationError: rank {rank}: the processes of this job do not match" in err
        assert expected in err, err[-2000:]


def test_a_checkpoint_from_other_versions_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    ak.save_state(tmp_path / "ckpt", model=torch.nn.Linear(2, 1))
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"it was saved with torch 0\.0\.1; this process runs torch ") as seen:
        ak.load_state(tmp_path / "ckpt", model=torch.nn.Linear(2, 1))
        ak.load_state(tmp_path / "ckpt", model=torch.nn.Linear(2, 1))
    assert len([w for w in seen if "0.0.1" in str(w.message)]) == 1


# --- 7. root cause first ----------------------------------------------------------------------------


def test_a_lost_peer_never_outranks_a_death(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 was SIGKILLed; the agent stamps its death to the whole second, so rank 0's consequent
    # "connection reset" looks earlier. The lost peer comes second all the same.
    killed = WorkerFailure(1, 1, 11, -signal.SIGKILL, "", "", "", timestamp=1000.0)
    lost = WorkerFailure(0, 0, 10, 1, DOE, "Connection reset by peer", "", timestamp=999.6, lost_peer=True)
    assert ak.WorkerError([lost, killed]).ranks == [1, 0]
    # The worker's own report says so: a communication error caused by another rank (rank 0 here).
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # as the agent sets them in its workers
    try:
        raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    except RuntimeError as cause:
        record_failure(cause, run_dir=str(tmp_path))
    later = time.time() + 5  # the agent's stamp of rank 1's death, after rank 0's report
    agent = {1: type("Seen", (), {"exitcode": -signal.SIGKILL, "timestamp": later, "local_rank": 1})()}
    assert collect_failures(str(tmp_path), agent).ranks == [1, 0]


def test_any_gloo_transport_error_is_a_lost_peer() -> None:
    # A rank killed mid-save: its peer's later calls fail with other texts than the first "connection reset".
    for text in (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:412] Socket closed [127.0.0.1]:41234",
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:201] Application timeout caused pair closure",
    ):
        assert lost_peer(RuntimeError(text)), text
        consequence = WorkerFailure(
            0, 0, 10, 1, DOE, text, "", timestamp=999.0, lost_peer=lost_peer(RuntimeError(text))
        )
        killed = WorkerFailure(1, 1, 11, -signal.SIGKILL, "", "", "", timestamp=1000.0)  # stamped after the stop
        assert ak.WorkerError([consequence, killed]).ranks == [1, 0]
    assert not lost_peer(ValueError("bad batch on rank 1"))


def test_a_hang_is_headed_by_the_rank_that_hangs_not_the_one_that_gave_up() -> None:
    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
    message = (
        f"accelkit.reduce #2 failed on process 0 of 2: {gloo}\nprocess 1 never reached it\n"
        "  - process 1: at reduce #1 (left it 6 s ago), running train.py:12 in train\nCollectives wait at most 5 s"
    )
    gave_up = WorkerFailure(0, 0, 10, 1, DOE, message, "", timestamp=1000.0, lost_peer=True)
    stopped = WorkerFailure(1, 1, 11, -signal.SIGTERM, "", "", "", timestamp=1001.0)
    text = str(ak.WorkerError([stopped, gave_up]))
    assert text.splitlines()[0] == (
        "rank 1 never reached accelkit.reduce #2: it is at reduce #1 (left it 6 s ago), running train.py:12 in "
        "train; rank 0 gave up waiting"
    )
    assert text.index(gloo) > text.index("Failures, root cause first:")  # the backend's text comes after


# --- the promises that held before, with this suite's bounds ---------------------------------------


def test_a_crash_is_reported_with_the_rank_and_its_traceback() -> None:
    from test_launcher import fail_on_rank_one

    started = time.monotonic()
    with pytest.raises(ak.WorkerError) as info:
        fail_on_rank_one()
    assert time.monotonic() - started < 30
    assert str(info.value).startswith("rank 1 failed: ValueError: bad batch on rank 1")
    assert 'raise ValueError("bad batch on rank 1")' in str(info.value)


def test_a_sigkill_is_named_and_the_job_ends() -> None:
    from test_launcher import killed_by_signal

    started = time.monotonic()
    with pytest.raises(ak.WorkerError) as info:
        run_distributed(killed_by_signal)
    assert time.monotonic() - started < 30
    assert info.value.ranks[0] == 1 and "died from SIGKILL (killed; out of memory?)" in str(info.value)


def test_a_restarted_job_resumes() -> None:
    from test_launcher import crash_first_attempt

    started = time.monotonic()
    assert run_distributed(crash_first_attempt, max_restarts=1) == [1, 1]
    assert time.monotonic() - started < 60


def test_a_kill_during_a_save_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    from test_checkpoint import in_child, kill_at, save_pair, saved_fill

    from accelkit._checkpoint import _storage

    save_pair(tmp_path / "ckpt", 1.0)

    def crash() -> None:
        _storage.crash_hook = kill_at("mid-file:model.pt")
        save_pair(tmp_path / "ckpt", 2.0)

    started = time.monotonic()
    status = in_child(crash)
    assert os.WTERMSIG(status) == signal.SIGKILL and time.monotonic() - started < 30
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "ckpt" and saved_fill(tmp_path / "ckpt") == 1.0


def test_a_damaged_or_forged_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    from test_checkpoint import Payload, forge, save_pair

    save_pair(tmp_path / "bad", 1.0)
    (tmp_path / "bad" / "model.pt").write_bytes(b"damaged")
    with pytest.raises(ak.CheckpointError, match=r"model\.pt is 7 bytes but the manifest says"):
        ak.load_state(tmp_path / "bad", model=torch.nn.Linear(64, 64))
    marker = tmp_path / "pwned"
    save_pair(tmp_path / "evil", 1.0)
    evil = tmp_path / "evil.pt"
    torch.save({"weight": Payload(str(marker))}, evil)
    forge(tmp_path / "evil", "model.pt", evil.read_bytes())
    with pytest.raises(ak.CheckpointError, match=r"model\.pt was refused"):
        ak.load_state(tmp_path / "evil", model=torch.nn.Linear(64, 64))
    assert not marker.exists(), "code from the checkpoint ran"


def test_rotation_and_a_full_disk_keep_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_checkpoint import save_pair, saved_fill, small_model

    from accelkit._checkpoint import _storage

    for step in (1, 2):
        ak.save_state(tmp_path / f"step-{step}", model=small_model(step), keep_last=1)
    assert os.listdir(tmp_path) == ["step-2"]

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_storage, "_write", full)
    with pytest.raises(ak.CheckpointError, match="no space left on device writing"):
        save_pair(tmp_path / "step-3", 3.0)
    monkeypatch.undo()
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "step-2" and saved_fill(tmp_path / "step-2") == 2.0


@pytest.mark.slow
def test_a_bad_launch_stops_before_anything_starts(tmp_path: Path, session: list[subprocess.Popen[str]]) -> None:
    probe = str(SCRIPTS / "launch_probe.py")
    config = tmp_path / "config.yaml"
    config.write_text("precision: bf61\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    cases = {
        "bad config": (["--config-file", str(config), probe], [f"{config}:1", "precision", "'bf16'"]),
        "port in use": (["--main-process-port", port, probe], [f"master_port={port}: cannot listen there"]),
        "missing node": (
            ["--num-nodes", "2", "--node-rank", "0", "--main-process-ip", "127.0.0.1", "--main-process-port",
             str(free_port()), "--rdzv-timeout", "3", probe],
            ["node rank(s) 1 of 2 did not join the rendezvous", "within 3 s"],
        ),
    }  # fmt: skip
    try:
        for name, (argv, expected) in cases.items():
            started = time.monotonic()
            proc = _start(session, ["-m", "accelkit", "launch", "-n", "2", "--cpu", *argv], REPORT_DIR=str(tmp_path))
            _, err = proc.communicate(timeout=60)
            assert time.monotonic() - started < 30, name
            assert proc.returncode in (1, 2) and all(part in err for part in expected), (name, err[-2000:])
            assert "Traceback" not in err and not list(tmp_path.glob("rank*.json")), name
    finally:
        busy.close()
