"""Entry points that start workers: ``@ak.distributed`` and ``ak.launch``, and the launch plan.

The names load on first use: the command line builds the launch plan (torch-free) without
the entry points, which import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._entry_points import distributed, launch
    from ._launch_plan import LaunchPlan, plan_launch

__all__ = ["LaunchPlan", "distributed", "launch", "plan_launch"]

_HOMES = {
    "distributed": "_entry_points",
    "launch": "_entry_points",
    "LaunchPlan": "_launch_plan",
    "plan_launch": "_launch_plan",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
