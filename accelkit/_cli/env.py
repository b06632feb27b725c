"""``accelkit env``: what to paste into a bug report, as a markdown list.

The machine and its versions, the config file in effect, the network interfaces (and the one a
multi-node launch binds to), the installed experiment trackers, the ``ACCELKIT_*`` variables that
are set, the collective timeout in effect, and the warnings ``accelkit launch`` would print.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from .. import _env
from .._config import ConfigFile, config_in_effect
from ..errors import ConfigurationError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``accelkit env``."""
    parser.add_argument(
        "--config-file", metavar="PATH", default=None, help="the config file to report (default: the one in effect)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the report; exit status 0.

    Example:
        >>> from accelkit._cli import main
        >>> main(["env"])  # doctest: +SKIP
        ### System
        - accelkit: 0.1.0
        ...
    """
    from . import _sysinfo

    print("### System")
    _print_items(_sysinfo.facts())
    print("\n### Config")
    num_processes, master_addr = 1, "127.0.0.1"
    config: ConfigFile | None = None
    try:
        config = config_in_effect(args.config_file)
    except (OSError, ValueError, ImportError) as exc:  # a broken config file is worth reporting, not a crash
        _print_items({"error": str(exc)})
    else:
        _print_items(describe_config(config))
        num_processes = config.launch.get("num_processes", 1) if config is not None else 1  # type: ignore[assignment]
        master_addr = str(config.launch.get("master_addr", master_addr)) if config is not None else master_addr
    print("\n### Collectives")
    _print_items(describe_timeout(config))
    print("\n### Network")
    _print_items(describe_network(master_addr))
    print("\n### Trackers (ak.init_trackers)")
    _print_items(installed_trackers())
    print("\n### ACCELKIT_* variables")
    for line in [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ACCELKIT_")] or ["none"]:
        print(f"- {line}")
    print(f"\n### Warnings for {num_processes} process{'es' if num_processes > 1 else ''} on this node")
    for warning in _sysinfo.launch_warnings(num_processes) or ["none"]:
        print(f"- {warning}")
    return 0


def describe_config(config: ConfigFile | None) -> dict[str, str]:
    """The config's file, kind, options and ignored keys, as report lines (where it looked, without one)."""
    if config is None:
        from .._config import default_config_path

        chosen = os.environ.get(_env.CONFIG_FILE)
        looked = f"{_env.CONFIG_FILE} is empty" if chosen is not None else f"no {default_config_path()}"
        return {"file": f"none ({looked})"}
    out = {"file": f"{config.path} ({config.kind})"}
    for values in (config.launch, config.state):
        out.update({str(k): repr(v) if isinstance(v, str) else str(v) for k, v in values.items()})
    if config.ignored:
        out["ignored"] = ", ".join(f"{k} ({config.notes[k]})" if k in config.notes else k for k in config.ignored)
    return out


def describe_timeout(config: ConfigFile | None) -> dict[str, str]:
    """How long a collective waits for the other processes before the job fails, and where that came from."""
    from .._config import resolve
    from ._sysinfo import timeout_sentence

    try:
        resolved = resolve({}, call="accelkit env", config=config)
    except (ValueError, ImportError) as exc:  # a bad ACCELKIT_TIMEOUT: say so, the rest of the report still helps
        return {"timeout": f"unknown ({exc})"}
    return {"timeout": timeout_sentence(resolved.options.timeout, resolved.sources["timeout"])}


def describe_network(master_addr: str) -> dict[str, str]:
    """This machine's interfaces, and the one a multi-node launch binds gloo and NCCL to."""
    from .._launcher import describe_interfaces, route_to, socket_ifname_env

    out = {"interfaces": describe_interfaces()}
    try:
        route = route_to(master_addr)
        chosen = socket_ifname_env(route)
    except ConfigurationError as exc:
        return {**out, "main process": f"{master_addr}: {exc}"}
    out["main process"] = f"{master_addr}, reached through {route.ifname} ({route.local_addr})"
    for name in (_env.GLOO_SOCKET_IFNAME, _env.NCCL_SOCKET_IFNAME):
        out[name] = f"{chosen[name]} (set by a multi-node launch)" if name in chosen else f"{os.environ[name]} (yours)"
    return out


def installed_trackers() -> dict[str, str]:
    """Each tracker's version, or the line that installs it (nothing is imported to find out)."""
    from .._tracking import KINDS, installed_versions

    return {name: version or f"not installed ({KINDS[name].install})" for name, version in installed_versions().items()}


def _print_items(items: Mapping[str, str]) -> None:
    for key, value in items.items():
        print(f"- {key}: {value}")
