"""The worker side of a function launch: run the job, hand its result or its failure back.

Spawned workers start as a command, ``python -c BOOT JOB_FILE LAUNCHER_PID`` (:func:`command`),
which loads the function the way ``multiprocessing``'s spawn does: the launching process's
``sys.path``, ``sys.argv`` and working directory, its main script run again as ``__mp_main__``
(so a function defined in it unpickles), then the job. The elastic agent starts them as it
starts torchrun's workers: no ``multiprocessing`` start-up (its resource tracker, its queues) and
none of the agent's modules in the workers. Each worker writes its return value to the run
directory, where :func:`read_results` finds it. Forked workers (notebooks) run :func:`worker_main`
in ``multiprocessing`` processes and return through the agent.
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import threading

    from ._spec import Job

__all__ = ["command", "main", "read_results", "worker_main"]

# What the worker's interpreter runs: this module from the launching process's accelkit (argv[1]: its root).
_BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from accelkit._launcher._function_worker import main; main()"
_JOB_FILE = "job.pickle"


def command(job: Job) -> tuple[str, list[str]]:
    """The program (the interpreter) and arguments that run ``job`` in a worker; writes the job file."""
    import multiprocessing.spawn
    import subprocess

    prep = multiprocessing.spawn.get_preparation_data("SpawnProcess")
    prep["authkey"] = bytes(prep["authkey"])  # as spawn sends it (the run directory is the user's alone)
    path = os.path.join(job.run_dir, _JOB_FILE)
    with open(path, "wb") as f:
        pickle.dump(prep, f, pickle.HIGHEST_PROTOCOL)
        pickle.dump(job, f, pickle.HIGHEST_PROTOCOL)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags: list[str] = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]  # -X, -O, ... as spawn
    args = [*flags, "-c", _BOOT, root, path, str(os.getpid())]
    return os.fsdecode(multiprocessing.spawn.get_executable() or sys.executable), args


def main() -> None:
    """A spawned worker's process: ``sys.argv`` is ``["-c", JOB_FILE, LAUNCHER_PID]``."""
    from ._lifeline import die_with_parent

    path, launcher = sys.argv[1], int(sys.argv[2])
    die_with_parent(launcher)  # a launcher killed with SIGKILL takes its workers along, even while they import
    job = _load(path)
    try:
        result = worker_main(job)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)  # Ctrl-C, or the agent stopping its workers with it: the launcher says so once
    except BaseException:
        sys.exit(1)  # worker_main recorded it: the launcher's WorkerError (or restart line) shows the traceback
    _write_result(job.run_dir, result)


def _load(path: str) -> Job:
    """Prepare this process as spawn does (the main script as ``__mp_main__``), then unpickle the job."""
    import multiprocessing
    import multiprocessing.spawn

    process: Any = multiprocessing.current_process()
    process._inheriting = True  # an unguarded launch in the main script, run again here, is refused
    try:
        with open(path, "rb") as f:
            prep = pickle.load(f)
            prep["name"] = _process_name()
            multiprocessing.spawn.prepare(prep)
            job: Job = pickle.load(f)
        return job
    except BaseException as exc:
        from .._rundir import record_failure

        record_failure(exc, run_dir=os.path.dirname(path))  # e.g. the main script failed to import here
        raise
    finally:
        del process._inheriting


def _process_name() -> str:
    return f"SpawnProcess-{int(os.environ.get('LOCAL_RANK', '0')) + 1}"


def _write_result(run_dir: str, result: Any) -> None:
    try:
        data = pickle.dumps(result, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        from .._rundir import record_failure

        error = TypeError(
            f"the return value ({type(result).__qualname__}) cannot be sent to the launching process: {exc}. "
            f"Return what pickle can send (numbers, strings, tensors, lists and dicts of them)"
        )
        record_failure(error, f"{error}\n", run_dir)
        sys.exit(1)
    folder = os.path.join(run_dir, "results")
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.pickle")
    with open(f"{final}.{os.getpid()}", "wb") as f:
        f.write(data)
    os.replace(f"{final}.{os.getpid()}", final)


def read_results(run_dir: str, ranks: list[int]) -> dict[int, Any]:
    """The return values the workers of ``ranks`` wrote (``None`` for one that wrote none, e.g. exited)."""
    results: dict[int, Any] = {}
    for rank in ranks:
        try:
            with open(os.path.join(run_dir, "results", f"rank{rank}.pickle"), "rb") as f:
                results[rank] = pickle.load(f)
        except FileNotFoundError:
            results[rank] = None
    return results


def worker_main(job: Job) -> Any:
    """The entry point of every worker process."""
    from .. import _state
    from .._rundir import record_failure, record_stacks
    from ._lifeline import die_with_parent
    from ._spec import FunctionRef
    from ._streams import apply_logging, whole_lines_to_notebook

    die_with_parent(job.launcher_pid)  # a launcher killed with SIGKILL takes its workers along
    # Never collected here, what this process has so far: a forked worker's is the launcher's, and a destructor
    # run in the copy (an object owning a C++ thread joins a thread that only the launcher has) aborts it.
    gc.freeze()
    record_stacks(job.run_dir)  # a death by signal (a backend's abort, SIGTERM) shows where it was
    os.environ.update(job.env)
    whole_lines_to_notebook()
    if job.logging is not None:
        apply_logging(job.logging)
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    timer = _start_watchdog(job) if job.watchdog else None
    try:
        fn = job.target.resolve() if isinstance(job.target, FunctionRef) else job.target
        return fn(*job.args, **job.kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            record_failure(exc, run_dir=job.run_dir)
            _state.this_process.end_tracking(failed=True)
        raise
    except BaseException as exc:
        record_failure(exc, run_dir=job.run_dir)
        _state.this_process.end_tracking(failed=True)  # what was logged stays readable, and the run is marked failed
        raise
    finally:
        if timer is not None:
            timer.cancel()
        _state.reset_state()


def _start_watchdog(job: Job) -> threading.Timer:
    import threading
    import traceback

    from .. import _env
    from .._rundir import record_failure

    main = threading.main_thread()

    def expire() -> None:
        frames = sys._current_frames()
        frame = frames.get(main.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else ""
        for thread in threading.enumerate():  # a wait on the main thread is often a wait for another thread
            other = frames.get(thread.ident or -1)
            if thread is not main and other is not None and thread is not threading.current_thread():
                where += f"thread {thread.name!r} was at:\n" + "".join(traceback.format_stack(other))
        rank = _env.read_int("RANK") or 0
        exc = TimeoutError(f"rank {rank} did not finish within {job.watchdog:g} s")
        record_failure(exc, f"{exc}; it was at:\n{where}", job.run_dir)
        os._exit(70)

    timer = threading.Timer(job.watchdog or 0, expire)
    timer.daemon = True
    timer.start()
    return timer
