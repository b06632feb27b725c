"""Running a function or a program in worker processes on PyTorch's elastic agent (torchrun's engine).

Each worker records its own exception in the run's directory (:mod:`._failures`), so that the
:class:`~accelkit.errors.WorkerError` raised in the caller names every failed rank, root cause
first, whatever the agent noticed first. Before the agent starts, this process hosts or joins
the rendezvous store (:mod:`._rendezvous`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from .. import _env
from .._options import LaunchSettings
from ._failures import RestartNotice, collect_failures
from ._function_worker import command, read_results, worker_main
from ._netif import Route, route_to
from ._nodes import NodeBeat, lost_nodes, nodes_seen
from ._rendezvous import hosts_c10d_store, network_route, rendezvous_store
from ._spec import Command, FunctionRef, Job
from ._streams import capture_logging, flush_std_streams

__all__ = ["check_picklable", "run_workers"]


def run_workers(
    target: Callable[..., Any] | FunctionRef | Command,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: LaunchSettings,
    env: dict[str, str],
    *,
    quiet: bool = True,
    watchdog: float | None = None,
) -> dict[int, Any]:
    """Run ``target(*args, **kwargs)`` in every worker; their return values by global rank.

    ``config.num_processes`` workers start on this node (it must be set); ``quiet`` silences the
    agent's own logging. A :class:`Command` target runs ``python *target.argv`` in each worker
    instead, with ``env`` in its environment and the run directory in ``ACCELKIT_RUN_DIR``.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import launch_agent

    nprocs = config.num_processes or 1
    start_method = config.start_method or "spawn"
    if start_method != "fork" and not isinstance(target, Command):
        check_picklable(target, args, kwargs, start_method)
    threads = None
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // nprocs)
    run_dir = tempfile.mkdtemp(prefix="accelkit-run-")
    entrypoint: Any
    agent_args: list[Any]
    # Workers inherit this process's environment as it is while the agent starts them.
    worker_env: dict[str, str] = {_env.RUN_DIR: run_dir}  # where they record failures, even before their job runs
    if isinstance(target, Command):
        entrypoint, agent_args = sys.executable, list(target.argv)
        worker_env.update({**env, _env.LAUNCHER_PID: str(os.getpid())})
        if threads:
            worker_env["OMP_NUM_THREADS"] = str(threads)
    else:
        setup = capture_logging() if start_method != "fork" else None  # a forked worker has it already
        job = Job(target, args, kwargs, run_dir, env, threads, watchdog, logging=setup, launcher_pid=os.getpid())
        if start_method == "fork":
            entrypoint, agent_args = worker_main, [job]
        else:  # spawn, forkserver: a fresh interpreter, started as a command as torchrun starts its workers
            # (see _function_worker); a forkserver's children are not the launcher's, and exited at once.
            entrypoint, agent_args = command(job)
    if start_method == "fork":
        flush_std_streams()  # or forked workers print what this process still buffers
    try:
        route, network_env = network_route(config)  # a wrong address or interface fails here, in seconds
        worker_env.update(network_env)
        with rendezvous_store(config, route) as (addr, port, run_id), _watch_nodes(config, addr, port, run_id) as beat:
            notice = RestartNotice(run_dir, config.max_restarts, tracebacks_shown=isinstance(target, Command))
            launch_config = _launch_config(config, f"{addr}:{port}", run_id, run_dir, route, beat, notice)
            # Every worker arms its own lifeline first thing (die_with_parent), before it imports anything heavy.
            with _quiet_agent(quiet), _env.patched(worker_env, "TORCHELASTIC_SIGNALS_TO_HANDLE", _env.ATTEMPT):
                try:
                    results = launch_agent(launch_config, entrypoint, agent_args)
                    if isinstance(target, Command) or not isinstance(entrypoint, str):
                        return results
                    return read_results(run_dir, sorted(results))
                except ChildFailedError as exc:
                    cause = lost_nodes(addr, port, run_id, config.num_nodes, config.node_rank) if beat else ""
                    positions = last_positions(addr, port, config.num_nodes * nprocs)
                    raise collect_failures(run_dir, exc.failures, cause, positions) from None
                except RendezvousTimeoutError:  # c10d's own join timeout; the launchers' beats say who came
                    seen = nodes_seen(addr, port, run_id, config.num_nodes) if beat else None
                    raise TimeoutError(_not_joined(config, seen)) from None
    except RendezvousTimeoutError:
        raise TimeoutError(_not_joined(config, None)) from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def last_positions(addr: str, port: int, world: int) -> dict[int, Any]:
    """The positions the ranks' heartbeats last published in the job's store (the board of the group the main
    rank formed last); {} where there are none, or the store is gone."""
    import torch.distributed as dist

    from .._group import LATEST_BOARD, read_positions

    try:
        store = dist.TCPStore(addr, port, None, False, timedelta(seconds=2), wait_for_workers=False)  # type: ignore[attr-defined]
        if not store.check([LATEST_BOARD]):
            return {}
        return read_positions(store, store.get(LATEST_BOARD).decode(), world)
    except Exception:  # a store that went with its node: the stacks and records still speak
        return {}


