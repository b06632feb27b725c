"""``accelkit launch``: run a training script on several processes, machines, or under mpirun.

Each setting comes from (highest first) its flag, its ``ACCELKIT_*`` variable (process-state
options only), the config file, its default. The workers run on PyTorch's elastic agent
(torchrun's engine), or under Open MPI's ``mpirun`` with ``--mpirun``; either way each one
runs the script through :mod:`accelkit.cli._worker`, and the options reach it as ``ACCELKIT_*``
variables. Nothing here imports torch until a launch really starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _env
from .._options import DEFAULT_RDZV_TIMEOUT, PRECISIONS, STRATEGIES, validate
from ..errors import ConfigurationError
from ._types import int_at_least

if TYPE_CHECKING:
    from ..config._file import ConfigFile

RDZV_BACKENDS = ("static", "c10d")
# State options that have a flag here; their values reach the workers as ACCELKIT_* variables.
STATE_FLAGS = ("precision", "gradient_accumulation_steps", "debug", "cpu", "strategy")
# Launch settings: flag (dest) > config file > default.
LAUNCH_DEFAULTS: dict[str, Any] = {
    "num_processes": None,  # None: one per GPU, else 1
    "num_nodes": 1,
    "node_rank": 0,
    "master_addr": "127.0.0.1",
    "master_port": None,
    "max_restarts": 0,
    "rdzv_backend": "static",
    "rdzv_timeout": DEFAULT_RDZV_TIMEOUT,
    "mpirun": False,
    "hostfile": None,
    "gpu_ids": None,
}

_EPILOG = """\
Each setting comes from its flag, else its ACCELKIT_* variable (options for the script),
else the config file, else its default. Everything after the script goes to it unchanged.

examples:
  accelkit launch -n 2 train.py --lr 0.1        two processes on this machine
  accelkit launch --num-nodes 2 --node-rank 0 --main-process-ip 10.0.0.1 \\
      --main-process-port 29500 -n 8 train.py   node 0 of two (node 1: --node-rank 1)
  accelkit launch --mpirun -n 4 --hostfile hosts train.py
  accelkit launch -n 2 -m mypackage.train       run a module, like python -m
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``accelkit launch``; every one defaults to None (unset).

    Example:
        >>> p = argparse.ArgumentParser(prog="accelkit launch")
        >>> add_arguments(p)
        >>> p.parse_args(["-n", "2", "train.py", "--lr", "0.1"]).script_args
        ['--lr', '0.1']
    """
    # Abbreviations would make a script argument such as `--c` look like an ambiguous launch flag.
    parser.allow_abbrev = False
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keeps the examples' lines
    parser.epilog = _EPILOG
    procs = parser.add_argument_group("processes")
    procs.add_argument(
        "-n",
        "--num-processes",
        type=int_at_least(1),
        metavar="N",
        help="processes per node (default: one per GPU, else 1)",
    )
    procs.add_argument(
        "--max-restarts",
        type=int_at_least(0),
        metavar="N",
        help="restart every worker up to N times after a failure (default: 0)",
    )
    procs.add_argument(
        "--mpirun", action="store_true", default=None, help="start the processes with Open MPI's mpirun instead"
    )
    procs.add_argument("--hostfile", metavar="FILE", help="mpirun's host file: the machines to run on (with --mpirun)")
    nodes = parser.add_argument_group("machines (one `accelkit launch` per machine)")
    nodes.add_argument("--num-nodes", type=int_at_least(1), metavar="N", help="number of machines (default: 1)")
    nodes.add_argument(
        "--node-rank", type=int_at_least(0), metavar="K", help="this machine's rank, 0 .. N-1 (default: 0)"
    )
    nodes.add_argument(
        "--main-process-ip", dest="master_addr", metavar="IP", help="address of node 0, reachable from every node"
    )
    nodes.add_argument(
        "--main-process-port",
        dest="master_port",
        type=_port,
        metavar="PORT",
        help="a free port on node 0 (default: any free port, one node only)",
    )
    nodes.add_argument(
        "--rdzv-backend",
        choices=RDZV_BACKENDS,
        help="how the nodes meet: static node ranks, or torch's c10d (default: static)",
    )
    nodes.add_argument(
        "--rdzv-timeout",
        type=_seconds,
        metavar="SECONDS",
        help=f"how long the nodes wait for each other (default: {DEFAULT_RDZV_TIMEOUT:g})",
    )
    opts = parser.add_argument_group("options for the script (ak.state().options)")
    opts.add_argument("--precision", choices=PRECISIONS, help="default mixed precision (default: no)")
    opts.add_argument(
        "--gradient-accumulation-steps",
        type=int_at_least(1),
        metavar="N",
        help="micro-steps per optimizer step (default: 1)",
    )
    opts.add_argument("--strategy", choices=STRATEGIES, help="how ak.prepare wraps the model (default: ddp)")
    opts.add_argument("--cpu", action="store_true", default=None, help="run on the CPU even when GPUs are present")
    opts.add_argument(
        "--debug", action="store_true", default=None, help="check collectives across ranks, print what is launched"
    )
    parser.add_argument("--config-file", metavar="PATH", help="the config file to read (default: `accelkit config`'s)")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module, like `python -m`")
    parser.add_argument("target", metavar="script.py", help="the script to run (a module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="the script's own arguments")


@dataclass(frozen=True)
class Plan:
    """What ``accelkit launch`` runs: every setting resolved, with where it came from."""

    target: str
    module: bool
    script_args: tuple[str, ...]
    launch: dict[str, Any]  # LAUNCH_DEFAULTS' names; num_processes may still be None
    options: dict[str, object]  # the process-state options that are set, validated
    flags: tuple[str, ...]  # state options given as flags (the script's code must agree)
    sources: dict[str, str] = field(default_factory=dict)  # name -> "flag" | "environment" | "config" | "default"
    notes: tuple[str, ...] = ()

    def worker_env(self) -> dict[str, str]:
        """The variables every worker gets: the options, which came from flags, no config file."""
        options = {k: v for k, v in self.options.items() if v != ()}
        env = {**_env.option_env(options), _env.LAUNCH_FLAGS: ",".join(self.flags), _env.CONFIG_FILE: ""}
        gpu_ids = self.launch["gpu_ids"]
        if gpu_ids not in (None, "all"):
            env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
        return env

    def program(self) -> list[str]:
        """The workers' arguments after ``python``."""
        return ["-m", "accelkit.cli._worker", *(["--module"] if self.module else []), self.target, *self.script_args]


