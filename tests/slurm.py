"""A real SLURM cluster of one node on this machine: munged, slurmctld and slurmd from Debian's slurm-wlm.

Everything lives in one temporary folder (the munge key and socket, ``slurm.conf``, state, spool
and logs) and the daemons listen on free ports, so a cluster the machine may run already is left
alone. Client commands (``srun``, ``sbatch``, ``scancel``, ``scontrol``) find it through
``SLURM_CONF``, which :meth:`Cluster.env` sets. Needs root (the daemons run as root, and so do
the jobs); :func:`why_not` says why a cluster cannot be made here, :func:`cluster` raises
:class:`Unavailable` with the daemons' logs when one does not start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from processes import alive, subprocess_env

from accelkit._launcher import free_port as daemon_port  # free now, not kept: slurm's daemons bind it themselves

COMMANDS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "sinfo", "squeue")


class Unavailable(RuntimeError):
    """The daemons did not start: the message says which one, with the end of its log."""


@dataclass
class Cluster:
    """One running cluster: its folder, configuration, node name and daemons (munged, slurmctld, slurmd)."""

    root: Path
    node: str
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """A test subprocess's environment (:func:`subprocess_env`) that reaches this cluster."""
        return subprocess_env(SLURM_CONF=str(self.conf), **extra)

    def run(self, argv: Sequence[str], timeout: float = 30, **extra: str) -> str:
        """Run a client command to its end; its stdout (raises with its stderr on failure)."""
        done = subprocess.run(list(argv), env=self.env(**extra), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of a job (the controller keeps finished jobs for minutes)."""
        fields = self.run(["scontrol", "-o", "show", "job", job_id]).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job_id: str, timeout: float = 180) -> dict[str, str]:
        """The job's fields once it left the queue (finished, failed or cancelled)."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields['JobState']} after {timeout:g} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel what still runs, stop the daemons (SIGTERM, then SIGKILL), remove the folder."""
        if self.daemons and self.daemons[-1].poll() is None:
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--user", "root"])
                deadline = time.monotonic() + 30
                while self.run(["squeue", "-h"]).strip() and time.monotonic() < deadline:
                    time.sleep(0.2)
        for proc in reversed(self.daemons):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.daemons.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def job_processes(job_id: str) -> dict[int, str]:
    """Every process that runs for ``job_id`` (``SLURM_JOB_ID`` in its environment), pid to command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"SLURM_JOB_ID={job_id}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if alive(int(entry)):
            found[int(entry)] = command
    return found


def why_not() -> str | None:
    """Why a SLURM cluster cannot be made on this machine, or None when it can be tried."""
    if os.geteuid() != 0:
        return "a SLURM cluster for the tests needs root (its daemons run as root)"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return None


def _conf(root: Path, node: str, ports: tuple[int, int]) -> str:
    cpus = max(os.cpu_count() or 1, 2)  # srun -n 2 needs two; SLURM is told what it should see, not checked
    return f"""\
ClusterName=accelkit
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
# No cgroups (a container may not delegate them): processes are tracked through their parents.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def cluster(timeout: float = 60) -> Iterator[Cluster]:
    """Start a one-node cluster and wait until its node is idle; yield it, then stop it and remove its folder.

    Raises :class:`Unavailable` when a daemon exits or the node is not idle within ``timeout`` s.
    """
    # munged wants its socket's folder, and the folders above, searchable by everyone.
    root = Path(tempfile.mkdtemp(prefix="accelkit-slurm-"))
    root.chmod(0o755)
    slurm = Cluster(root, socket.gethostname().split(".")[0])
    try:
        for sub in ("state", "spool"):
            (root / sub).mkdir()
        key = root / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # readable by root only, from the start
        os.write(fd, os.urandom(128))
        os.close(fd)
        slurm.conf.write_text(_conf(root, slurm.node, (daemon_port(), daemon_port())))
        munged = ["munged", "--foreground", f"--key-file={key}", f"--socket={root}/munge.socket",
                  f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed",
                  f"--log-file={root}/munged.log"]  # fmt: skip
        conf = str(slurm.conf)
        for argv in [munged, ["slurmctld", "-D", "-c", "-i", "-f", conf], ["slurmd", "-D", "-f", conf]]:
            log = open(root / f"{argv[0]}.out", "wb")  # the daemon writes it until stopped
            slurm.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            if argv[0] == "munged":
                _wait_for(lambda: (root / "munge.socket").exists(), slurm, timeout)
        _wait_for(lambda: slurm.run(["sinfo", "-h", "-o", "%T"]).strip() == "idle", slurm, timeout)
        yield slurm
    finally:
        slurm.stop()


def _wait_for(ready: Callable[[], bool], slurm: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for proc in slurm.daemons:
            if proc.poll() is not None:
                raise Unavailable(f"{proc.args[0]} exited with {proc.returncode}:\n{_tail(slurm.root, proc.args[0])}")
        with contextlib.suppress(Exception):
            if ready():
                return
        if time.monotonic() > deadline:
            logs = "\n".join(_tail(slurm.root, str(p.args[0])) for p in slurm.daemons)
            raise Unavailable(f"the SLURM node was not idle within {timeout:g} s:\n{logs}")
        time.sleep(0.2)


def _tail(root: Path, daemon: str, lines: int = 15) -> str:
    try:
        text = (root / f"{daemon}.out").read_text(errors="replace")
    except OSError:
        return f"{daemon}: no output"
    return "\n".join(text.splitlines()[-lines:])  # each line starts with the daemon's name
