"""The script ``accelkit launch`` runs, and its launch plan from the flags.

The settings are merged and checked by :func:`accelkit._launcher.plan_launch`, as for
``@ak.distributed``; here only what is the command line's own: the script or module to run,
and the machine's warnings. Shared by the elastic-agent path and ``--mpirun``.

Torch-free until a launch really starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._launcher import LaunchPlan, plan_launch
from .._options import LaunchSettings
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from .._config import ConfigFile

__all__ = ["STATE_FLAGS", "Script", "print_warnings", "read_launch"]

# State options that have a flag; their values reach the workers as ACCELKIT_* variables.
STATE_FLAGS = ("precision", "gradient_accumulation_steps", "debug", "cpu", "strategy", "log_with", "project_dir",
               "dp_replicate", "dp_shard", "tp", "cp")  # fmt: skip


@dataclass(frozen=True)
class Script:
    """The script (or module, with ``-m``) the workers run, and its own arguments."""

    target: str
    module: bool
    args: tuple[str, ...]

    def program(self) -> list[str]:
        """The workers' arguments after ``python``."""
        return ["-m", "accelkit._cli._worker", *(["--module"] if self.module else []), self.target, *self.args]

    def check(self) -> None:
        """The script exists (a module: its top-level package can be found), else a clear error."""
        if self.module:
            _check_module(self.target)
        elif not os.path.isfile(self.target):
            what = "is a directory" if os.path.isdir(self.target) else "does not exist"
            raise ConfigurationError(
                f"script {self.target!r} {what} (in {os.getcwd()}); give the path of a Python file, "
                f"or -m NAME to run a module"
            )


def read_launch(args: argparse.Namespace, config: ConfigFile | None = None) -> tuple[LaunchPlan, Script]:
    """The launch plan from the flags (``ACCELKIT_*`` variables, the config file, defaults below them), and the script.

    Example:
        >>> from accelkit._cli.launch import add_arguments
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> read_launch(p.parse_args(["--precision", "bf16", "train.py"]))[0].options["precision"]  # doctest: +SKIP
        'bf16'
    """
    names = (*STATE_FLAGS, *LaunchSettings.names())
    flags = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    fixed = tuple(k for k in STATE_FLAGS if k in flags)
    plan = plan_launch(flags, call="accelkit launch", given_as="flag", fixed=fixed, config=config)
    script = Script(args.target, bool(args.module), tuple(args.script_args))
    script.check()
    return plan, script


def print_warnings(num_local_processes: int) -> None:
    """The machine's warnings for this many processes (old kernel, mixed GPUs, too few cores)."""
    from ._sysinfo import launch_warnings

    for warning in launch_warnings(num_local_processes):
        print(f"accelkit: warning: {warning}", file=sys.stderr)


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