def _not_joined(config: LaunchSettings, seen: set[int] | None) -> str:
    """The rendezvous timed out: which nodes never came, when the beats in the store tell."""
    where = f"the {config.rdzv_backend} rendezvous at {config.master_addr}:{config.master_port}"
    missing = sorted(set(range(config.num_nodes)) - seen) if seen else []
    if not missing:
        return (
            f"node {config.node_rank}: the {config.num_nodes} nodes did not all join {where} within "
            f"{config.rdzv_timeout:g} s. Start every node with the same master address and port, or allow longer."
        )
    return (
        f"node {config.node_rank}: node rank(s) {', '.join(map(str, missing))} of {config.num_nodes} did not join "
        f"{where} within {config.rdzv_timeout:g} s. Start each missing node with its node rank and the same "
        f"master address and port, or allow longer with a larger rendezvous timeout."
    )


@contextlib.contextmanager
def _watch_nodes(config: LaunchSettings, addr: str, port: int, run_id: str) -> Iterator[NodeBeat | None]:
    """A multi-node job: this node's beat in the rendezvous store, for the others to tell it is alive."""
    if config.num_nodes == 1:
        yield None
        return
    route = route_to(addr, port)
    beat = NodeBeat(addr, port, run_id, config.node_rank, config.num_nodes, config.num_processes or 1, route.local_addr)
    beat.start()
    try:
        yield beat
    finally:
        beat.stop()


def _launch_config(
    config: LaunchSettings,
    endpoint: str,
    run_id: str,
    run_dir: str,
    route: Route | None,
    beat: NodeBeat | None,
    on_start: Callable[[int], None],
) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    class AttemptLogs(DefaultLogsSpecs):
        """torch's log folders; the agent asks for them as each attempt's workers start: ``on_start`` hears it."""

        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            on_start(int(envs[0].get("TORCHELASTIC_RESTART_COUNT", 0)) if envs else 0)
            return super().reify(envs)

    seconds = math.ceil(config.rdzv_timeout)
    static = config.rdzv_backend == "static"
    backend: str = config.rdzv_backend
    rdzv_configs: dict[str, Any] = (
        {"rank": config.node_rank, "timeout": seconds} if static else {"join_timeout": seconds}
    )
    if not static:
        from ._elastic import BACKEND, ON_ROUND, register

        register()  # torch's c10d rendezvous, fit for a node started again (see _elastic)
        backend = BACKEND

        def on_round(group_rank: int, attempt: int) -> None:
            os.environ[_env.ATTEMPT] = str(attempt)  # the workers the agent starts next read it
            if beat is not None:
                beat.set_group_rank(group_rank)

        rdzv_configs[ON_ROUND] = on_round
        if route is not None and not route.loopback:
            # torch guesses from the hostname whether this node hosts the store; the address says it.
            rdzv_configs["is_host"] = hosts_c10d_store(config, route)
    return LaunchConfig(
        min_nodes=config.num_nodes,
        max_nodes=config.num_nodes,
        nproc_per_node=config.num_processes or 1,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        # The address the other nodes reach this one at (node 0's: where its workers' store listens).
        local_addr=route.local_addr if route is not None else None,
        max_restarts=config.max_restarts,
        monitor_interval=0.05,
        start_method=config.start_method or "spawn",
        logs_specs=AttemptLogs(log_dir=os.path.join(run_dir, "logs")),
    )


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
