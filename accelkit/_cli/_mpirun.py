"""``accelkit launch --mpirun``: the script under Open MPI's ``mpirun`` instead of torch's agent.

The process state reads each rank from Open MPI's ``OMPI_COMM_WORLD_*`` variables; the
options, ``MASTER_ADDR`` and ``MASTER_PORT`` are forwarded with ``-x``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence

from .. import _env
from .._launcher import LaunchPlan
from ..errors import ConfigurationError
from ._script import Script, print_warnings


def mpirun_command(
    mpirun: str,
    num_processes: int,
    program: Sequence[str],
    exported: Iterable[str],
    *,
    hostfile: str | None = None,
    as_root: bool = False,
    oversubscribe: bool = False,
) -> list[str]:
    """Open MPI's command line for ``num_processes`` copies of ``program``.

    ``exported`` names the environment variables to forward to every process (``-x``).

    Example:
        >>> mpirun_command("mpirun", 2, ["python", "t.py"], ["ACCELKIT_CPU"], hostfile="hosts")
        ['mpirun', '-np', '2', '--hostfile', 'hosts', '-x', 'ACCELKIT_CPU', 'python', 't.py']
    """
    cmd = [mpirun, "-np", str(num_processes)]
    if as_root:
        cmd.append("--allow-run-as-root")  # Open MPI refuses root without it
    if oversubscribe:
        cmd.append("--oversubscribe")  # or Open MPI refuses more processes than cores
    if hostfile is not None:
        cmd += ["--hostfile", hostfile]
    for name in exported:
        cmd += ["-x", name]
    return [*cmd, *program]


def hostfile_hosts(path: str) -> list[str]:
    """The host names of an Open MPI host file, in order (``host slots=N`` lines, ``#`` comments)."""
    with open(path) as f:
        lines = [line.split("#", 1)[0].split() for line in f]
    return [words[0] for words in lines if words]


def run_mpirun(plan: LaunchPlan, script: Script) -> int:
    """Start the script under ``mpirun``; the exit code (failed ranks named on stderr)."""
    from .._launcher import free_port

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ConfigurationError(
            "--mpirun: no `mpirun` on PATH; install Open MPI (e.g. `apt install openmpi-bin`) or drop "
            "--mpirun to start the processes on torch's elastic agent"
        )
    _check_open_mpi(mpirun)
    nprocs = plan.local_processes()
    hostfile = plan.launch.hostfile
    hosts = hostfile_hosts(hostfile) if hostfile else []
    local = -(-nprocs // max(len(hosts), 1))  # processes on each machine, evenly spread
    print_warnings(local)
    cpus = os.cpu_count() or 1
    env = plan.worker_env()
    env["MASTER_ADDR"] = hosts[0] if hosts else "127.0.0.1"
    env["MASTER_PORT"] = str(plan.launch.master_port or free_port())
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, cpus // local))
    run_dir = tempfile.mkdtemp(prefix="accelkit-run-")
    env[_env.RUN_DIR] = run_dir
    cmd = mpirun_command(
        mpirun,
        nprocs,
        [sys.executable, *script.program()],
        sorted(env),
        hostfile=hostfile,
        as_root=os.geteuid() == 0,
        oversubscribe=not hosts and nprocs > cpus,
    )
    if plan.options.get("debug"):
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        plan.describe(f"{nprocs} process(es) with mpirun: {shown} {shlex.join(cmd)}")
    try:
        return _wait_mpirun(cmd, {**os.environ, **env}, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _check_open_mpi(mpirun: str) -> None:
    try:
        done = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30, check=False)
        version = (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        version = f"not runnable ({exc})"
    if "Open MPI" not in version and "OpenRTE" not in version:
        first = version.splitlines()[0] if version else "silent about its version"
        raise ConfigurationError(
            f"--mpirun builds Open MPI's command line, but {mpirun} is {first!r}. Install Open MPI, or start "
            f"the processes with your MPI yourself: mpirun -n N {sys.executable} -m accelkit._cli._worker script.py "
            f"(accelkit reads the rank from MPICH / Intel MPI variables too)"
        )


def _wait_mpirun(cmd: list[str], env: dict[str, str], run_dir: str) -> int:
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)  # mpirun passes it on to every process
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print("accelkit: interrupted; every process was stopped", file=sys.stderr)
        return 130
    if code == 0:
        return 0
    from .._launcher import collect_failures

    error = collect_failures(run_dir, {})
    if error.failures:
        print(f"accelkit: {error}", file=sys.stderr)
    else:
        print(f"accelkit: mpirun exited with code {code}", file=sys.stderr)
    return code if code > 0 else 1
