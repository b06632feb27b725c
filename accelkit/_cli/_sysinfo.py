"""Facts about this machine for a bug report, and the warnings ``accelkit launch`` prints.

The checks are pure functions of their inputs (a kernel release, a list of GPUs, a CPU
count), so they are tested with made-up values. :func:`launch_warnings` gathers the real
inputs cheaply: it runs on every ``accelkit launch`` and never imports torch or
initialises CUDA itself.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from .._options import is_int
from .._version import __version__

__all__ = [
    "LAUNCHER_VARIABLES",
    "facts",
    "gpu_warning",
    "kernel_warning",
    "launch_warnings",
    "oversubscription_warning",
    "timeout_sentence",
]

# A GPU as the checks see it: its model name and its memory in bytes (None: not known).
Device = tuple[str, int | None]

# Variables through which launchers (torchrun, Open MPI, MPICH / Intel MPI, SLURM) describe a worker.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
    "SLURM_NODEID", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
)  # fmt: skip
_MIN_KERNEL = (5, 5)


def facts() -> dict[str, str]:
    """What a bug report needs: versions, OS, CPUs, memory, devices, launcher variables, mpirun.

    Imports torch (and may initialise CUDA) to list the devices.

    Example:
        >>> from accelkit._cli._sysinfo import facts
        >>> facts()["python"]  # doctest: +SKIP
        '3.11.9 (CPython)'
    """
    import torch

    cpus, usable = os.cpu_count() or 1, usable_cpus()
    out = {
        "accelkit": __version__,
        "torch": torch.__version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "OS": f"{platform.system()} {platform.release()} ({platform.machine()}){_distribution()}",
        "CPUs": str(cpus) if usable == cpus else f"{cpus} ({usable} usable by this process)",
        "memory": _gib(total_memory()),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out[f"cuda:{i}"] = f"{props.name}, {_gib(props.total_memory)}"
    else:
        out["cuda"] = "not available"
    if torch.version.cuda:
        out["torch CUDA"] = torch.version.cuda
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        out["NCCL"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    out["MPS"] = _available(getattr(torch.backends, "mps", None))
    out["XPU"] = _available(getattr(torch, "xpu", None))
    found = {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}
    out["launcher variables"] = ", ".join(f"{k}={v}" for k, v in found.items()) or "none"
    mpirun = shutil.which("mpirun")
    out["mpirun"] = f"{mpirun} ({mpirun_version(mpirun)})" if mpirun else "not on PATH"
    return out


def launch_warnings(num_local_processes: int) -> list[str]:
    """Warnings about running ``num_local_processes`` processes on this node.

    Checks the Linux kernel version, GPUs of different models, and more processes than
    CPU cores. Cheap: lists GPUs through torch only when this process already
    initialised CUDA, else from ``/proc/driver/nvidia`` (skipped when
    ``CUDA_VISIBLE_DEVICES`` is set, since it already picks the devices).

    Example:
        >>> from accelkit._cli._sysinfo import launch_warnings
        >>> launch_warnings(1)  # doctest: +SKIP
        []
    """
    if not is_int(num_local_processes) or num_local_processes < 1:
        raise ValueError(
            f"launch_warnings(num_local_processes={num_local_processes!r}): expected the number of processes "
            f"started on this node, an integer >= 1"
        )
    found = [
        kernel_warning(platform.release()) if platform.system() == "Linux" else None,
        gpu_warning(local_gpus()),
        oversubscription_warning(num_local_processes, usable_cpus()),
    ]
    return [w for w in found if w]


def timeout_sentence(timeout: float, source: str) -> str:
    """What the collective timeout means, for ``accelkit env`` and ``accelkit launch --debug``.

    Example:
        >>> timeout_sentence(600, "default")[:56]
        'a collective that waits 600 s for the other processes f'
    """
    return (
        f"a collective that waits {timeout:g} s for the other processes fails the job "
        f"(timeout, {source}; set ACCELKIT_TIMEOUT or `timeout:` in the config file to change it)"
    )


def kernel_warning(release: str) -> str | None:
    """A warning when the Linux kernel ``release`` (``platform.release()``) is older than 5.5.

    Example:
        >>> kernel_warning("5.4.0-150-generic") is not None, kernel_warning("6.1.0")
        (True, None)
    """
    match = re.match(r"\s*(\d+)\.(\d+)", release)
    if match is None:  # not a version we can read: nothing to say
        return None
    version = (int(match.group(1)), int(match.group(2)))
    if version >= _MIN_KERNEL:
        return None
    return (
        f"Linux kernel {release} is older than {'.'.join(map(str, _MIN_KERNEL))}, which is known to hang "
        f"distributed jobs; upgrade the kernel"
    )


def gpu_warning(devices: Sequence[Device]) -> str | None:
    """A warning when this node's GPUs differ in model or memory: the slowest sets the pace.

    Example:
        >>> gpu_warning([("A100", 80 * 2**30), ("A100", 40 * 2**30)]) is not None
        True
    """
    kinds = sorted({(name, memory) for name, memory in devices}, key=str)
    if len(kinds) < 2:
        return None
    listed = "; ".join(
        f"{sum(1 for d in devices if d == kind)} x {kind[0]}" + (f" ({_gib(kind[1])})" if kind[1] else "")
        for kind in kinds
    )
    return (
        f"this node has GPUs of different models or memory ({listed}); the slowest sets the pace of every "
        f"step. Restrict the job to identical GPUs with CUDA_VISIBLE_DEVICES, e.g. CUDA_VISIBLE_DEVICES=0,1"
    )


def oversubscription_warning(num_processes: int, cpu_count: int) -> str | None:
    """A warning when more processes than CPU cores run on this node.

    Example:
        >>> print(oversubscription_warning(4, 2))  # doctest: +ELLIPSIS
        4 processes on 2 CPU cores: ... each process gets 1 thread ...
    """
    if num_processes <= cpu_count:
        return None
    threads = max(1, cpu_count // num_processes)  # what each worker gets without OMP_NUM_THREADS: here 1
    return (
        f"{num_processes} processes on {cpu_count} CPU cores: they compete for the cores, and each process "
        f"gets {threads} thread (cores // processes, at least 1). "
        f"Start at most {cpu_count} processes, or set OMP_NUM_THREADS to choose the threads per process"
    )


def local_gpus(env: Mapping[str, str] | None = None) -> list[Device]:
    """This node's GPUs, found without initialising CUDA; empty when unknown."""
    env = os.environ if env is None else env
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        count = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        return [(p.name, int(p.total_memory)) for p in props]
    if "CUDA_VISIBLE_DEVICES" in env:  # it already chose (or hid) the devices
        return []
    devices: list[Device] = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as f:
                model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("Model:")), None)
        except OSError:
            continue
        if model:
            devices.append((model, None))
    return devices


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def total_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def mpirun_version(path: str) -> str:
    """The first line of ``mpirun --version``, or why there is none."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"version unknown: {exc}"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0].strip() if lines else f"version unknown: exit code {done.returncode}"


def _distribution() -> str:
    try:
        name = platform.freedesktop_os_release().get("PRETTY_NAME")
    except (AttributeError, OSError):
        return ""
    return f", {name}" if name else ""


def _available(backend: object) -> str:
    is_available = getattr(backend, "is_available", None)
    return "available" if callable(is_available) and is_available() else "not available"


def _gib(size: int | None) -> str:
    return "unknown" if size is None else f"{size / 2**30:.1f} GiB"
