"""@ak.distributed, ak.launch and run_distributed on real 2-process gloo groups."""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import subprocess_env

import accelkit as ak
from accelkit.errors import WorkerFailure
from accelkit.testing import run_distributed

pytestmark = pytest.mark.distributed


@ak.distributed(num_processes=2, cpu=True)
def summed_rank(offset: int, *, scale: float = 1.0) -> dict[str, float]:
    """Each rank contributes rank + offset; all ranks see the sum."""
    total = torch.tensor([float(ak.rank() + offset)])
    dist.all_reduce(total)
    return {"rank": ak.rank(), "world": ak.world_size(), "sum": total.item() * scale}


@ak.distributed(2, cpu=True)
def fail_on_rank_one() -> None:
    ak.wait_for_everyone()
    if ak.rank() == 1:
        raise ValueError("bad batch on rank 1")
    ak.wait_for_everyone()  # rank 0 waits here for a peer that is gone


def options_seen() -> tuple[int, str, int, bool]:
    options = ak.state().options
    return ak.rank(), options.precision, options.gradient_accumulation_steps, options.debug


def crash_first_attempt() -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and ak.rank() == 1:
        raise RuntimeError("transient failure")
    ak.wait_for_everyone()
    return attempt


def killed_by_signal() -> None:
    if ak.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ak.wait_for_everyone()


def segfault_on_rank_one() -> None:
    if ak.rank() == 1:
        ctypes.string_at(0)  # reads address 0: what a crash in an extension looks like
    ak.wait_for_everyone()


def hang_on_rank_one() -> None:
    if ak.rank() == 1:
        time.sleep(600)


@pytest.mark.smoke
def test_returns_rank_zeros_value() -> None:
    assert summed_rank(10, scale=2.0) == {"rank": 0, "world": 2, "sum": 42.0}


def test_decorator_keeps_signature_name_and_doc() -> None:
    assert summed_rank.__name__ == "summed_rank"
    assert summed_rank.__doc__ == "Each rank contributes rank + offset; all ranks see the sum."
    assert str(inspect.signature(summed_rank)) == "(offset: 'int', *, scale: 'float' = 1.0) -> 'dict[str, float]'"
    assert inspect.unwrap(summed_rank) is not summed_rank


def test_worker_failure_names_the_rank_and_stops_the_others() -> None:
    started = time.monotonic()
    with pytest.raises(ak.WorkerError) as err:
        fail_on_rank_one()
    assert time.monotonic() - started < 60, "a failing worker must end the job promptly"
    assert err.value.ranks[0] == 1
    message = str(err.value)
    assert message.startswith("rank 1 failed: ValueError: bad batch on rank 1")
    assert 'raise ValueError("bad batch on rank 1")' in message  # the traceback line
    assert "test_launcher.py" in message
    # the hygiene fixture checks that no worker is left running


def test_every_option_reaches_the_workers() -> None:
    results = run_distributed(options_seen, precision="bf16", gradient_accumulation_steps=4, debug=True)
    assert results == [(0, "bf16", 4, True), (1, "bf16", 4, True)]


def test_launch_with_the_same_options() -> None:
    assert ak.launch(options_seen, num_processes=2, cpu=True, precision="fp16") == (0, "fp16", 1, False)