def resolve(args: argparse.Namespace, config: ConfigFile | None = None) -> Plan:
    """Merge flags, ``ACCELKIT_*`` variables, the config file and defaults; check them.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> resolve(p.parse_args(["--precision", "bf16", "train.py"])).options["precision"]  # doctest: +SKIP
        'bf16'
    """
    from .._options import _from_env

    sources: dict[str, str] = {}
    merged: dict[str, object] = {}
    layers: list[tuple[str, dict[str, object]]] = [
        ("config", dict(config.state) if config is not None else {}),
        ("environment", {k: _from_env(k, str(v)) for k, v in _env.option_overrides().items()}),
        ("flag", {k: getattr(args, k) for k in STATE_FLAGS if getattr(args, k) is not None}),
    ]
    for source, values in layers:
        merged.update(values)
        sources.update(dict.fromkeys(values, source))
    options = validate(merged, "accelkit launch")
    flags = tuple(k for k in STATE_FLAGS if getattr(args, k) is not None)

    launch: dict[str, Any] = {}
    from_config = dict(config.launch) if config is not None else {}
    for name, default in LAUNCH_DEFAULTS.items():
        given = getattr(args, name, None)
        if given is not None:
            launch[name], sources[name] = given, "flag"
        elif from_config.get(name) is not None:
            launch[name], sources[name] = from_config[name], "config"
        else:
            launch[name], sources[name] = default, "default"
    note = config.ignored_message() if config is not None else None
    notes = (note,) if note else ()
    plan = Plan(args.target, bool(args.module), tuple(args.script_args), launch, options, flags, sources, notes)
    _check(plan)
    return plan


