"""``accelkit test``: a short real distributed sanity run with the config in effect.

Starts the workers with ``ak.launch`` and runs :func:`accelkit._cli._checks.run_checks` in
each: ranks, collectives, a barrier, a few DDP steps, the precision and debug mode. Prints
one line per check and a summary. Exit status 0 when every check passed, 1 when one
failed (naming the check and the ranks), 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ._types import int_at_least

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
        >>> from accelkit._cli import main
        >>> main(["test", "-n", "2"])  # doctest: +SKIP
        accelkit test: 2 processes, precision 'no', debug off, config file none
          ok       processes: world size 2, ranks [0, 1], device cpu, backend gloo
        ...
    """
    import accelkit as ak

    from .. import _env
    from .._config import config_in_effect, resolve
    from . import _checks

    try:
        config = config_in_effect(args.config_file)
        resolved = resolve({"timeout": _TIMEOUT}, call="accelkit test", config=config).options
    except (OSError, ValueError, ImportError) as exc:
        return _bad_input(f"the config is not usable: {exc}")
    # The config's options (an ACCELKIT_* variable overrides one, as in any run); the workers read no file.
    options: dict[str, Any] = {k: getattr(resolved, k) for k in _CONFIG_OPTIONS}
    n = args.num_processes or _config_processes(config) or _default_num_processes(resolved.cpu)
    path = config.path if config is not None else None
    if args.fault_rank is not None and args.fault_rank >= n:
        return _bad_input(f"--fault-rank {args.fault_rank} is not a rank of {n} processes; pick one of 0..{n - 1}")
    print(
        f"accelkit test: {_processes(n)}, precision {resolved.precision!r}, debug {'on' if resolved.debug else 'off'}"
        f"{', cpu only' if resolved.cpu else ''}, config file {path or 'none'}",
        flush=True,  # before the workers write anything
    )
    started = time.perf_counter()
    try:
        with _env.patched({_env.CONFIG_FILE: ""}):  # resolved here: the workers read no file on top
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
    from .._backends import accelerator_count

    return (0 if cpu else accelerator_count()) or 2  # on the CPU two processes: a real group


def _config_processes(config: Any) -> int | None:
    value = config.launch.get("num_processes") if config is not None else None
    return value if isinstance(value, int) else None


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _bad_input(message: str) -> int:
    print(f"accelkit test: error: {message}", file=sys.stderr)
    return 2
