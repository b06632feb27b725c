"""The examples the README tells users to run still work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import subprocess_env

EXAMPLES = Path(__file__).parent.parent / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    del env["ACCELKIT_CPU"]  # the examples use what the machine has: every GPU, else 2 CPU processes
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
def test_digits_example_reaches_95_percent_on_what_the_machine_has(tmp_path: Path) -> None:
    for needed in ("sklearn", "tqdm", "tensorboard"):  # find_spec: importing sklearn here would set env variables
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"needs the examples extra ({needed})")
    done = _run(str(EXAMPLES / "digits.py"), "--epochs", "8", "--project-dir", str(tmp_path))  # every GPU, else 2 CPU
    assert done.returncode == 0, done.stderr
    assert "on 360 samples" in done.stderr  # gather_for_metrics: exactly the test set
    accuracy = float(done.stdout.strip().rsplit(" ", 1)[-1])
    assert accuracy >= 0.95
    rows = (tmp_path / "digits" / "metrics.csv").read_text().splitlines()  # rank 0's curves
    assert rows[0] == "run,step,train/loss,train/lr,eval/accuracy,epoch" and rows[-1].endswith(",8")
    assert float(rows[-1].split(",")[4]) == pytest.approx(accuracy, abs=1e-3)  # printed with 3 decimals
    assert list((tmp_path / "digits").glob("events.out.tfevents.*"))


@pytest.mark.distributed
def test_pi_example_runs_on_what_the_machine_has() -> None:
    done = _run(str(EXAMPLES / "pi.py"), "--darts", "200000")
    assert done.returncode == 0, done.stderr
    processes = torch.cuda.device_count() or 2  # as the example counts (torch makes no CUDA context for it)
    assert all(f"rank {r}:" in done.stderr for r in range(processes)), done.stderr
    assert f"rank {processes}:" not in done.stderr
    assert all(done.stderr.index(f"rank {r - 1}:") < done.stderr.index(f"rank {r}:") for r in range(1, processes))
    estimate = float(done.stdout.strip().rsplit(" ", 1)[-1])
    assert abs(estimate - 3.1416) < 0.05


@pytest.mark.distributed
def test_pi_example_takes_a_process_count_and_the_cpu_flag() -> None:
    done = _run(str(EXAMPLES / "pi.py"), "--darts", "30000", "--cpu", "--num-processes", "3")
    assert done.returncode == 0, done.stderr
    assert all(f"rank {r}:" in done.stderr for r in range(3))


def _examples_extra() -> None:
    if importlib.util.find_spec("sklearn") is None:  # find_spec: importing sklearn here would set env variables
        pytest.skip("needs the examples extra (sklearn)")


@pytest.mark.distributed
def test_local_sgd_example_averages_every_8_steps_and_learns() -> None:
    _examples_extra()
    done = _run(str(EXAMPLES / "local_sgd.py"), "--epochs", "5", "--cpu")  # 2 CPU processes
    assert done.returncode == 0, done.stderr
    # 23 steps an epoch (1,437 samples, 2 x 32 a step): averages after steps 8 and 16, and leaving the block.
    assert "115 optimizer steps per process, 15 parameter averages" in done.stdout
    assert float(done.stdout.strip().rsplit(" ", 1)[-1]) >= 0.9


@pytest.mark.distributed
@pytest.mark.slow
def test_local_sgd_example_with_a_power_sgd_hook_learns() -> None:
    _examples_extra()
    done = _run(str(EXAMPLES / "local_sgd.py"), "--epochs", "5", "--cpu", "--comm-hook", "power_sgd")
    assert done.returncode == 0, done.stderr
    assert "115 gradient all-reduces (power_sgd hook)" in done.stdout
    assert float(done.stdout.strip().rsplit(" ", 1)[-1]) >= 0.9
