"""Whole programs in fresh interpreters: launchers, clean exits, import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import RUNS_OF_TWENTY, subprocess_env

from accelkit.testing import free_port

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.distributed


def _run_ranks(env_for_rank: list[dict[str, str]]) -> list[dict[str, object]]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "report_state.py")],
            env=subprocess_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in env_for_rank
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            assert "terminate called" not in err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


LAUNCHERS = {
    "openmpi": lambda r, n: {
        "OMPI_COMM_WORLD_RANK": str(r),
        "OMPI_COMM_WORLD_SIZE": str(n),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(n),
    },
    "pmi": lambda r, n: {"PMI_RANK": str(r), "PMI_SIZE": str(n), "MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": str(n)},
    "slurm": lambda r, n: {
        "SLURM_PROCID": str(r),
        "SLURM_STEP_NUM_TASKS": str(n),
        "SLURM_LOCALID": str(r),
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODEID": "0",
    },
    "env": lambda r, n: {"RANK": str(r), "WORLD_SIZE": str(n)},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_any_launchers_world_makes_real_ranks_on_cpu(launcher: str) -> None:
    port = str(free_port())
    ranks = _run_ranks([{**LAUNCHERS[launcher](r, 2), "MASTER_PORT": port} for r in range(2)])
    assert [(o["rank"], o["world_size"], o["local_rank"]) for o in ranks] == [(0, 2, 0), (1, 2, 1)]
    assert {o["launcher"] for o in ranks} == {launcher}
    assert {o["sum"] for o in ranks} == {3}  # they really formed one group


def test_torchrun_workers_see_world_size_two_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(SCRIPTS / "report_state.py")]  # fmt: skip
    done = subprocess.run(
        cmd, env=subprocess_env(REPORT_DIR=str(tmp_path)), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(o["rank"] for o in ranks) == [0, 1]
    assert {(o["world_size"], o["local_world_size"], o["launcher"], o["sum"]) for o in ranks} == {(2, 2, "torchrun", 3)}
    assert "terminate called" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("runs", RUNS_OF_TWENTY)
def test_twenty_runs_exit_cleanly(runs: range) -> None:
    for attempt in runs:
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "two_workers.py")],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"run {attempt}: {done.stderr}"
        assert done.stdout.strip() == "total 3"
        assert "terminate called" not in done.stderr and "Traceback" not in done.stderr, done.stderr


IMPORT_PROBE = """
import json, sys
import torch
before = set(sys.modules)
import accelkit as ak
ak.distributed, ak.get_logger, ak.split_between_processes, ak.state  # touch the API

@ak.distributed(num_processes=2)
@ak.on_main_process
def decorated() -> None: ...

@ak.find_executable_batch_size(starting_batch_size=8)
def sized(batch_size: int) -> None: ...

after = set(sys.modules)
print(json.dumps({
    "state": ak.is_initialized(),
    "new": sorted(after - before),
    "dist": torch.distributed.is_initialized(),
    "cuda": torch.cuda.is_initialized(),
}))
"""


def test_import_initialises_nothing_and_stays_light() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert not report["dist"] and not report["cuda"] and not report["state"]
    heavy = ("torch.distributed.elastic", "torch.distributed.fsdp", "torch._dynamo", "deepspeed", "yaml",
             "tensorboard", "tqdm", "safetensors", "torch.distributed.launcher")  # fmt: skip
    assert [m for m in report["new"] if m.startswith(heavy)] == []
    foreign = [m for m in report["new"] if not m.startswith(("accelkit", "wrapt", "typing_extensions"))]
    assert len(foreign) <= 5, foreign  # a few stdlib modules at most


def test_cli_help_does_not_import_torch() -> None:
    probe = (
        "import sys\nfrom accelkit._cli import main\n"
        "try: main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "accelkit" in done.stdout and done.stdout.strip().endswith("False")
