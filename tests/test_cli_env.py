"""`accelkit env`, `accelkit test` and the warnings `accelkit launch` prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accelkit as ak
from accelkit._cli import _sysinfo, main


def cli(argv: list[str]) -> int:
    """Run `accelkit <argv>` in this process, as the console script does."""
    return main(argv)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "accelkit.yaml"
    path.write_text(text)
    return path


# --- the warnings, as pure functions -------------------------------------------------------


@pytest.mark.parametrize("release", ["5.4.0-150-generic", "4.19.0", "3.10.0-1160.el7.x86_64", "5.4"])
def test_an_old_kernel_warns(release: str) -> None:
    warning = _sysinfo.kernel_warning(release)
    assert warning is not None
    assert release in warning and "5.5" in warning and "upgrade the kernel" in warning


@pytest.mark.parametrize("release", ["6.1.0", "5.5.0", "5.15.0-91-generic", "10.0", "6.18.44-fc-v595"])
def test_a_recent_kernel_does_not_warn(release: str) -> None:
    assert _sysinfo.kernel_warning(release) is None


@pytest.mark.parametrize("release", ["", "weird", "5", "v5.4", "#1 SMP", "5.x.0", "..."])
def test_an_unreadable_kernel_release_is_not_an_error(release: str) -> None:
    assert _sysinfo.kernel_warning(release) is None


def test_gpus_of_different_models_warn() -> None:
    warning = _sysinfo.gpu_warning(
        [("NVIDIA A100", 80 * 2**30), ("NVIDIA V100", 32 * 2**30), ("NVIDIA A100", 80 * 2**30)]
    )
    assert warning is not None
    assert "2 x NVIDIA A100 (80.0 GiB)" in warning and "1 x NVIDIA V100 (32.0 GiB)" in warning
    assert "slowest sets the pace" in warning and "CUDA_VISIBLE_DEVICES" in warning


def test_gpus_of_one_model_with_different_memory_warn() -> None:
    warning = _sysinfo.gpu_warning([("NVIDIA A100", 40 * 2**30), ("NVIDIA A100", 80 * 2**30)])
    assert warning is not None and "40.0 GiB" in warning and "80.0 GiB" in warning


@pytest.mark.parametrize(
    "devices",
    [[], [("NVIDIA H100", 80 * 2**30)], [("NVIDIA H100", 80 * 2**30)] * 8, [("NVIDIA L4", None)] * 2],
)
def test_identical_gpus_do_not_warn(devices: list[tuple[str, int | None]]) -> None:
    assert _sysinfo.gpu_warning(devices) is None


def test_more_processes_than_cores_warns_with_the_threads_each_gets() -> None:
    warning = _sysinfo.oversubscription_warning(4, 2)
    assert warning is not None
    assert "4 processes on 2 CPU cores" in warning and "1 thread " in warning and "OMP_NUM_THREADS" in warning
    assert "gets 1 thread " in (_sysinfo.oversubscription_warning(3, 2) or "")


@pytest.mark.parametrize(("processes", "cores"), [(1, 1), (2, 2), (2, 16)])
def test_no_more_processes_than_cores_does_not_warn(processes: int, cores: int) -> None:
    assert _sysinfo.oversubscription_warning(processes, cores) is None


def test_launch_warnings_reads_this_machine() -> None:
    many = _sysinfo.usable_cpus() + 1
    warnings = _sysinfo.launch_warnings(many)
    assert any(f"{many} processes on {_sysinfo.usable_cpus()} CPU cores" in w for w in warnings)
    assert not any("CPU cores" in w for w in _sysinfo.launch_warnings(1))


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2", None])
def test_launch_warnings_rejects_a_bad_process_count(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"num_local_processes={bad!r}") + ".*integer >= 1"):
        _sysinfo.launch_warnings(bad)  # type: ignore[arg-type]


def test_hidden_gpus_are_not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _sysinfo.local_gpus() == []


# --- accelkit env ----------------------------------------------------------------------------


@pytest.fixture
def gpus_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    """`accelkit env` in this process reads no GPU's properties, which would initialise CUDA here (the
    command runs in a process of its own: test_env_runs_as_a_command)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.usefixtures("gpus_unseen")
