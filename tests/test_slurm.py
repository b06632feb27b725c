"""A real SLURM: srun starts the ranks itself, the SLURM guide's sbatch script runs `accelkit launch`,
scancel leaves no process behind, and a failing rank's report lands in the job's output file."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import ROOT, alive, subprocess_env
from slurm import Cluster, Unavailable, cluster, job_processes, why_not

from accelkit.testing import free_port

SCRIPTS = Path(__file__).parent / "scripts"
_WHY_NOT = why_not()

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.skipif(bool(_WHY_NOT), reason=str(_WHY_NOT))]


@pytest.fixture(scope="session")
def slurm() -> Iterator[Cluster]:
    """A one-node cluster for the session; the tests skip with the daemons' logs when it does not start."""
    with contextlib.ExitStack() as stack:
        try:
            running = stack.enter_context(cluster())
        except Unavailable as exc:
            pytest.skip(f"SLURM did not start on this machine: {exc}")
        yield running


def readme_sbatch_script() -> str:
    """The sbatch script of the SLURM guide (docs/guides/slurm.md), as a user would copy it."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "guides" / "slurm.md").read_text(), re.DOTALL)
    [script] = [b for b in blocks if "#SBATCH" in b]
    return script


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The reference: the training script launched by hand with 2 processes, no SLURM."""
    out = tmp_path_factory.mktemp("by-hand")
    argv = [sys.executable, "-m", "accelkit", "launch", "--cpu", "-n", "2", str(SCRIPTS / "ddp_train.py")]
    done = subprocess.run(argv, env=subprocess_env(REPORT_DIR=str(out)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "params.pt")


def _submit(slurm: Cluster, folder: Path, *args: str) -> tuple[str, Path]:
    """``sbatch --nodes=1`` of the SLURM guide's script in ``folder``, 2 processes; the job id and its output file."""
    (folder / "train.sbatch").write_text(readme_sbatch_script())
    (folder / "train.py").symlink_to(SCRIPTS / "ddp_train.py")
    (folder / "accelkit.yaml").write_text("num_processes: 2\ncpu: true\n")
    config = str(folder / "accelkit.yaml")
    env = slurm.env(REPORT_DIR=str(folder), ACCELKIT_CONFIG_FILE=config, MAIN_PORT=str(free_port()))
    argv = ["sbatch", "--parsable", "--nodes=1", "train.sbatch", *args]
    job = subprocess.run(argv, env=env, cwd=folder, capture_output=True, text=True, timeout=30, check=True).stdout
    job = job.strip().split(";")[0]
    return job, folder / f"train-{job}.out"


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_srun_starts_the_ranks_of_one_job_without_a_launcher_of_ours(slurm: Cluster, tmp_path: Path) -> None:
    argv = ["srun", "-n", "2", sys.executable, str(SCRIPTS / "slurm_job.py")]
    env = slurm.env(MASTER_PORT=str(free_port()))
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert (report["world_size"], report["launcher"], report["gathered"]) == (2, "slurm", [0, 1]), report
        # slurmstepd started each rank: no accelkit launcher, no elastic agent in between.
        assert (report["parent"], report["launched_by"]) == ("slurmstepd", None), report
    assert reports[0]["pid"] != reports[1]["pid"]


def test_the_readme_sbatch_script_trains_like_a_launch_by_hand(
    slurm: Cluster, by_hand: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    job, output = _submit(slurm, tmp_path)
    fields = slurm.wait(job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _output(output)[-3000:]
    assert "step 6" in _output(output)
    trained = torch.load(tmp_path / "params.pt")
    assert trained.keys() == by_hand.keys()
    for name, value in by_hand.items():
        assert torch.equal(trained[name], value), name


def test_scancel_stops_every_process_of_the_job(slurm: Cluster, tmp_path: Path) -> None:
    job, output = _submit(slurm, tmp_path, "steps=100000", "pause=0.2")
    deadline = time.monotonic() + 120
    while "step 2\n" not in _output(output):
        assert time.monotonic() < deadline and slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), _output(output)
        time.sleep(0.2)
    running = job_processes(job)
    commands = list(running.values())
    # The batch shell, srun, `accelkit launch` and its two workers, at least.
    assert sum("accelkit._cli._worker train.py" in c for c in commands) == 2, commands
    assert any(" launch --num-nodes 1 --node-rank 0" in c for c in commands), commands
    assert any("slurm_script" in c for c in commands), commands
    slurm.run(["scancel", job])
    fields = slurm.wait(job, timeout=60)
    assert fields["JobState"] == "CANCELLED", fields
    left = {pid: command for pid, command in running.items() if alive(pid)}
    assert not left, left
    assert not job_processes(job)
    assert "accelkit: stopped by SIGTERM; every worker was stopped" in _output(output)


def test_a_failing_rank_is_reported_in_the_jobs_output_file(slurm: Cluster, tmp_path: Path) -> None:
    job, output = _submit(slurm, tmp_path, "fail")
    fields: dict[str, Any] = slurm.wait(job)
    text = _output(output)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "1:0"), text[-3000:]
    assert "RuntimeError: rank 0 gave up on purpose" in text
    report = "accelkit: rank 0 failed: RuntimeError: rank 0 gave up on purpose"
    assert report in text and text.index(report) < text.index("Failures, root cause first"), text[-3000:]