def test_max_restarts_restarts_the_group_and_says_why(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_distributed(crash_first_attempt, max_restarts=2) == [1, 1]
    err = capfd.readouterr().err
    # One line names the failed rank and its exception; the first attempt's traceback follows it.
    line = "accelkit: rank 1 failed: RuntimeError: transient failure; restarting (1 of 2)\n"
    assert err.count(line) == 1 and "restarting (2 of 2)" not in err, err[-3000:]
    trace = err[err.index(line) + len(line) :].splitlines()
    assert trace[0] == "      Traceback (most recent call last):" and "in crash_first_attempt" in trace[1], trace[:4]
    assert 'raise RuntimeError("transient failure")' in err


def restart_and_log(project_dir: str) -> int:
    attempt = ak.state().restart_count
    with ak.init_trackers("restarts", log_with="csv", project_dir=project_dir):
        ak.log({"attempt": attempt}, step=attempt)  # resumed from a checkpoint: its steps go on
    return crash_first_attempt()


def test_a_restarted_job_keeps_its_tracking_run_and_a_new_job_starts_the_next(tmp_path: Path) -> None:
    for _ in range(2):
        assert run_distributed(restart_and_log, (str(tmp_path),), max_restarts=1) == [1, 1]
    rows = (tmp_path / "restarts" / "metrics.csv").read_text().splitlines()
    assert rows == ["run,step,attempt", "1,0,0", "1,1,1", "2,0,0", "2,1,1"]


def test_without_restarts_the_failure_is_reported() -> None:
    with pytest.raises(ak.WorkerError, match="transient failure"):
        run_distributed(crash_first_attempt)


def test_a_worker_killed_by_a_signal_is_named() -> None:
    with pytest.raises(ak.WorkerError) as err:
        run_distributed(killed_by_signal)
    failure = next(f for f in err.value.failures if f.rank == 1)
    assert failure.exitcode == -signal.SIGKILL
    assert "rank 1" in str(err.value) and "SIGKILL" in str(err.value)


def test_a_worker_that_crashed_shows_where_it_was() -> None:
    with pytest.raises(ak.WorkerError) as err:
        run_distributed(segfault_on_rank_one)
    failure = err.value.failures[0]
    assert (failure.rank, failure.exitcode) == (1, -signal.SIGSEGV)
    lines = failure.traceback.splitlines()
    assert lines[0] == "Fatal Python error: Segmentation fault" and lines[2].startswith("Current thread ")
    assert "in segfault_on_rank_one" in failure.traceback.split("\n\n")[1], "the crashing thread's own stack"
    assert "died from SIGSEGV" in str(err.value) and "in segfault_on_rank_one" in str(err.value)


def test_a_worker_stopped_with_sigterm_is_never_the_root_cause() -> None:
    # The agent stamps deaths to the whole second, so the worker it stopped can look earlier.
    raised = WorkerFailure(1, 1, 11, 1, "ValueError", "bad batch", "", timestamp=1000.7)
    stopped = WorkerFailure(0, 0, 10, -signal.SIGTERM, "", "", "", timestamp=1000.0)
    killed = WorkerFailure(2, 0, 12, -signal.SIGKILL, "", "", "", timestamp=999.0)
    assert ak.WorkerError([stopped, raised]).ranks == [1, 0]
    assert ak.WorkerError([raised, killed, stopped]).ranks == [2, 1, 0], "a SIGKILL (OOM) may be the cause"


@pytest.mark.slow
def test_a_hung_worker_times_out_and_says_where_it_was() -> None:
    with pytest.raises(ak.WorkerError) as err:
        run_distributed(hang_on_rank_one, task_timeout=5)
    assert err.value.ranks[0] == 1
    assert "did not finish within 5 s" in str(err.value)
    assert "time.sleep(600)" in str(err.value)


def wait_for_a_helper_thread() -> None:
    helper = threading.Thread(target=lambda: time.sleep(600), name="slow-helper", daemon=True)
    helper.start()
    helper.join()


def test_a_timed_out_worker_says_where_its_other_threads_were() -> None:
    with pytest.raises(ak.WorkerError) as err:
        run_distributed(wait_for_a_helper_thread, num_processes=1, task_timeout=3)
    text = str(err.value)
    assert text.index("helper.join()") < text.index("thread 'slow-helper' was at:") < text.index("time.sleep(600)")


def test_one_process_runs_here() -> None:
    pid = os.getpid()
    assert ak.launch(os.getpid, num_processes=1) == pid
    assert ak.state().world_size == 1


def test_one_process_errors_propagate_unchanged() -> None:
    def fail() -> None:
        raise KeyError("plain")

    with pytest.raises(KeyError, match="plain"):
        ak.launch(fail, num_processes=1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_num_processes(bad: object) -> None:
    with pytest.raises(ak.ConfigurationError, match=rf"num_processes={bad!r}.*positive number"):
        ak.distributed(num_processes=bad)  # type: ignore[call-overload]


def test_launch_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        ak.launch("train.py")  # type: ignore[arg-type]


def test_lambda_under_spawn_is_refused_before_starting() -> None:
    with pytest.raises(ValueError, match=r"lambda.*module level.*start_method='fork'"):
        ak.launch(lambda: 1, num_processes=2, cpu=True, start_method="spawn")


def test_unknown_option_is_named() -> None:
    with pytest.raises(TypeError, match="unexpected option 'num_procs'"):
        ak.distributed(num_procs=2)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"master_port": 70000}, "master_port=70000"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"start_method": "thread"}, "start_method='thread'"),
    ],
)
def test_bad_launch_options(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ak.ConfigurationError, match=r"expected|needs") as err:
        ak.distributed(**options)  # type: ignore[call-overload]
    assert fragment in str(err.value)