def test_env_prints_versions_and_sections(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_LOG_LEVEL", "debug")
    assert cli(["env"]) == 0
    out = capsys.readouterr().out
    assert f"- accelkit: {ak.__version__}\n" in out
    assert f"- torch: {torch.__version__}\n" in out
    assert f"- python: {sys.version.split()[0]} " in out
    assert f"- CPUs: {os.cpu_count()}" in out
    assert "### Config\n- file: none (ACCELKIT_CONFIG_FILE is empty)\n" in out  # the suite sets it empty
    assert "- ACCELKIT_LOG_LEVEL=debug\n" in out
    assert "### Collectives\n- timeout: a collective that waits 600 s for the other processes fails the job" in out
    assert "### Warnings for 1 process on this node\n" in out


@pytest.mark.usefixtures("gpus_unseen")
def test_env_reports_the_config_file_and_its_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, "num_processes: 4096\nprecision: bf16\ncpu: true\n")
    assert cli(["env", "--config-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"- file: {path} (accelkit)\n" in out
    assert "- num_processes: 4096\n" in out and "- precision: 'bf16'\n" in out and "- cpu: True\n" in out
    assert "### Warnings for 4096 processes on this node\n" in out
    assert f"4096 processes on {_sysinfo.usable_cpus()} CPU cores" in out


@pytest.mark.usefixtures("gpus_unseen")
def test_env_names_the_interface_a_multi_node_launch_binds_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli(["env"]) == 0
    out = capsys.readouterr().out
    assert "### Network\n- interfaces: lo (127.0.0.1" in out
    assert "- main process: 127.0.0.1, reached through lo (127.0.0.1)\n" in out
    assert "- GLOO_SOCKET_IFNAME: lo (set by a multi-node launch)\n" in out
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    assert cli(["env"]) == 0
    assert "- NCCL_SOCKET_IFNAME: lo (yours)\n" in capsys.readouterr().out
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    path = write_config(tmp_path, "num_nodes: 2\nmain_process_ip: 127.0.0.2\nmain_process_port: 29500\n")
    assert cli(["env", "--config-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "- main process: 127.0.0.2: GLOO_SOCKET_IFNAME='eth9': 'eth9' cannot carry this job: this machine" in out


@pytest.mark.usefixtures("gpus_unseen")
def test_env_reports_a_broken_config_file_instead_of_failing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.yaml"
    assert cli(["env", "--config-file", str(missing)]) == 0
    out = capsys.readouterr().out
    assert "### Config\n- error: " in out and str(missing) in out and "does not exist" in out


def test_env_runs_as_a_command() -> None:
    command = "import sys; from accelkit._cli import main; sys.exit(main())"  # what the console script runs
    done = subprocess.run(
        [sys.executable, "-c", command, "env"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"- accelkit: {ak.__version__}\n" in done.stdout and "### Config\n" in done.stdout


def test_launch_warnings_do_not_import_torch() -> None:
    # `accelkit launch` calls it before starting anything; torch costs seconds to import.
    code = "import sys, accelkit._cli._sysinfo as s; s.launch_warnings(4096); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# --- accelkit test ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_selftest_passes_with_the_config_in_effect(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, "num_processes: 2\nprecision: bf16\ndebug: true\ncpu: true\n")
    assert cli(["test", "--config-file", str(path)]) == 0
    out = capfd.readouterr().out
    assert f"accelkit test: 2 processes, precision 'bf16', debug on, cpu only, config file {path}\n" in out
    for check in ("processes", "reduce", "gather", "broadcast", "barrier", "training", "precision", "debug mode"):
        assert f"  ok       {check}: " in out
    assert "world size 2, ranks [0, 1], device cpu, backend gloo" in out
    assert "computes matmuls in torch.bfloat16" in out
    assert "raised DistributedOperationError on every rank" in out
    assert "all 8 checks passed on 2 processes" in out


@pytest.mark.distributed
def test_selftest_names_the_failed_check_and_rank(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELKIT_CPU", "1")  # the same run on a machine with GPUs: 2 CPU processes by default
    assert cli(["test", "--fault-rank", "1"]) == 1  # rank 1 contributes a wrong value, for real
    out = capfd.readouterr().out
    assert "accelkit test: 2 processes, precision 'no', debug off, cpu only, config file none\n" in out
    assert "  ok       processes: " in out
    assert "  FAILED   reduce on ranks 0, 1: " in out and "rank 1 contributed 102, expected 2" in out
    assert "  not run  training\n" in out
    assert "FAILED: check 'reduce' failed on ranks 0, 1" in out


def test_selftest_with_one_process_runs_here(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELKIT_CPU", "1")
    assert cli(["test", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "  ok       processes: world size 1, ranks [0], device cpu" in out
    assert "  skipped  debug mode: debug mode is off" in out
    assert "all 7 checks passed, 1 skipped on 1 process in " in out
    assert not ak.is_initialized()  # the run's state in this process is gone


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0"], "-n/--num-processes: expected an integer >= 1, got '0'"),
        (["-n", "two"], "expected an integer >= 1, got 'two'"),
        (["--fault-rank", "-1"], "--fault-rank: expected an integer >= 0, got '-1'"),
    ],
)
def test_selftest_rejects_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli(["test", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_selftest_rejects_a_fault_rank_outside_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["test", "-n", "2", "--fault-rank", "2"]) == 2
    assert "--fault-rank 2 is not a rank of 2 processes; pick one of 0..1" in capsys.readouterr().err


def test_selftest_rejects_a_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.yaml"
    assert cli(["test", "--config-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "the config is not usable" in err and str(missing) in err and "accelkit config --config-file" in err
