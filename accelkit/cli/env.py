"""``accelkit env``: what to paste into a bug report, as a markdown list.

The machine and its versions, the config file in effect, the ``ACCELKIT_*`` variables
that are set, and the warnings ``accelkit launch`` would print.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``accelkit env``."""
    parser.add_argument(
        "--config-file", metavar="PATH", default=None, help="the config file to report (default: the one in effect)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the report; exit status 0.

    Example:
        >>> from accelkit.cli import main
        >>> main(["env"])  # doctest: +SKIP
        ### System
        - accelkit: 0.1.0
        ...
    """
    from . import _sysinfo

    print("### System")
    _print_items(_sysinfo.facts())
    print("\n### Config")
    num_processes = 1
    try:
        path, config = load_config(args.config_file)
    except (OSError, ValueError) as exc:  # a broken config file is worth reporting, not a crash
        _print_items({"error": str(exc)})
    else:
        _print_items(describe_config(path, config))
        num_processes = config_num_processes(config) or 1
    print("\n### ACCELKIT_* variables")
    for line in [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ACCELKIT_")] or ["none"]:
        print(f"- {line}")
    print(f"\n### Warnings for {num_processes} process{'es' if num_processes > 1 else ''} on this node")
    for warning in _sysinfo.launch_warnings(num_processes) or ["none"]:
        print(f"- {warning}")
    return 0


def load_config(config_file: str | None) -> tuple[str | None, Any]:
    """The config file in effect (``config_file``, else the default) and what it holds.

    ``(None, None)`` when there is none. Raises the config loader's error for a broken file.
    """

    from ..config import _file as _config

    config_path = getattr(_config, "config_path", None)
    load = getattr(_config, "load_config", None)
    if config_path is None or load is None:  # no config-file support in this build
        return None, None
    path = config_path(config_file)
    return (None, None) if path is None else (os.fspath(path), load(path))


def describe_config(path: str | None, config: Any) -> dict[str, str]:
    """The config's file, kind, options and ignored keys, as report lines."""
    if path is None or config is None:
        return {"file": "none"}
    kind = getattr(config, "kind", None)
    out = {"file": f"{path} ({kind})" if kind else path}
    for section in ("launch", "state"):
        values = getattr(config, section, None)
        if isinstance(values, Mapping):
            out.update({str(k): repr(v) if isinstance(v, str) else str(v) for k, v in values.items()})
    ignored = getattr(config, "ignored", None)
    if ignored:
        notes = getattr(config, "notes", None) or {}
        out["ignored"] = ", ".join(f"{k} ({notes[k]})" if k in notes else str(k) for k in ignored)
    return out


def config_num_processes(config: Any) -> int | None:
    """The config's ``num_processes`` (per node), if it sets a valid one."""
    launch = getattr(config, "launch", None)
    value = launch.get("num_processes") if isinstance(launch, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _print_items(items: Mapping[str, str]) -> None:
    for key, value in items.items():
        print(f"- {key}: {value}")
