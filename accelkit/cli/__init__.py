"""The ``accelkit`` command. ``accelkit --help`` does not import torch."""

from __future__ import annotations

import argparse
import sys

from .._version import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="accelkit",
        description="Run one PyTorch training script on a CPU, a GPU, many GPUs or many machines.",
    )
    parser.add_argument("--version", action="version", version=f"accelkit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("env", help="print what to paste into a bug report")
    args = parser.parse_args(argv)
    if args.command == "env":
        from .env import run

        return run()
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
