"""``accelkit test``: a short real distributed sanity run with the config in effect.

Starts the workers with ``ak.launch`` and runs :func:`accelkit.cli._checks.run_checks` in
each: ranks, collectives, a barrier, a few DDP steps, the precision and debug mode. Prints
one line per check and a summary. Exit status 0 when every check passed, 1 when one
failed (naming the check and the ranks), 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ._types import int_at_least
from .env import config_num_processes, load_config

_CONFIG_OPTIONS = ("precision", "debug", "cpu")  # the config's state options this run uses
_TIMEOUT = 60.0  # seconds a collective may wait: a sanity run should fail fast, not after 10 minutes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``accelkit test``."""
    parser.add_argument(
        "--config-file", metavar="PATH", default=None, help="the config file to test (default: the one in effect)"
    )
    parser.add_argument(
        "-n",
        "--num-processes",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="processes to start (default: the config's num_processes, else one per GPU, else 2 on the CPU)",
    )
    parser.add_argument(
        "--fault-rank",
        type=int_at_least(0),
        default=None,
        metavar="RANK",
        help="for testing accelkit itself: RANK contributes a wrong value to the all-reduce, so the run must fail",
    )


def run(args: argparse.Namespace) -> int:
    """Run the checks; 0 when all passed, 1 when one failed, 2 for bad input.

    Example:
        >>> from accelkit.cli import main
        >>> main(["test", "-n", "2"])  # doctest: +SKIP
        accelkit test: 2 processes, precision 'no', debug off, config file none
          ok       processes: world size 2, ranks [0, 1], device cpu, backend gloo
        ...
    """
    import accelkit as ak
    from accelkit import _env
    from accelkit._options import Options

    from . import _checks

    try:
        path, config = load_config(args.config_file)
        state = getattr(config, "state", None) or {}
        # The config's options, except where an ACCELKIT_* variable overrides it (as in any run).
        options: dict[str, Any] = {
            k: state[k]
            for k in _CONFIG_OPTIONS
            if state.get(k) is not None and _env.OPTION_VARIABLES[k] not in os.environ
        }
        resolved = Options.resolve({**options, "timeout": _TIMEOUT}, "accelkit test")
    except (OSError, ValueError) as exc:
        return _bad_input(f"the config is not usable: {exc}")
    n = args.num_processes or config_num_processes(config) or _default_num_processes(resolved.cpu)
    if args.fault_rank is not None and args.fault_rank >= n:
        return _bad_input(f"--fault-rank {args.fault_rank} is not a rank of {n} processes; pick one of 0..{n - 1}")
    print(
        f"accelkit test: {_processes(n)}, precision {resolved.precision!r}, debug {'on' if resolved.debug else 'off'}"
        f"{', cpu only' if resolved.cpu else ''}, config file {path or 'none'}",
        flush=True,  # before the workers write anything
    )
    started = time.perf_counter()
    try:
        results = ak.launch(
            _checks.run_checks, (n,), {"fault_rank": args.fault_rank}, num_processes=n, timeout=_TIMEOUT, **options
        )
    except ak.WorkerError as exc:
        print(f"FAILED: a worker stopped before the checks finished.\n{exc}")
        return 1
    finally:
        if n == 1:  # the run used this process's state
            ak.reset_state()
    return _report(results or [], n, time.perf_counter() - started)


def _report(results: list[Any], n: int, seconds: float) -> int:
    from ._checks import CHECK_NAMES

    for result in results:
        if result.ok:
            print(f"  {'skipped' if result.skipped else 'ok':<8} {result.name}: {result.detail}")
            continue
        by_message: dict[str, list[int]] = {}
        for rank, message in sorted(result.failures.items()):
            by_message.setdefault(message, []).append(rank)
        for message, ranks in by_message.items():
            print(f"  {'FAILED':<8} {result.name} on {_ranks(ranks)}: {message}")
    for name in CHECK_NAMES[len(results) :]:
        print(f"  {'not run':<8} {name}")
    failed = [r for r in results if not r.ok]
    if failed or len(results) != len(CHECK_NAMES):
        where = f"check {failed[0].name!r} failed on {_ranks(sorted(failed[0].failures))}" if failed else "incomplete"
        print(f"FAILED: {where} ({_processes(n)}, {seconds:.1f} s)")
        return 1
    passed = sum(1 for r in results if not r.skipped)
    skipped = len(results) - passed
    print(
        f"all {passed} checks passed{f', {skipped} skipped' if skipped else ''} on {_processes(n)} in {seconds:.1f} s"
    )
    return 0


def _default_num_processes(cpu: bool) -> int:
    if not cpu:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    return 2


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _bad_input(message: str) -> int:
    print(f"accelkit test: error: {message}", file=sys.stderr)
    return 2
