"""``accelkit launch``: run a training script on several processes, machines, or under mpirun.

Each setting comes from (highest first) its flag, its ``ACCELKIT_*`` variable (process-state
options only), the config file, its default. The workers run on PyTorch's elastic agent
(torchrun's engine), or under Open MPI's ``mpirun`` with ``--mpirun``; either way each one
runs the script through :mod:`accelkit._cli._worker`, and the options reach it as ``ACCELKIT_*``
variables. Nothing here imports torch until a launch really starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
import warnings

from .._config import config_in_effect
from .._launcher import LaunchPlan
from .._options import DEFAULT_RDZV_TIMEOUT, DEFAULT_TIMEOUT, PRECISIONS, RDZV_BACKENDS, STRATEGIES, TRACKERS
from ..errors import ConfigurationError
from ._script import Script, print_warnings, read_launch
from ._sysinfo import timeout_sentence
from ._types import int_at_least, precision

_EPILOG = """\
Each setting comes from its flag, else its ACCELKIT_* variable (options for the script),
else the config file, else its default. Everything after the script goes to it unchanged.
accelerate launch's spellings (--num_processes, --mixed_precision, ...) work too.

examples:
  accelkit launch -n 2 train.py --lr 0.1        two processes on this machine
  accelkit launch --num-nodes 2 --node-rank 0 --main-process-ip 10.0.0.1 \\
      --main-process-port 29500 -n 8 train.py   node 0 of two (node 1: --node-rank 1)
  accelkit launch --mpirun -n 4 --hostfile hosts train.py
  accelkit launch -n 2 -m mypackage.train       run a module, like python -m
  accelkit launch -n 2 --log-with tensorboard,csv train.py   curves under runs/
  accelkit launch -n 4 --dp-shard 2 --tp 2 train.py   FSDP x tensor parallelism
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
    opts.add_argument("--precision", type=precision, choices=PRECISIONS, help="default mixed precision (default: no)")
    opts.add_argument(
        "--gradient-accumulation-steps",
        type=int_at_least(1),
        metavar="N",
        help="micro-steps per optimizer step (default: 1)",
    )
    opts.add_argument("--strategy", choices=STRATEGIES, help="how ak.prepare wraps the model (default: ddp)")
    mesh = parser.add_argument_group("device mesh (their product: the number of processes)")
    mesh.add_argument("--dp-replicate", type=int_at_least(1), metavar="N", help="data-parallel replicas (default: 1)")
    mesh.add_argument(
        "--dp-shard", type=int_at_least(-1), metavar="N", help="data-parallel shards; -1: the rest (default: -1)"
    )
    mesh.add_argument("--tp", type=int_at_least(1), metavar="N", help="tensor-parallel size (default: 1)")
    mesh.add_argument("--cp", type=int_at_least(1), metavar="N", help=argparse.SUPPRESS)
    opts.add_argument("--cpu", action="store_true", default=None, help="run on the CPU even when GPUs are present")
    opts.add_argument(
        "--debug", action="store_true", default=None, help="check collectives across ranks, print what is launched"
    )
    track = parser.add_argument_group("tracking (ak.init_trackers)")
    track.add_argument(
        "--log-with",
        metavar="NAMES",
        help=f"trackers, comma-separated: {', '.join(TRACKERS)} or all (default: none)",
    )
    track.add_argument("--project-dir", metavar="DIR", help="where the trackers write (default: runs)")
    parser.add_argument("--config-file", metavar="PATH", help="the config file to read (default: `accelkit config`'s)")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module, like `python -m`")
    _accelerate_spellings(parser)
    parser.add_argument("target", metavar="script.py", help="the script to run (a module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="the script's own arguments")


def _accelerate_spellings(parser: argparse.ArgumentParser) -> None:
    """``accelerate launch``'s flag names, accepted as they are (hidden from --help)."""
    hidden = argparse.SUPPRESS
    for flag, dest, kind in (
        ("--num_processes", "num_processes", int_at_least(1)),
        ("--num_machines", "num_nodes", int_at_least(1)),
        ("--machine_rank", "node_rank", int_at_least(0)),
        ("--main_process_ip", "master_addr", str),
        ("--main_process_port", "master_port", _port),
        ("--gradient_accumulation_steps", "gradient_accumulation_steps", int_at_least(1)),
        ("--max_restarts", "max_restarts", int_at_least(0)),
        ("--config_file", "config_file", str),
    ):
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=hidden)
    parser.add_argument(
        "--mixed_precision", dest="precision", type=precision, choices=PRECISIONS, default=None, help=hidden
    )
    parser.add_argument("--rdzv_backend", dest="rdzv_backend", choices=RDZV_BACKENDS, default=None, help=hidden)
    parser.add_argument("--use_fsdp", dest="strategy", action="store_const", const="fsdp", default=None, help=hidden)
    parser.add_argument(
        "--use_deepspeed", dest="strategy", action="store_const", const="deepspeed", default=None, help=hidden
    )
    for size, dest in (("dp_replicate", "dp_replicate"), ("dp_shard", "dp_shard"), ("tp", "tp"), ("cp", "cp")):
        parser.add_argument(
            f"--parallelism_config_{size}_size", dest=dest, type=int_at_least(1), default=None, help=hidden
        )
    # The mesh's sizes say it; and data parallelism over the visible GPUs is what accelkit launch does anyway.
    parser.add_argument("--use_parallelism_config", dest="use_parallelism_config", action="store_true", help=hidden)
    parser.add_argument("--multi_gpu", dest="multi_gpu", action="store_true", help=hidden)


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


