"""Entry points that start workers (``@ak.distributed``, ``ak.launch``), the launch plan, and
what the command line, ``accelkit.testing`` and the data loaders share of the launcher.

The names load on first use: the command line uses the torch-free ones (the plan, the failure
records, the network route) without the entry points and the agent, which import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._agent import check_picklable, run_workers
    from ._entry_points import distributed, launch
    from ._failures import collect_failures, report_stop
    from ._launch_plan import LaunchPlan, plan_launch
    from ._lifeline import LoaderWorkerLifeline, die_with_parent
    from ._netif import describe_interfaces, route_to, socket_ifname_env
    from ._rendezvous import free_port
    from ._spec import Command

__all__ = [
    "Command",
    "LaunchPlan",
    "LoaderWorkerLifeline",
    "check_picklable",
    "collect_failures",
    "describe_interfaces",
    "die_with_parent",
    "distributed",
    "free_port",
    "launch",
    "plan_launch",
    "report_stop",
    "route_to",
    "run_workers",
    "socket_ifname_env",
]

# name -> the module that holds it (imported on first use)
_HOMES = {
    "Command": "_spec",
    "LaunchPlan": "_launch_plan",
    "LoaderWorkerLifeline": "_lifeline",
    "check_picklable": "_agent",
    "collect_failures": "_failures",
    "describe_interfaces": "_netif",
    "die_with_parent": "_lifeline",
    "distributed": "_entry_points",
    "free_port": "_rendezvous",
    "launch": "_entry_points",
    "plan_launch": "_launch_plan",
    "report_stop": "_failures",
    "route_to": "_netif",
    "run_workers": "_agent",
    "socket_ifname_env": "_netif",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