def _check(plan: Plan) -> None:
    """Combinations no single flag's type can catch; each error names the flags and a fix."""
    launch = plan.launch
    nodes, node_rank = launch["num_nodes"], launch["node_rank"]
    if node_rank >= nodes:
        raise ConfigurationError(
            f"--node-rank {node_rank} with --num-nodes {nodes}: node ranks count from 0 to {nodes - 1}; "
            f"give each machine its own rank below the number of machines"
        )
    if launch["mpirun"]:
        if nodes > 1:
            raise ConfigurationError(
                f"--mpirun with --num-nodes {nodes}: mpirun places the processes itself; give the total with "
                f"-n and the machines with --hostfile, and run `accelkit launch` once, on one machine"
            )
        if launch["max_restarts"]:
            raise ConfigurationError(
                f"--mpirun with --max-restarts {launch['max_restarts']}: mpirun does not restart processes; "
                f"drop --max-restarts, or drop --mpirun to run on torch's elastic agent"
            )
        hostfile = launch["hostfile"]
        if hostfile is not None and not os.path.isfile(hostfile):
            raise ConfigurationError(f"--hostfile {hostfile!r} does not exist; point it to mpirun's host file")
    elif launch["hostfile"] is not None:
        raise ConfigurationError(
            f"--hostfile {launch['hostfile']!r} is for mpirun; add --mpirun, or drop --hostfile and start "
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


def _port(text: str) -> int:
    value = text.isdigit() and int(text)
    if not value or not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}; e.g. 29500")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}; e.g. 300")
    return value


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


def run(args: argparse.Namespace) -> int:
    """Launch; the exit code (0: every worker succeeded)."""
    try:
        plan = resolve(args, _load_config(args.config_file))
    except (ConfigurationError, ImportError) as exc:  # ImportError: PyYAML, to read a config file
        print(f"accelkit launch: error: {exc}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"accelkit: note: {note}", file=sys.stderr)
    try:
        if plan.launch["mpirun"]:
            from ._mpirun import run_mpirun

            return run_mpirun(plan)
        return _run_agent(plan)
    except ConfigurationError as exc:
        print(f"accelkit launch: error: {exc}", file=sys.stderr)
        return 2


def _load_config(explicit: str | None) -> ConfigFile | None:

    from ..config import config_path, load_config

    path = config_path(explicit)
    return load_config(path) if path is not None else None


def _num_processes(plan: Plan) -> int:
    if plan.launch["num_processes"] is not None:
        return int(plan.launch["num_processes"])
    gpu_ids = plan.launch["gpu_ids"]
    if gpu_ids not in (None, "all"):
        return len(str(gpu_ids).split(","))
    if plan.options.get("cpu"):
        return 1
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def _warn(num_local_processes: int) -> None:
    try:
        from ._sysinfo import launch_warnings
    except ImportError:  # pragma: no cover - a partial install
        return
    for warning in launch_warnings(num_local_processes):
        print(f"accelkit: warning: {warning}", file=sys.stderr)


def _describe(plan: Plan, head: str) -> None:
    """Debug mode: say what is launched, and where each setting came from."""
    print(f"accelkit: launching {head}", file=sys.stderr)
    for name in (*LAUNCH_DEFAULTS, *sorted(plan.options)):
        value = plan.launch[name] if name in LAUNCH_DEFAULTS else plan.options[name]
        print(f"accelkit:   {name} = {value!r} ({plan.sources.get(name, 'default')})", file=sys.stderr)


def _run_agent(plan: Plan) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ..errors import WorkerError
    from ..launcher._agent import AgentConfig, Command, run_workers

    launch, debug = plan.launch, bool(plan.options.get("debug"))
    nprocs = _num_processes(plan)
    _warn(nprocs)
    config = AgentConfig(
        num_processes=nprocs,
        num_nodes=launch["num_nodes"],
        node_rank=launch["node_rank"],
        master_addr=launch["master_addr"],
        master_port=launch["master_port"],
        max_restarts=launch["max_restarts"],
        quiet=not debug,
        rdzv_backend=launch["rdzv_backend"],
        rdzv_timeout=float(launch["rdzv_timeout"]),
    )
    if debug:
        world = nprocs * config.num_nodes
        what = f"{nprocs} process(es) on node {config.node_rank} of {config.num_nodes} (world size {world})"
        _describe(plan, f"{what}: {shlex.join([sys.executable, *plan.program()])}")
    try:
        run_workers(Command(tuple(plan.program())), (), {}, config, plan.worker_env())
    except WorkerError as exc:
        print(f"accelkit: {exc}", file=sys.stderr)
        code = exc.failures[0].exitcode if exc.failures else None
        return code if code is not None and code > 0 else 1
    except TimeoutError as exc:  # the nodes did not meet
        print(f"accelkit: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException):
        print("accelkit: interrupted; every worker was stopped", file=sys.stderr)
        return 130
    return 0
