"""What ``accelkit launch`` runs: every setting resolved (flag > ``ACCELKIT_*`` > config > default)
and checked, with where it came from. Shared by the elastic-agent path and ``--mpirun``.

Torch-free until a launch really starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _env
from .._options import LaunchSettings
from ..config import resolve
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..config import ConfigFile, Source

__all__ = ["STATE_FLAGS", "LaunchPlan", "describe", "local_processes", "plan_launch", "print_warnings"]

# State options that have a flag; their values reach the workers as ACCELKIT_* variables.
STATE_FLAGS = ("precision", "gradient_accumulation_steps", "debug", "cpu", "strategy", "log_with", "project_dir")


@dataclass(frozen=True)
class LaunchPlan:
    """What ``accelkit launch`` runs: every setting resolved, with where it came from."""

    target: str
    module: bool
    script_args: tuple[str, ...]
    launch: LaunchSettings  # num_processes may still be None (one per GPU)
    options: dict[str, object]  # the process-state options that are set (not defaults), validated
    flags: tuple[str, ...]  # state options given as flags (the script's code must agree)
    sources: dict[str, Source]
    notes: tuple[str, ...] = ()

    def worker_env(self) -> dict[str, str]:
        """The variables every worker gets: the options, which came from flags, no config file."""
        options = {k: v for k, v in self.options.items() if v != ()}
        env = {**_env.option_env(options), _env.LAUNCH_FLAGS: ",".join(self.flags), _env.CONFIG_FILE: ""}
        if self.launch.gpu_ids not in (None, "all"):
            env["CUDA_VISIBLE_DEVICES"] = str(self.launch.gpu_ids)
        return env

    def program(self) -> list[str]:
        """The workers' arguments after ``python``."""
        return ["-m", "accelkit.cli._worker", *(["--module"] if self.module else []), self.target, *self.script_args]


def plan_launch(args: argparse.Namespace, config: ConfigFile | None = None) -> LaunchPlan:
    """Merge flags, ``ACCELKIT_*`` variables, the config file and defaults; check them.

    Example:
        >>> from accelkit.cli.launch import add_arguments
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> plan_launch(p.parse_args(["--precision", "bf16", "train.py"])).options["precision"]  # doctest: +SKIP
        'bf16'
    """
    names = (*STATE_FLAGS, *LaunchSettings.names())
    flags = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    resolved = resolve(flags, call="accelkit launch", source="flag", config=config)
    set_options = resolved.given("flag", "environment", "config")
    note = config.ignored_message() if config is not None else None
    plan = LaunchPlan(
        target=args.target,
        module=bool(args.module),
        script_args=tuple(args.script_args),
        launch=resolved.launch,
        options=set_options,
        flags=tuple(k for k in STATE_FLAGS if k in flags),
        sources=dict(resolved.sources),
        notes=(note,) if note else (),
    )
    _check(plan)
    return plan


def local_processes(plan: LaunchPlan) -> int:
    """How many processes this node starts: ``-n``, else one per listed GPU, else one per device."""
    if plan.launch.num_processes is not None:
        return plan.launch.num_processes
    if plan.launch.gpu_ids not in (None, "all"):
        return len(str(plan.launch.gpu_ids).split(","))
    from .._backends import local_device_count  # imports torch: only to count devices

    return local_device_count(bool(plan.options.get("cpu")))


def print_warnings(num_local_processes: int) -> None:
    """The machine's warnings for this many processes (old kernel, mixed GPUs, too few cores)."""
    from ._sysinfo import launch_warnings

    for warning in launch_warnings(num_local_processes):
        print(f"accelkit: warning: {warning}", file=sys.stderr)


def describe(plan: LaunchPlan, head: str) -> None:
    """Debug mode: say what is launched, and where each setting came from."""
    print(f"accelkit: launching {head}", file=sys.stderr)
    for name in (*LaunchSettings.names(), *sorted(plan.options)):
        if name == "start_method":
            continue
        value = getattr(plan.launch, name) if name in LaunchSettings.names() else plan.options[name]
        print(f"accelkit:   {name} = {value!r} ({plan.sources.get(name, 'default')})", file=sys.stderr)


def _check(plan: LaunchPlan) -> None:
    """Combinations no single flag's type can catch; each error names the flags and a fix."""
    launch = plan.launch
    nodes, node_rank = launch.num_nodes, launch.node_rank
    if node_rank >= nodes:
        raise ConfigurationError(
            f"--node-rank {node_rank} with --num-nodes {nodes}: node ranks count from 0 to {nodes - 1}; "
            f"give each machine its own rank below the number of machines"
        )
    if launch.mpirun:
        if nodes > 1:
            raise ConfigurationError(
                f"--mpirun with --num-nodes {nodes}: mpirun places the processes itself; give the total with "
                f"-n and the machines with --hostfile, and run `accelkit launch` once, on one machine"
            )
        if launch.max_restarts:
            raise ConfigurationError(
                f"--mpirun with --max-restarts {launch.max_restarts}: mpirun does not restart processes; "
                f"drop --max-restarts, or drop --mpirun to run on torch's elastic agent"
            )
        hostfile = launch.hostfile
        if hostfile is not None and not os.path.isfile(hostfile):
            raise ConfigurationError(f"--hostfile {hostfile!r} does not exist; point it to mpirun's host file")
    elif launch.hostfile is not None:
        raise ConfigurationError(
            f"--hostfile {launch.hostfile!r} is for mpirun; add --mpirun, or drop --hostfile and start "
            f"`accelkit launch --num-nodes N --node-rank K` on each machine"
        )
    elif nodes > 1:
        needed = (("master_addr", "--main-process-ip", "10.0.0.1"), ("master_port", "--main-process-port", "29500"))
        for name, flag, example in needed:
            if plan.sources[name] == "default":
                raise ConfigurationError(
                    f"--num-nodes {nodes} needs {flag}: every node must meet node 0 at the same address and "
                    f"port, e.g. {flag} {example}"
                )
    if plan.module:
        _check_module(plan.target)
    elif not os.path.isfile(plan.target):
        what = "is a directory" if os.path.isdir(plan.target) else "does not exist"
        raise ConfigurationError(
            f"script {plan.target!r} {what} (in {os.getcwd()}); give the path of a Python file, "
            f"or -m NAME to run a module"
        )


def _check_module(name: str) -> None:
    from importlib.machinery import PathFinder

    top = name.split(".")[0]
    # Only the top-level name is looked up: importing packages here could start CUDA in the launcher.
    if not top.isidentifier() or PathFinder.find_spec(top, [os.getcwd(), *sys.path[1:]]) is None:
        if top in sys.builtin_module_names:
            return
        raise ConfigurationError(
            f"-m {name}: no module {top!r} on the path (searched the current directory {os.getcwd()} and "
            f"sys.path); install it, or run `accelkit launch` from the directory that contains it"
        )