def test_node_settings_are_checked_together_with_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ak.ConfigurationError) as err:
        ak.launch(os.getpid, num_processes=1, node_rank=1)
    assert str(err.value).startswith("accelkit.launch: node_rank=1 with num_nodes=1 (the default): node ranks count")
    with pytest.raises(ak.ConfigurationError, match=r"num_nodes=2 needs master_port: .* e.g. master_port=29500"):
        ak.launch(os.getpid, num_processes=1, num_nodes=2, node_rank=1)
    with pytest.raises(ak.ConfigurationError, match=r"num_nodes=2 needs master_addr: .* master_addr='10\.0\.0\.1'"):
        ak.launch(os.getpid, num_processes=1, num_nodes=2, node_rank=1, master_port=29500)
    config = tmp_path / "config.yaml"
    config.write_text("num_nodes: 2\nnode_rank: 3\n")  # the code's node_rank=1 is right for it, but no port is set
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", str(config))
    with pytest.raises(ak.ConfigurationError, match=re.escape(f"num_nodes: 2 ({config}:1) needs master_port")):
        ak.launch(os.getpid, num_processes=1, node_rank=1)
    with pytest.raises(ak.ConfigurationError, match=re.escape(f"node_rank: 3 ({config}:2) with num_nodes: 2")):
        ak.launch(os.getpid, num_processes=1)


def test_decorating_a_non_function_is_an_error() -> None:
    with pytest.raises(TypeError, match="expects a function or num_processes"):
        ak.distributed("train")  # type: ignore[call-overload]


def test_fork_start_method_runs_local_functions() -> None:
    offset = 5

    def local() -> int:  # a closure: only fork can run it
        return ak.rank() + offset + ak.world_size()

    assert ak.launch(local, num_processes=2, cpu=True, start_method="fork") == 7


class _Tripwire:
    """Garbage of the launching process that leaves a file where a forked worker collects it."""

    def __init__(self, where: Path) -> None:
        self.where, self.owner, self.me = where, os.getpid(), self

    def __del__(self) -> None:
        if os.getpid() != self.owner:
            (self.where / f"collected-in-{os.getpid()}").touch()


def test_a_forked_worker_never_collects_the_launchers_garbage(tmp_path: Path) -> None:
    # What a forked worker inherits is the launcher's: an object's destructor run there (a C++ thread's owner
    # joining a thread that exists only in the launcher) aborted the worker at the group's end.
    def work() -> float:
        return float(ak.reduce(torch.ones(1)))

    gc.disable()  # the cycle stays uncollected here until the workers have forked
    try:
        _Tripwire(tmp_path)
        assert ak.launch(work, num_processes=2, cpu=True, start_method="fork") == 2.0
    finally:
        gc.enable()
        gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def world_and_rank() -> int:
    return ak.world_size() * 10 + ak.rank()


def test_forkserver_starts_workers_as_spawn_does() -> None:
    # Workers of a forkserver are its children, not the launcher's: they used to exit at once (code 137).
    assert ak.launch(world_and_rank, num_processes=2, cpu=True, start_method="forkserver") == 20


def return_a_lock() -> threading.Lock:
    return threading.Lock()


def test_a_return_value_that_cannot_be_sent_back_is_named() -> None:
    with pytest.raises(ak.WorkerError) as err:
        run_distributed(return_a_lock)
    assert sorted(err.value.ranks) == [0, 1]
    expected = r"rank [01] failed: TypeError: the return value \(lock\) cannot be sent to the launching process: "
    assert re.match(expected + "cannot pickle '_thread.lock' object. Return what pickle can send", str(err.value))


# A script's own function, launched as spawn launches: its workers import the script as __mp_main__.
MAIN_SCRIPT = """
import multiprocessing.resource_tracker
import sys

import accelkit as ak


@ak.distributed(num_processes=2, cpu=True)
def main(greeting: str) -> tuple[str, str, list[str]]:
    launcher = ("torch.distributed.elastic", "multiprocessing.queues", "accelkit._launcher._agent")
    return greeting, __name__, sorted(m for m in sys.modules if m.startswith(launcher))


if __name__ == "__main__":
    print(main("hello"))
    print("resource tracker", multiprocessing.resource_tracker._resource_tracker._pid)
"""


def test_spawned_workers_start_as_torchrun_starts_them(tmp_path: Path) -> None:
    # Started as a command: no multiprocessing helper process, none of the agent's modules in the workers.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(MAIN_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["('hello', '__mp_main__', [])", "resource tracker None"], done.stderr[-3000:]