def run(args: argparse.Namespace) -> int:
    """Launch; the exit code (0: every worker succeeded)."""
    try:
        plan, script = read_launch(args, config_in_effect(args.config_file))
    except (ConfigurationError, ImportError) as exc:  # ImportError: PyYAML, to read a config file
        print(f"accelkit launch: error: {exc}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"accelkit: note: {note}", file=sys.stderr)
    problem = syntax_error(script)
    if problem:  # said once, here, rather than by every worker after each started
        print(f"accelkit launch: error: {problem}", file=sys.stderr)
        return 1
    try:
        if plan.launch.mpirun:
            from ._mpirun import run_mpirun  # torch-free: mpirun starts the processes

            return run_mpirun(plan, script)
        return _run_agent(plan, script)
    except ConfigurationError as exc:
        print(f"accelkit launch: error: {exc}", file=sys.stderr)
        return 2


def syntax_error(script: Script) -> str:
    """The script's (or module's) syntax error, as Python prints it, before any worker starts; "" if none."""
    path = _source_file(script)
    if path is None:
        return ""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings: each worker says them, as python would
            compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = "".join(traceback.format_exception_only(exc)).rstrip()
        return f"{path} cannot run, nothing was started:\n{where}"
    except (OSError, ValueError):  # unreadable, or null bytes: the worker reports it as python would
        return ""
    return ""


def _source_file(script: Script) -> str | None:
    """The file ``python script.py`` (or ``python -m module``) would run, without importing anything."""
    if not script.module:
        return script.target
    from importlib.machinery import PathFinder

    locations: list[str] | None = [os.getcwd(), *sys.path[1:]]
    spec = None
    for part in [*script.target.split("."), "__main__"]:
        if locations is None:  # a plain module: no __main__ to look for
            break
        spec = PathFinder.find_spec(part, locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    origin = spec.origin if spec is not None else None
    return origin if origin is not None and origin.endswith(".py") else None


def _run_agent(plan: LaunchPlan, script: Script) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from .._launcher import Command, report_stop, run_workers
    from ..errors import WorkerError

    debug = bool(plan.options.get("debug"))
    settings = plan.launch._replace(num_processes=plan.local_processes())
    print_warnings(settings.num_processes or 1)
    if debug:  # said on every launch, it was noise; `accelkit env` shows it too
        timeout = plan.options.get("timeout", DEFAULT_TIMEOUT)
        where = plan.sources.get("timeout", "default")
        print(f"accelkit: {timeout_sentence(float(timeout), where)}", file=sys.stderr)  # type: ignore[arg-type]
        what = (
            f"{settings.num_processes} process(es) on node {settings.node_rank} of {settings.num_nodes} "
            f"(world size {settings.world_size})"
        )
        plan.describe(f"{what}: {shlex.join([sys.executable, *script.program()])}")
    try:
        run_workers(Command(tuple(script.program())), (), {}, settings, plan.worker_env(), quiet=not debug)
    except WorkerError as exc:
        print(f"accelkit: {exc}", file=sys.stderr)
        code = exc.failures[0].exitcode if exc.failures else None
        return code if code is not None and code > 0 else 1
    except TimeoutError as exc:  # the nodes did not meet
        print(f"accelkit: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException) as exc:  # the agent stopped every worker before raising it
        return report_stop(exc)
    return 0
