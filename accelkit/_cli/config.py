"""``accelkit config``: write the config file, by questions or (``accelkit config default``) without.

Questions use plain ``input()``, so they work over ssh and in tmux; Enter takes the default
shown in brackets, and an invalid answer is asked again with the reason.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from .._options import PRECISIONS
from ._types import precision

T = TypeVar("T")
_DEFAULT_PATH = "${XDG_CONFIG_HOME:-~/.config}/accelkit/default_config.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = f"the file to write (default: {_DEFAULT_PATH})"
    parser.add_argument("--config-file", metavar="PATH", help=where)
    modes = parser.add_subparsers(
        dest="config_mode", metavar="[default]", title="mode", description="without one, questions are asked"
    )
    basic = modes.add_parser(
        "default",
        help="write a sensible file without questions",
        description="Write a config file without questions: one process per GPU, else 2 CPU processes.",
    )
    basic.add_argument("--config-file", metavar="PATH", default=argparse.SUPPRESS, help=where)
    basic.add_argument(
        "--precision", type=precision, choices=PRECISIONS, default="no", help="mixed precision (default: no)"
    )
    basic.add_argument("--cpu", action="store_true", help="run on CPU even when GPUs are present")
    basic.add_argument("--force", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    from .._config import default_config_path, write_basic_config, write_config
    from ..errors import ConfigurationError

    path = Path(args.config_file).expanduser() if args.config_file else default_config_path()
    try:
        if args.config_mode == "default":
            written = write_basic_config(
                args.precision, path, cpu=args.cpu, overwrite=args.force, written_by="`accelkit config default`"
            )
        else:
            replaces = " (it exists: it will be replaced)" if path.exists() else ""
            print(f"Writing {path}{replaces}. Press Enter to take the [default].")
            written = write_config(interview(), path, written_by="`accelkit config`")
    except EOFError:
        print("\naccelkit config: input ended before the last question; nothing was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\naccelkit config: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (ConfigurationError, ImportError) as err:
        print(f"accelkit config: error: {err}", file=sys.stderr)
        return 2
    print(f"accelkit config written to {written}")
    _note_environment(written)
    return 0


def interview() -> dict[str, object]:
    """Asks the questions; returns the values of the file to write."""
    several = (
        _ask("Run on this machine only, or on several machines? (this/several)", "this", _one_of(("this", "several")))
        == "several"
    )
    from .._backends import accelerator_count  # imports torch: only once the questions start
    from .._config import proposed_num_processes

    gpus = accelerator_count()
    processes = str(proposed_num_processes(gpus))
    values: dict[str, object] = {
        "num_processes": _ask("How many processes on each machine (one per GPU, else 2)?", processes, _integer(1)),
        "num_nodes": 1,
    }
    if several:
        nodes = _ask("How many machines?", "2", _integer(2))
        rank = _ask(f"Rank of this machine (0 to {nodes - 1}; 0 is the main machine)?", "0", _integer(0, nodes - 1))
        host = socket.gethostname() if rank == 0 else None
        values.update(
            num_nodes=nodes,
            node_rank=rank,
            main_process_ip=_ask("IP address or host name of the main machine (rank 0)?", host, _host),
            main_process_port=_ask("A free TCP port on the main machine?", "29500", _integer(1, 65535)),
        )
    values["precision"] = _ask(f"Mixed precision? ({'/'.join(PRECISIONS)})", "no", _one_of(PRECISIONS))
    values["cpu"] = _ask("Run on CPU only, even where there are GPUs? (yes/no)", "no" if gpus else "yes", _yes_no)
    strategy = _ask(
        "Data parallelism: ddp (a full model per process) or fsdp (sharded)? (ddp/fsdp)",
        "ddp",
        _one_of(("ddp", "fsdp")),
    )
    values["strategy"] = strategy
    if strategy == "fsdp":
        wrap = _ask(
            "Module classes that become their own FSDP unit (comma-separated class names, or none)?",
            "none",
            _class_names,
        )
        if wrap:
            values["fsdp_wrap"] = wrap
        else:
            values["fsdp_min_params"] = _ask(
                "Or: wrap each submodule with at least how many parameters (0: off)?", "0", _integer(0)
            )
        values["fsdp_reshard_after_forward"] = _ask(
            "Free gathered parameters after forward (less memory, more communication)? (yes/no)", "yes", _yes_no
        )
        values["fsdp_cpu_offload"] = _ask("Keep parameters on the CPU between uses (offload)? (yes/no)", "no", _yes_no)
    values["gradient_accumulation_steps"] = _ask("Gradient accumulation steps (1: step every batch)?", "1", _integer(1))
    values["debug"] = _ask(
        "Debug mode: check that collectives match across processes (slower)? (yes/no)", "no", _yes_no
    )
    return values


def _ask(question: str, default: str | None, parse: Callable[[str], T]) -> T:
    while True:
        answer = input(f"{question}{f' [{default}]' if default is not None else ''}: ").strip()
        if not answer and default is None:
            print("  an answer is needed")
            continue
        try:
            return parse(answer or str(default))
        except ValueError as err:
            print(f"  {err}; try again")


def _one_of(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(answer: str) -> str:
        found = [c for c in choices if c.startswith(answer.lower())]
        if len(found) != 1:
            raise ValueError(f"{answer!r} is not one of {', '.join(choices)}")
        return found[0]

    return parse


def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(answer: str) -> int:
        span = f"a whole number >= {low}" if high is None else f"a whole number from {low} to {high}"
        try:
            value = int(answer)
        except ValueError:
            raise ValueError(f"{answer!r} is not {span}") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"{value} is not {span}")
        return value

    return parse


def _yes_no(answer: str) -> bool:
    return _one_of(("yes", "no"))(answer) == "yes"


def _host(answer: str) -> str:
    if any(c.isspace() for c in answer):
        raise ValueError(f"{answer!r} is not a host name or IP address")
    return answer


def _class_names(answer: str) -> list[str]:
    if answer.lower() == "none":
        return []
    names = [n.strip() for n in answer.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a class name (e.g. TransformerBlock)")
    return names


def _note_environment(written: Path) -> None:
    from .._env import CONFIG_FILE

    chosen = os.environ.get(CONFIG_FILE)
    if chosen is not None and Path(chosen).expanduser() != written:
        what = "no config file" if not chosen.strip() else chosen
        print(f"note: {CONFIG_FILE} is set ({what}), so accelkit reads that instead of this file")
