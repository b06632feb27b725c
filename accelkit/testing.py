"""Helpers to test distributed code for real: N gloo workers on 127.0.0.1, on the CPU or one GPU.

- :func:`run_distributed` starts fresh workers (the same path as ``@ak.distributed``) and
  returns every rank's result.
- :class:`WorkerPool` keeps a group of workers alive and sends them one task after
  another, so that property tests do not pay a process start per example.
- :func:`free_port` gives a TCP port on 127.0.0.1 for a test that starts its own launch
  (``master_port=free_port()``) or store, kept from every other process meanwhile.

``device="cpu"`` (the default) keeps every worker on the CPU on every path: in every task,
after a restart, and when a task resets the state (``ak.reset_state()``, then ``ak.init(...)``),
whatever the machine has. ``device="cuda"`` puts every rank on the one visible GPU (cuda:0),
over gloo, which moves CUDA tensors through host memory: multi-process CUDA paths (DDP, the
loader, ``gather_for_metrics``, the collectives) can be tested on a single-GPU machine. Both
are pinned through ``ACCELKIT_TEST_DEVICE`` in the workers' environment. (FSDP2 trains there,
but DTensor's gathers, ``full_tensor()`` and so ``ak.full_state_dict`` of a sharded model, go
through torch's functional collectives, which crashed gloo with CUDA tensors in torch 2.11:
compare each rank's shard, ``to_local()``, instead.)

Functions sent to workers must be defined at module level (workers import them by name).
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, get_args

from . import _env, _frames, _state
from ._launcher import check_picklable, run_workers
from ._options import LaunchSettings, StateOptions, validate
from ._rundir import exception_name, lost_peer
from .errors import WorkerError, WorkerFailure

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["WorkerDevice", "WorkerPool", "free_port", "run_distributed"]

WorkerDevice = Literal["cpu", "cuda"]
_DEVICES: tuple[str, ...] = get_args(WorkerDevice)
_KEPT_PORTS = 64
_kept: list[socket.socket] = []  # the ports free_port() gave, still bound here (the last _KEPT_PORTS)
_kept_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a test's own launch or store (``master_port=free_port()``), kept for it.

    The port stays bound in this process, with ``SO_REUSEADDR`` and never listening, until 64 more
    ports have been asked for or the process ends: the kernel gives it to no other socket meanwhile
    (no other process's ``bind`` to port 0, no outgoing connection), while the server the test
    starts binds it all the same (``TCPStore``, torchrun's and accelkit's launchers bind with
    ``SO_REUSEADDR``). A port that was only free when asked could be taken by another process in
    the seconds a busy machine needs to start that server: the launch would fail, or a rank told
    that port would join another job's store and take a rank's place there.

    Example:
        >>> from accelkit.testing import free_port
        >>> 1024 < free_port() < 65536
        True
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    with _kept_lock:
        if not _kept:
            atexit.register(_release_ports)  # again after each release: a later test may ask for more
        _kept.append(sock)
        if len(_kept) > _KEPT_PORTS:
            _kept.pop(0).close()
    return int(sock.getsockname()[1])


def _release_ports() -> None:
    """At exit: close the ports still kept (left to the interpreter's teardown, each says ResourceWarning)."""
    with _kept_lock:
        while _kept:
            _kept.pop().close()


def _worker_env(device: object, options: dict[str, Any], call: str) -> dict[str, str]:
    """The environment that carries ``options`` and the pinned ``device`` into the workers."""
    if device not in _DEVICES:
        raise ValueError(f"{call}(device={device!r}): expected one of {', '.join(map(repr, _DEVICES))}")
    state_options = validate(options, call)
    if state_options.get("cpu", device == "cpu") != (device == "cpu"):
        raise ValueError(
            f"{call}(device={device!r}, cpu={options['cpu']!r}): the workers' device is chosen by device= alone; "
            f"drop cpu=, and pass device='cpu' or device='cuda'"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{call}(device='cuda'): torch sees no CUDA device here; skip the test without one, "
                f"e.g. @pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')"
            )
    state_options["cpu"] = device == "cpu"
    return {**_env.option_env(state_options), _env.TEST_DEVICE: str(device)}


def run_distributed(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    num_processes: int = 2,
    device: WorkerDevice = "cpu",
    task_timeout: float = 120.0,
    max_restarts: int = 0,
    **options: Unpack[StateOptions],
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_processes`` workers on ``device``; each rank's result.

    A worker that raises, dies or runs past ``task_timeout`` seconds stops the others and
    raises :class:`~accelkit.WorkerError` with its traceback (for a timeout: where it was).

    Args:
        fn: the function to run on every worker (defined at a module's top level).
        args: its positional arguments.
        kwargs: its keyword arguments.
        num_processes: the number of workers.
        device: ``"cpu"``, or ``"cuda"`` (every rank on cuda:0, over gloo).
        task_timeout: the seconds the workers may run before they are stopped.
        max_restarts: restarts of the whole group after a failure, as ``@ak.distributed``'s.
        **options: state options (``precision``, ``debug``, ``timeout`` for collectives, ...).

    Example:
        >>> from accelkit.testing import run_distributed
        >>> import accelkit as ak
        >>> run_distributed(ak.world_size)  # doctest: +SKIP
        [2, 2]
    """
    env = _worker_env(device, dict(options), "accelkit.testing.run_distributed")
    config = LaunchSettings(num_processes=num_processes, max_restarts=max_restarts, start_method="spawn")
    results = run_workers(fn, tuple(args), dict(kwargs or {}), config, env, watchdog=task_timeout)
    return [results[r] for r in sorted(results)]


class WorkerPool:
    """A long-lived group of ``num_processes`` gloo workers that run tasks in turn.

    Each worker joins the process group once, with ``options`` (e.g. ``debug=True``),
    then runs every task it is sent, with fresh training state. A task that raises on
    every rank leaves the group usable; any other failure (some ranks stuck, dead or
    done) restarts the group for the next task.

    Args:
        num_processes: the number of workers.
        device: ``"cpu"``, or ``"cuda"`` (every worker on cuda:0, over gloo).
        task_timeout: the seconds a task may run before the pool stops it and raises.
        grace: once a rank has failed, the seconds the others get to finish before they are stopped.
        **options: state options for the workers (``debug=True``, ``precision="bf16"``, ...).

    Example:
        >>> import accelkit as ak
        >>> from accelkit.testing import WorkerPool
        >>> with WorkerPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(ak.rank)
        [0, 1]
    """

    def __init__(
        self,
        num_processes: int = 2,
        *,
        device: WorkerDevice = "cpu",
        task_timeout: float = 60.0,
        grace: float = 5.0,
        **options: Unpack[StateOptions],
    ) -> None:
        self.num_processes = num_processes
        self.device = device
        self.task_timeout = task_timeout
        self.grace = grace
        self._env = _worker_env(device, dict(options), "accelkit.testing.WorkerPool")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._ids = itertools.count()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def run(self, fn: Callable[..., Any], *args: Any, task_timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        check_picklable(fn, args, kwargs, "spawn")
        self._start()
        task = next(self._ids)
        message = pickle.dumps((task, fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(task, task_timeout or self.task_timeout)

    def close(self) -> None:
        """Stop every worker (politely, then by force) and wait for them."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _start(self) -> None:
        if self._procs:
            return
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        for rank in range(self.num_processes):
            parent, child = ctx.Pipe()
            env = {
                **self._env,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.num_processes),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.num_processes),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            proc = ctx.Process(target=_pool_worker, args=(env, child), daemon=True, name=f"accelkit-pool-{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        try:
            self._collect(-1, self.task_timeout)
        except BaseException:
            self.close()
            raise

    def _collect(self, task: int, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, WorkerFailure] = {}
        deadline = time.monotonic() + timeout
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        pending = set(range(self.num_processes))
        restart = False  # a worker closed its process group (its collectives were out of step)
        while pending and time.monotonic() < deadline:
            waitables: list[Any] = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for ready in multiprocessing.connection.wait(waitables, timeout=max(0.0, deadline - time.monotonic())):
                if isinstance(ready, int):  # a process ended
                    rank = by_sentinel[ready]
                    if rank in pending and not self._conns[rank].poll():
                        failures[rank] = _died(rank, self._procs[rank])
                        pending.discard(rank)
                    continue
                rank = by_conn[id(ready)]
                try:
                    got_task, ok, value, closed = pickle.loads(ready.recv_bytes())  # type: ignore[union-attr]
                except EOFError:  # the worker is gone
                    failures[rank] = _died(rank, self._procs[rank])
                    pending.discard(rank)
                    continue
                if got_task != task:
                    continue  # a late answer to an abandoned task
                restart = restart or closed
                pending.discard(rank)
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = value
            if failures:
                deadline = min(deadline, time.monotonic() + self.grace)
        if restart:
            self.close()  # the next task starts a fresh group
        if not pending and not failures:
            return [results[r] for r in range(self.num_processes)]
        stuck = bool(pending)
        for rank in pending:
            failures[rank] = _stuck(rank, self._procs[rank], timeout if not failures else self.grace)
        if stuck or len(failures) < self.num_processes or any(f.exc_type == "" for f in failures.values()):
            # Some ranks are stuck, went on or died: their collectives may be out of step. Start afresh.
            self.close()
        raise WorkerError(list(failures.values()), what="worker pool task")


def _pool_worker(env: dict[str, str], conn: multiprocessing.connection.Connection) -> None:
    import torch

    os.environ.update(env)
    torch.set_num_threads(1)
    rank = int(env["RANK"])
    try:
        _state.get()  # join the process group once, up front
        conn.send_bytes(pickle.dumps((-1, True, None, False)))
    except BaseException as exc:
        conn.send_bytes(pickle.dumps((-1, False, _failure(rank, exc), False)))
        return
    try:
        while True:
            try:
                item = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if item is None:
                break
            task, fn, args, kwargs = item
            _state.new_task()  # each task starts afresh: no training objects, no options or trackers from earlier tasks
            try:
                value = fn(*args, **kwargs)
                closed = bool(_state.group.closed)  # the group is unusable: the pool starts a new one
                answer = pickle.dumps((task, True, value, closed))
            except BaseException as exc:
                closed = bool(_state.group.closed)
                answer = pickle.dumps((task, False, _failure(rank, exc), closed))
            conn.send_bytes(answer)
            if closed:
                break
    finally:
        _state.reset_state()
        conn.close()


def _failure(rank: int, exc: BaseException) -> WorkerFailure:
    text = _frames.user_traceback(exc)
    return WorkerFailure(rank, rank, os.getpid(), 1, exception_name(exc), str(exc), text, time.time(), lost_peer(exc))


def _died(rank: int, proc: multiprocessing.process.BaseProcess) -> WorkerFailure:
    proc.join(5)  # reap it, so that its exit code is known
    return WorkerFailure(rank, rank, proc.pid, proc.exitcode, "", "", "", time.time())


def _stuck(rank: int, proc: multiprocessing.process.BaseProcess, waited: float) -> WorkerFailure:
    message = f"rank {rank} did not answer within {waited:g} s (stuck in a collective?)"
    return WorkerFailure(rank, rank, proc.pid, None, "TimeoutError", message, "", time.time())
