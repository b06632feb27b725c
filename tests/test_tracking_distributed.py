"""Tracking and progress bars with 2 real gloo processes: only rank 0 writes, other ranks never sync."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import subprocess_env

import accelkit as ak
from accelkit.testing import WorkerPool, run_distributed

ROOT = Path(__file__).parent.parent
HAS_TENSORBOARD = __import__("importlib").util.find_spec("tensorboard") is not None


def _both_ranks_log(project_dir: str) -> tuple[tuple[str, ...], str, bool]:
    with ak.init_trackers("two", {"world": ak.world_size()}, log_with="csv,jsonl", project_dir=project_dir) as run:
        for step in range(3):
            ak.log({"loss": torch.tensor(float(step)), "rank": ak.rank()}, step=step)
        writer = ak.get_tracker("csv")
    return run.names, str(run.directory), writer is None


@pytest.mark.distributed
def test_only_rank_0_writes_one_run(pool: WorkerPool, tmp_path: Path) -> None:
    (names0, dir0, none0), (names1, dir1, none1) = pool.run(_both_ranks_log, str(tmp_path))
    assert names0 == ("csv", "jsonl") and names1 == ()
    assert dir0 == dir1 == str(tmp_path / "two")
    assert (none0, none1) == (False, True)  # get_tracker: None on other ranks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["config.json", "metrics.csv", "metrics.jsonl"]
    with (tmp_path / "two" / "metrics.csv").open(newline="") as f:
        assert list(csv.reader(f)) == [
            ["run", "step", "loss", "rank"],
            ["1", "0", "0.0", "0"],
            ["1", "1", "1.0", "0"],
            ["1", "2", "2.0", "0"],
        ]
    assert json.loads((tmp_path / "two" / "config.json").read_text()) == {"world": 2}


def _rank_1_logs_alone(project_dir: str) -> tuple[list[int], str]:
    ak.init_trackers("alone", log_with="jsonl", project_dir=project_dir)
    outcome = "returned"
    if ak.rank() == 1:
        # Rank 0 makes no call meanwhile: a collective here would pair with the gather below and fail.
        for step in range(200):
            ak.log({"loss": torch.tensor(1.0), "text": "not a number"}, step=step)  # never even read here
    else:
        try:
            ak.log({"loss": torch.tensor(1.0), "text": "not a number"}, step=0)
        except TypeError as exc:
            outcome = str(exc)
    gathered = ak.gather(torch.tensor([ak.rank()]))
    return gathered.tolist(), outcome


@pytest.mark.distributed
def test_other_ranks_return_at_once_without_a_collective_or_reading_values(pool: WorkerPool, tmp_path: Path) -> None:
    (gathered0, outcome0), (gathered1, outcome1) = pool.run(_rank_1_logs_alone, str(tmp_path))
    assert gathered0 == gathered1 == [0, 1]
    assert outcome1 == "returned"
    assert "'text' is a str ('not a number')" in outcome0
    assert not (tmp_path / "alone" / "metrics.jsonl").read_text()


def _draw_a_bar() -> str:
    before, sys.stderr = sys.stderr, io.StringIO()
    try:
        bar = ak.progress(range(4), desc=f"bar-of-rank{ak.rank()}", mininterval=0)
        for _ in bar:
            bar.set_postfix(loss=0.5)  # the bar's methods work on every rank
        bar.close()
        # Accelerate's scripts: tqdm(range(max_train_steps)), moved by hand after each optimizer step.
        steps = ak.progress(range(6), desc=f"steps-of-rank{ak.rank()}", mininterval=0)
        steps.update(2)  # resumed after 2 steps
        for _ in range(4):
            steps.update(1)
        steps.close()
        return sys.stderr.getvalue()
    finally:
        sys.stderr = before


@pytest.mark.distributed
def test_progress_draws_on_the_local_main_process_only(pool: WorkerPool) -> None:
    if __import__("importlib").util.find_spec("tqdm") is None:
        pytest.skip("needs tqdm")
    err0, err1 = pool.run(_draw_a_bar)
    assert "bar-of-rank0" in err0 and "4/4" in err0
    assert "steps-of-rank0" in err0 and "6/6" in err0
    assert err1 == ""


def _crash_on_rank_1(project_dir: str, rank_0_waits: str) -> None:
    names = "tensorboard,csv,jsonl" if HAS_TENSORBOARD else "csv,jsonl"
    # The writer's own timers would keep the events for an hour: only ak.log's flush can save them.
    kwargs = {"tensorboard": {"flush_secs": 3600, "max_queue": 1000}} if HAS_TENSORBOARD else None
    ak.init_trackers("crash", log_with=names, project_dir=project_dir, init_kwargs=kwargs)
    for step in range(4):
        ak.log({"loss": 1.0 / (step + 1)}, step=step)
    ak.wait_for_everyone()
    if ak.rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if rank_0_waits == "in a collective":
        ak.wait_for_everyone()  # gloo sees rank 1 gone: rank 0 fails too, and its trackers are closed
    else:
        time.sleep(120)  # the agent stops rank 0 with SIGTERM: no Python code runs, only ak.log's flushes count


@pytest.mark.distributed
@pytest.mark.parametrize("rank_0_waits", ["in a collective", "asleep"])
def test_a_crash_on_rank_1_leaves_rank_0s_files_flushed_and_readable(tmp_path: Path, rank_0_waits: str) -> None:
    with pytest.raises(ak.WorkerError, match="rank 1 fails on purpose") as caught:
        run_distributed(_crash_on_rank_1, (str(tmp_path), rank_0_waits), timeout=60)
    assert caught.value.failures[0].rank == 1
    run = tmp_path / "crash"
    assert (run / "metrics.csv").read_text().splitlines() == [
        "run,step,loss",
        "1,0,1.0",
        "1,1,0.5",
        "1,2,0.3333333333333333",
        "1,3,0.25",
    ]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("loss")] == [
            (0, 1.0),
            (1, 0.5),
            (2, pytest.approx(1 / 3)),
            (3, 0.25),
        ]


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "accelkit", "launch", "-n", "2", "--cpu", "--log-with", "csv"]
    command += ["--project-dir", str(tmp_path), str(ROOT / "tests" / "scripts" / "tracking_probe.py"), *args]
    return subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_under_accelkit_launch_the_flag_picks_the_tracker_and_one_bar_is_drawn(tmp_path: Path) -> None:
    done = _launch(tmp_path)
    assert done.returncode == 0, done.stderr
    if __import__("importlib").util.find_spec("tqdm") is not None:
        assert "bar-of-rank0" in done.stderr and "3/3" in done.stderr
    assert "bar-of-rank1" not in done.stderr
    rows = (tmp_path / "probe" / "metrics.csv").read_text().splitlines()
    assert rows == ["run,step,loss,rank", "1,0,1.0,0", "1,1,0.5,0", "1,2,0.3333333333333333,0"]
