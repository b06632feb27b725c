"""The ``accelkit`` command. ``accelkit --help`` does not import torch.

Each subcommand lives in its own module with ``add_arguments(parser)`` and
``run(args) -> int``; none imports torch at module level, and only the chosen
subcommand's ``run`` does real work.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from .._version import __version__

# name -> (module, one-line help)
COMMANDS = {
    "config": ("config", "write the config file: interactive questions, or `accelkit config default`"),
    "launch": ("launch", "run a training script on several processes or machines"),
    "env": ("env", "print what to paste into a bug report"),
    "test": ("selftest", "a short real distributed sanity run with the config in effect"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelkit",
        description="Run one PyTorch training script on a CPU, a GPU, many GPUs or many machines.",
    )
    parser.add_argument("--version", action="version", version=f"accelkit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        importlib.import_module(f".{module}", __name__).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # name the subcommand's usage and the flag it probably meant, not only the top-level usage
        _unrecognized(parser, args.command, unknown)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f".{COMMANDS[args.command][0]}", __name__)
    return int(module.run(args))


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> NoReturn:
    from .._options import suggest

    sub = _subparser(parser, command) or parser
    known = [s for action in sub._actions for s in action.option_strings if action.help != argparse.SUPPRESS]
    first = next((u.split("=")[0] for u in unknown if u.startswith("-")), unknown[0])
    hint = suggest(first.replace("_", "-"), known)
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return None


if __name__ == "__main__":
    sys.exit(main())
