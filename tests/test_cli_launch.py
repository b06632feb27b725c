"""`accelkit launch`: flags and precedence without processes, then real launches of a script
(local, two nodes on loopback, a node that never comes, mpirun)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import alive, subprocess_env

from accelkit._cli import build_parser, main
from accelkit._cli._mpirun import hostfile_hosts, mpirun_command
from accelkit._cli._script import read_launch
from accelkit._config import config_in_effect
from accelkit._launcher import LaunchPlan
from accelkit.testing import free_port

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
PROBE = str(SCRIPTS / "launch_probe.py")
CLI = "import sys; from accelkit._cli import main; sys.exit(main())"


def _plan(*argv: str) -> LaunchPlan:
    """What `accelkit launch ARGV` would run, with the config file it would read."""
    args = build_parser().parse_args(["launch", *argv])
    return read_launch(args, config_in_effect(args.config_file))[0]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --- parsing and precedence, no processes --------------------------------------------------------


def test_help_imports_neither_torch_nor_yaml() -> None:
    probe = "import sys; from accelkit._cli import main\ntry: main(['launch', '--help'])\nexcept SystemExit: pass\n"
    probe += "print(sorted(m for m in ('torch', 'yaml') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_scripts_arguments_pass_through_untouched() -> None:
    args = build_parser().parse_args(["launch", "-n", "2", "train.py", "a", "-b", "--c", "--cpu", "-n", "3", "--", "x"])
    assert (args.target, args.script_args) == ("train.py", ["a", "-b", "--c", "--cpu", "-n", "3", "--", "x"])
    assert (args.num_processes, args.cpu, args.precision, args.module) == (2, None, None, False)


def test_flag_over_environment_over_config_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")  # the suite's CPU pin is one more variable: these layers are the test's
    config = _write(
        tmp_path / "c.yaml",
        "precision: fp16\ngradient_accumulation_steps: 2\ndebug: true\nnum_processes: 3\nrdzv_timeout: 60\n",
    )
    monkeypatch.setenv("ACCELKIT_PRECISION", "bf16")
    monkeypatch.setenv("ACCELKIT_GRADIENT_ACCUMULATION_STEPS", "4")
    plan = _plan("--config-file", config, "--precision", "no", PROBE)
    assert plan.options == {"precision": "no", "gradient_accumulation_steps": 4, "debug": True}
    assert plan.sources["precision"] == "flag"
    assert plan.sources["gradient_accumulation_steps"] == "environment"
    assert plan.sources["debug"] == "config"
    assert (plan.launch.num_processes, plan.launch.rdzv_timeout, plan.launch.num_nodes) == (3, 60.0, 1)
    assert (plan.sources["num_processes"], plan.sources["num_nodes"]) == ("config", "default")
    assert plan.fixed == ("precision",)
    env = plan.worker_env()
    assert env["ACCELKIT_PRECISION"] == "no" and env["ACCELKIT_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert (env["ACCELKIT_DEBUG"], env["ACCELKIT_LAUNCH_FLAGS"], env["ACCELKIT_CONFIG_FILE"]) == ("1", "precision", "")
    assert _plan("--config-file", config, "-n", "2", PROBE).launch.num_processes == 2


def test_the_config_file_variable_is_read_and_gpu_ids_restrict_the_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", _write(tmp_path / "c.yaml", "strategy: fsdp\ngpu_ids: 1,3\n"))
    plan = _plan(PROBE)
    assert plan.options == {"strategy": "fsdp"} and plan.fixed == ()
    assert plan.worker_env()["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_an_accelerate_config_is_read_and_its_ignored_keys_noted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")
    config = _write(
        tmp_path / "accelerate.yaml",
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 1\n"
        "num_processes: 4\nmixed_precision: bf16\nmain_process_ip: 10.1.2.3\nmain_process_port: 29555\n"
        "tpu_use_cluster: false\n",
    )
    plan = _plan("--config-file", config, PROBE)
    assert plan.options == {"precision": "bf16", "strategy": "ddp"}
    names = ("num_processes", "num_nodes", "node_rank", "master_addr", "master_port")
    assert {k: getattr(plan.launch, k) for k in names} == {
        "num_processes": 2, "num_nodes": 2, "node_rank": 1, "master_addr": "10.1.2.3", "master_port": 29555,
    }  # fmt: skip
    assert len(plan.notes) == 1 and "tpu_use_cluster" in plan.notes[0]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["-n", "0"], "-n/--num-processes: expected an integer >= 1, got '0'"),
        (["--num-processes", "two"], "expected an integer >= 1, got 'two'"),
        (["--node-rank", "-1"], "--node-rank: expected an integer >= 0, got '-1'"),
        (["--main-process-port", "70000"], "expected a TCP port from 1 to 65535, got '70000'"),
        (["--rdzv-timeout", "0"], "expected a positive number of seconds, got '0'"),
        (["--precision", "fp32"], "invalid choice: 'fp32'"),
        (["--precision", "fp8"], "--precision: fp8 needs an NVIDIA GPU of compute capability 8.9 or newer, torchao"),
        (["--mixed_precision", "fp8"], "fp8 needs an NVIDIA GPU of compute capability 8.9 or newer, torchao"),
        (["--rdzv-backend", "etcd"], "invalid choice: 'etcd'"),
    ],
)
def test_bad_flag_values_stop_before_anything_starts(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["launch", *argv, PROBE])
    assert done.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--num-nodes", "2", "--node-rank", "2"], ["--node-rank 2 with --num-nodes 2", "count from 0 to 1"]),
        (["--num-nodes", "2", "--main-process-port", "29500"], ["needs --main-process-ip", "e.g."]),
        (["--num-nodes", "2", "--main-process-ip", "10.0.0.1"], ["needs --main-process-port"]),
        (["--hostfile", PROBE], ["is for mpirun; add --mpirun"]),
        (["--mpirun", "--num-nodes", "2"], ["mpirun places the processes itself"]),
        (["--mpirun", "--max-restarts", "1"], ["mpirun does not restart processes"]),
        (["--mpirun", "--hostfile", "no-such-hosts"], ["--hostfile 'no-such-hosts' does not exist"]),
        (["--config-file", "no-such.yaml"], ["no-such.yaml' (from --config-file", "does not exist", "accelkit config"]),
    ],
)
def test_bad_combinations_stop_before_anything_starts(
    argv: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv, PROBE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accelkit launch: error: ")
    for fragment in fragments:
        assert fragment in err


def test_node_settings_are_checked_once_after_the_merge_naming_where_each_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "c.yaml", "num_nodes: 2\nnode_rank: 2\nmain_process_ip: 10.0.0.1\n")
    assert main(["launch", "--config-file", config, "--main-process-port", "29500", PROBE]) == 2
    assert f"node_rank: 2 ({config}:2) with num_nodes: 2 ({config}:1): node ranks count from 0 to 1" in (
        capsys.readouterr().err
    )
    # A flag over the file's rank: the merged settings are what is checked, not the file alone.
    plan = _plan("--config-file", config, "--node-rank", "1", "--main-process-port", "29500", PROBE)
    assert (plan.launch.node_rank, plan.sources["node_rank"], plan.sources["num_nodes"]) == (1, "flag", "config")
    accelerate = _write(
        tmp_path / "a.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 2\n"
        "machine_rank: 3\n",
    )  # fmt: skip
    assert main(["launch", "--config-file", accelerate, PROBE]) == 2
    assert f"machine_rank: 3 ({accelerate}:4) with num_machines: 2 ({accelerate}:3)" in capsys.readouterr().err


def test_a_missing_script_or_module_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-n", "2", "no_such_script.py", "x"]) == 2
    assert "script 'no_such_script.py' does not exist" in capsys.readouterr().err
    assert main(["launch", "-m", "no_such_module.sub"]) == 2
    assert "-m no_such_module.sub: no module 'no_such_module'" in capsys.readouterr().err


def test_bad_values_from_the_environment_or_the_config_stop_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "c.yaml", "num_processes: 2\nprecision: fp32\n")
    assert main(["launch", "--config-file", config, PROBE]) == 2
    assert "c.yaml:2: precision: expected one of" in capsys.readouterr().err
    monkeypatch.setenv("ACCELKIT_GRADIENT_ACCUMULATION_STEPS", "many")
    assert main(["launch", PROBE]) == 2
    assert "ACCELKIT_GRADIENT_ACCUMULATION_STEPS='many' is not an integer" in capsys.readouterr().err


def test_mpirun_command() -> None:
    program = ["python", "-m", "accelkit._cli._worker", "t.py", "--lr", "1"]
    assert mpirun_command("mpirun", 4, program, ["ACCELKIT_CPU", "MASTER_PORT"]) == [
        "mpirun", "-np", "4", "-x", "ACCELKIT_CPU", "-x", "MASTER_PORT", *program,
    ]  # fmt: skip
    cmd = mpirun_command("/usr/bin/mpirun", 8, program, [], hostfile="hosts", as_root=True, oversubscribe=True)
    assert cmd[:7] == ["/usr/bin/mpirun", "-np", "8", "--allow-run-as-root", "--oversubscribe", "--hostfile", "hosts"]


def test_hostfile_hosts(tmp_path: Path) -> None:
    hosts = _write(tmp_path / "hosts", "# the machines\nnode-a slots=4\n\n  node-b slots=4  # second\n")
    assert hostfile_hosts(hosts) == ["node-a", "node-b"]


def test_mpirun_missing_from_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["launch", "--mpirun", "-n", "2", "--cpu", PROBE]) == 2
    assert "--mpirun: no `mpirun` on PATH; install Open MPI" in capsys.readouterr().err


def test_mpirun_other_than_open_mpi_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["launch", "--mpirun", "-n", "2", "--cpu", PROBE]) == 2
    err = capsys.readouterr().err
    assert "--mpirun builds Open MPI's command line, but" in err and "'HYDRA build details:'" in err


# --- real launches ---------------------------------------------------------------------------------


def _env(report_dir: Path | None = None, threads: str | None = "1") -> dict[str, str]:
    env = subprocess_env(**({} if report_dir is None else {"REPORT_DIR": str(report_dir)}))
    if threads is None:  # the launcher decides
        del env["OMP_NUM_THREADS"]
    else:
        env["OMP_NUM_THREADS"] = threads
    return env


def _start(report_dir: Path, *argv: str, cwd: Path = ROOT, threads: str | None = "1") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, "launch", *argv],
        env=_env(report_dir, threads),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a stuck launch is killed with its workers, by process group
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, out, err


def _launch(tmp_path: Path, *argv: str, cwd: Path = ROOT, threads: str | None = "1") -> tuple[int, str, str]:
    return _finish(_start(tmp_path, *argv, cwd=cwd, threads=threads))


def _reports(report_dir: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.distributed
def test_flags_and_arguments_reach_every_rank(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "-n", "2", "--cpu", "--precision", "bf16", "--debug", PROBE, "a", "-b", "--c")
    assert code == 0, err
    reports = _reports(tmp_path)
    assert [(r["rank"], r["world_size"], r["sum"]) for r in reports] == [(0, 2, 3), (1, 2, 3)]
    for r in reports:
        assert (r["precision"], r["debug"], r["cpu"], r["name"]) == ("bf16", True, True, "__main__")
        assert r["argv"] == [PROBE, "a", "-b", "--c"] and r["path0"] == str(SCRIPTS)
    assert "accelkit: launching 2 process(es) on node 0 of 1 (world size 2)" in err
    assert "precision = 'bf16' (flag)" in err
    assert "accelkit: a collective that waits 600 s for the other processes fails the job (timeout, default;" in err


@pytest.mark.distributed
def test_a_failing_rank_is_named_with_its_traceback(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "-n", "2", "--cpu", PROBE, "fail=1")
    assert code == 1
    report = err[err.index("accelkit: rank 1 failed") :]
    # Root cause first; rank 0 may be listed after it when the agent stopped it (SIGTERM) in time to see.
    assert re.match(r"accelkit: rank 1 failed: ValueError: bad batch on rank 1( \(and 1 more\))?\n", report), report
    trace = report[report.index("Traceback (most recent call last):") :].splitlines()
    assert trace[1].strip().startswith(f'File "{PROBE}"'), "the traceback starts in the user's script"
    assert "accelkit/_cli" not in err and "runpy" not in err, "no traceback of the launcher itself"
    assert "a collective that waits" not in err, "the timeout is said with --debug and by accelkit env, not each time"


@pytest.mark.distributed
def test_a_rank_that_dies_from_a_signal_is_named_with_where_it_was(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "-n", "2", "--cpu", PROBE, "segv=1")
    assert code == 1
    report = err[err.index("accelkit: rank 1 failed") :]
    assert report.startswith("accelkit: rank 1 failed: died from SIGSEGV"), report
    crash = report[report.index("Fatal Python error: Segmentation fault") :].splitlines()
    assert crash[2].strip().startswith("Current thread "), "the crashing thread's stack comes first"
    assert f'File "{PROBE}", line' in crash[4] and "in main" in crash[4], crash


@pytest.mark.distributed
def test_code_disagreeing_with_a_launch_flag_is_an_error(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "-n", "2", "--cpu", "--precision", "bf16", PROBE, "init=fp16")
    assert code == 1
    assert "ConfigurationError: precision is set twice with different values: 'fp16' in code" in err
    assert "'bf16' by `accelkit launch --precision`" in err


@pytest.mark.distributed
def test_a_module_runs_as_main_with_its_arguments_and_a_share_of_the_cores(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "-n", "2", "--cpu", "-m", "launch_probe", "x", "--y", cwd=SCRIPTS, threads=None)
    assert code == 0, err
    reports = _reports(tmp_path)
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["name"] == "__main__" and r["argv"] == [PROBE, "x", "--y"] for r in reports)
    assert all(r["path0"] == str(SCRIPTS) for r in reports)  # the working directory, as with python -m
    # Without OMP_NUM_THREADS, each of the 2 processes gets its share of the cores.
    assert {r["threads"] for r in reports} == {str(max(1, (os.cpu_count() or 1) // 2))}


@pytest.mark.parametrize("how", ["script", "module", "package"])
def test_a_syntax_error_is_reported_once_before_any_worker_starts(tmp_path: Path, how: str) -> None:
    broken = "import sys\n\ndef train(:\n    pass\n"
    if how == "package":
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "__init__.py").write_text("")
        path, target = _write(tmp_path / "pkg" / "__main__.py", broken), ["-m", "pkg"]
    else:
        path = _write(tmp_path / "broken.py", broken)
        target = ["-m", "broken"] if how == "module" else [path]
    started = time.monotonic()
    code, _, err = _launch(tmp_path, "-n", "2", "--cpu", *target, cwd=tmp_path)
    assert code == 1 and time.monotonic() - started < 60, err
    assert err.count("SyntaxError") == 1 and err.count("def train(:") == 1, err
    assert f'accelkit launch: error: {path} cannot run, nothing was started:\n  File "{path}", line 3' in err
    assert "Traceback" not in err and "rank" not in err, err


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_form_one_group_on_loopback(tmp_path: Path) -> None:
    port = str(free_port())
    common = ["--num-nodes", "2", "--main-process-ip", "127.0.0.1", "--main-process-port", port, "-n", "2", "--cpu"]
    nodes = [_start(tmp_path, *common, "--node-rank", str(k), PROBE) for k in (1, 0)]
    results = [_finish(node) for node in nodes]
    for code, _, err in results:
        assert code == 0, err
        assert f"waiting up to 300 s for 2 nodes at 127.0.0.1:{port}" in err
    reports = _reports(tmp_path)
    assert [(r["rank"], r["world_size"], r["node_rank"], r["local_rank"]) for r in reports] == [
        (0, 4, 0, 0), (1, 4, 0, 1), (2, 4, 1, 0), (3, 4, 1, 1),
    ]  # fmt: skip
    assert {r["sum"] for r in reports} == {10}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_a_node_that_never_comes_is_named_within_the_timeout(tmp_path: Path, rdzv: str) -> None:
    port = str(free_port())
    # More processes than cores, for the launch warning: none starts, the rendezvous fails first.
    crowd = str(len(os.sched_getaffinity(0)) + 1)
    started = time.monotonic()
    code, _, err = _launch(
        tmp_path, "--num-nodes", "2", "--node-rank", "0", "--main-process-ip", "127.0.0.1",
        "--main-process-port", port, "--rdzv-timeout", "5", "--rdzv-backend", rdzv, "-n", crowd, "--cpu", PROBE,
    )  # fmt: skip
    assert time.monotonic() - started < 60
    assert code == 1
    rendezvous = "the rendezvous" if rdzv == "static" else "the c10d rendezvous"
    assert f"node 0: node rank(s) 1 of 2 did not join {rendezvous} at 127.0.0.1:{port} within 5 s" in err, err
    assert "Traceback" not in err and not list(tmp_path.glob("rank*.json"))
    assert f"accelkit: warning: {crowd} processes on" in err


@pytest.mark.smoke
@pytest.mark.distributed
def test_one_node_listens_on_loopback_only_and_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    address = _non_loopback_address()
    port = free_port()
    proc = _start(tmp_path, "-n", "2", "--cpu", "--main-process-port", str(port), PROBE, "sleep")
    try:
        deadline = time.monotonic() + 120
        while len(_reports(tmp_path)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_reports(tmp_path)) == 2, proc.stderr.read() if proc.poll() is not None else "workers too slow"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        if address is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=5).close()
        proc.send_signal(signal.SIGINT)
        code, _, err = _finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert code == 130
    assert "accelkit: interrupted; every worker was stopped" in err
    for report in _reports(tmp_path):
        assert not alive(int(str(report["pid"]))), f"rank {report['rank']} still runs"
    if address is None:
        pytest.skip("no non-loopback address on this machine: only the Ctrl-C half ran")


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")


@pytest.mark.distributed
@needs_mpirun
def test_mpirun_runs_one_group(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "--mpirun", "-n", "2", "--cpu", "--debug", PROBE, "x")
    assert code == 0, err
    reports = _reports(tmp_path)
    assert [(r["rank"], r["world_size"], r["launcher"], r["sum"]) for r in reports] == [
        (0, 2, "openmpi", 3), (1, 2, "openmpi", 3),
    ]  # fmt: skip
    assert all(r["debug"] and r["argv"] == [PROBE, "x"] for r in reports)
    assert "mpirun -np 2" in err and "-x ACCELKIT_DEBUG" in err  # debug mode prints the command


@pytest.mark.slow
@pytest.mark.distributed
@needs_mpirun
def test_mpirun_names_the_failing_rank(tmp_path: Path) -> None:
    code, _, err = _launch(tmp_path, "--mpirun", "-n", "2", "--cpu", PROBE, "fail=1")
    assert code != 0
    assert "accelkit: rank 1 failed: ValueError: bad batch on rank 1" in err


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = str(s.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith("127.") else address
