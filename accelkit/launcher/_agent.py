"""Running a function or a program in worker processes on PyTorch's elastic agent (torchrun's engine).

Each worker records its own exception (type, message, traceback, time) in the run's
directory, so that the :class:`~accelkit.errors.WorkerError` raised in the caller names
every failed rank, root cause first, whatever the agent noticed first.
Before the agent starts, this process hosts or joins the rendezvous store
(:mod:`accelkit._rendezvous`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import _env, _state
from .._options import DEFAULT_RDZV_TIMEOUT
from ..errors import ConfigurationError, WorkerError, WorkerFailure
from ._notebook import flush_std_streams, whole_lines_to_notebook
from ._rendezvous import rendezvous_store

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class FunctionRef:
    """A module-level function named by module and qualified name (resolved in the worker)."""

    module: str
    qualname: str

    def resolve(self) -> Callable[..., Any]:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Command:
    """A Python program the workers run: ``python ARGV...`` (``accelkit launch``'s script)."""

    argv: tuple[str, ...]


@dataclass(frozen=True)
class Job:
    """Everything one worker needs; pickled to spawned workers."""

    target: Callable[..., Any] | FunctionRef
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    run_dir: str
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    watchdog: float | None = None


@dataclass(frozen=True)
class AgentConfig:
    num_processes: int
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    start_method: str = "spawn"
    quiet: bool = True
    rdzv_backend: str = "static"  # or "c10d" (torch's dynamic rendezvous)
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT


def run_workers(
    target: Callable[..., Any] | FunctionRef | Command,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: AgentConfig,
    env: dict[str, str],
    watchdog: float | None = None,
) -> dict[int, Any]:
    """Run ``target(*args, **kwargs)`` in every worker; their return values by global rank.

    A :class:`Command` target runs ``python *target.argv`` in each worker instead, with
    ``env`` in its environment and the run directory in ``ACCELKIT_RUN_DIR``.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import launch_agent

    if config.start_method != "fork" and not isinstance(target, Command):
        check_picklable(target, args, kwargs, config.start_method)
    threads = None
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // config.num_processes)
    run_dir = tempfile.mkdtemp(prefix="accelkit-run-")
    entrypoint: Any
    agent_args: list[Any]
    worker_env: dict[str, str] = {}
    if isinstance(target, Command):
        # A program's workers inherit this process's environment (torch's SubprocessHandler).
        entrypoint, agent_args = sys.executable, list(target.argv)
        worker_env = {**env, _env.RUN_DIR: run_dir, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    else:
        entrypoint, agent_args = worker_main, [Job(target, args, kwargs, run_dir, env, threads, watchdog)]
    if config.start_method == "fork":
        flush_std_streams()  # or forked workers print what this process still buffers
    try:
        with rendezvous_store(config) as (addr, port, run_id):
            launch_config = _launch_config(config, f"{addr}:{port}", run_id, run_dir)
            with _quiet_agent(config.quiet), _patched_env(worker_env, "TORCHELASTIC_SIGNALS_TO_HANDLE"):
                return launch_agent(launch_config, entrypoint, agent_args)
    except ChildFailedError as exc:
        raise collect_failures(run_dir, exc.failures) from None
    except RendezvousTimeoutError:
        raise TimeoutError(
            f"node {config.node_rank}: the {config.num_nodes} nodes did not all join the {config.rdzv_backend} "
            f"rendezvous at {config.master_addr}:{config.master_port} within {config.rdzv_timeout:g} s. Start "
            f"every node with the same master address and port, or allow longer."
        ) from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _launch_config(config: AgentConfig, endpoint: str, run_id: str, run_dir: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    seconds = math.ceil(config.rdzv_timeout)
    static = config.rdzv_backend == "static"
    return LaunchConfig(
        min_nodes=config.num_nodes,
        max_nodes=config.num_nodes,
        nproc_per_node=config.num_processes,
        run_id=run_id,
        rdzv_backend=config.rdzv_backend,
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": config.node_rank, "timeout": seconds} if static else {"join_timeout": seconds},
        max_restarts=config.max_restarts,
        monitor_interval=0.05,
        start_method=config.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs")),
    )


def worker_main(job: Job) -> Any:
    """The entry point of every worker process."""
    os.environ.update(job.env)
    whole_lines_to_notebook()
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    timer = _start_watchdog(job) if job.watchdog else None
    try:
        fn = job.target.resolve() if isinstance(job.target, FunctionRef) else job.target
        return fn(*job.args, **job.kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            record_failure(job.run_dir, exc)
        raise
    except BaseException as exc:
        record_failure(job.run_dir, exc)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        _state.reset_state()


def record_failure(run_dir: str, exc: BaseException, text: str | None = None) -> None:
    """Write this worker's failure report atomically into the run directory."""
    try:
        where = _env.detect_launch()  # torchrun's variables, or mpirun's
    except ConfigurationError:
        where = _env.LaunchEnv("none")
    rank = where.rank
    folder = os.path.join(run_dir, "failures", f"attempt{where.restart_count}")
    os.makedirs(folder, exist_ok=True)
    report = {
        "rank": rank,
        "local_rank": where.local_rank,
        "pid": os.getpid(),
        "exc_type": exception_name(exc),
        "message": str(exc),
        "traceback": text if text is not None else user_traceback(exc),
        "timestamp": time.time(),
    }
    tmp = os.path.join(folder, f".rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))


def exception_name(exc: BaseException) -> str:
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def user_traceback(exc: BaseException) -> str:
    """The formatted traceback without accelkit's own entry frames (the user's code first)."""
    summary = traceback.TracebackException.from_exception(exc)
    stack = list(summary.stack)
    while len(stack) > 1 and os.path.abspath(stack[0].filename).startswith(_PACKAGE):
        stack.pop(0)
    summary.stack = traceback.StackSummary.from_list(stack)
    return "".join(summary.format())


def collect_failures(run_dir: str, agent_failures: dict[int, Any]) -> WorkerError:
    """Merge the workers' own reports with what the agent saw (exit codes, signals)."""
    reports: dict[int, dict[str, Any]] = {}
    root = os.path.join(run_dir, "failures")
    attempts = sorted(os.listdir(root), key=lambda a: int(a[7:])) if os.path.isdir(root) else []
    if attempts:
        last = os.path.join(root, attempts[-1])
        for name in os.listdir(last):
            if name.endswith(".json"):
                with open(os.path.join(last, name)) as f:
                    report = json.load(f)
                reports[report["rank"]] = report
    failures = []
    for rank in sorted(set(reports) | set(agent_failures)):
        seen = agent_failures.get(rank)
        report = reports.get(rank, {})
        failures.append(
            WorkerFailure(
                rank=rank,
                local_rank=report.get("local_rank", getattr(seen, "local_rank", 0)),
                pid=report.get("pid", getattr(seen, "pid", None)),
                exitcode=getattr(seen, "exitcode", None) if seen is not None else 1,
                exc_type=report.get("exc_type", ""),
                message=report.get("message", ""),
                traceback=report.get("traceback", ""),
                timestamp=report.get("timestamp", getattr(seen, "timestamp", time.time())),
            )
        )
    return WorkerError(failures)


def check_picklable(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], start_method: str) -> None:
    """A clear error, before any process starts, for what a spawned worker cannot import."""
    name = getattr(target, "__qualname__", repr(target))
    if "<lambda>" in name or "<locals>" in name:
        raise ValueError(
            f"cannot start {name!r} with start_method={start_method!r}: spawned workers import "
            f"the function by name, and a lambda or a function defined inside another function "
            f"has none. Define it with `def` at module level, or pass start_method='fork'."
        )
    try:
        pickle.dumps((target, args, kwargs))
    except Exception as exc:
        raise ValueError(
            f"cannot send {name!r} and its arguments to {start_method!r} workers: {exc}. "
            f"Use a module-level function and picklable arguments, or start_method='fork'."
        ) from exc


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _start_watchdog(job: Job) -> threading.Timer:
    main = threading.main_thread()

    def expire() -> None:
        frame = sys._current_frames().get(main.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else ""
        rank = _env.read_int("RANK") or 0
        exc = TimeoutError(f"rank {rank} did not finish within {job.watchdog:g} s")
        record_failure(job.run_dir, exc, f"{exc}; it was at:\n{where}")
        os._exit(70)

    timer = threading.Timer(job.watchdog or 0, expire)
    timer.daemon = True
    timer.start()
    return timer


@contextlib.contextmanager
def _quiet_agent(quiet: bool) -> Iterator[None]:
    # The agent logs every failure, restart and SIGTERM at WARNING; WorkerError says it better.
    # torch's elastic modules set their own loggers' levels: quieting the parents is not enough.
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    logs = [logging.getLogger(name) for name in sorted({*prefixes, *names})]
    before = [log.level for log in logs]
    if quiet:
        for log in logs:
            log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, before, strict=True):
            log.setLevel(level)


@contextlib.contextmanager
def _patched_env(values: dict[str, str], *touched: str) -> Iterator[None]:
    """Set ``values`` in this process's environment; restore them and ``touched`` afterwards."""
    names = [*values, *touched]
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
