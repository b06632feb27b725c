"""The process group's own upkeep: the handshake when it forms, the heartbeat while it lives.

Everything here goes through the job's key-value store (the one the group was formed on), never
through the process group itself, so it still works when a collective is stuck or a rank is gone.

The names load on first use: a script pays for the upkeep when its group forms, not when it
imports accelkit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._board import Position, describe_missing, post_report, read_positions, read_reports
    from ._form import adopt, destroy, destroy_before_exit, form, reform, start_upkeep, unpin
    from ._handshake import handshake, job_facts
    from ._heartbeat import Heartbeat, wait_log_interval
    from ._meet import SYNCING, meet

__all__ = [
    "SYNCING",
    "Heartbeat",
    "Position",
    "adopt",
    "describe_missing",
    "destroy",
    "destroy_before_exit",
    "form",
    "handshake",
    "job_facts",
    "meet",
    "post_report",
    "read_positions",
    "read_reports",
    "reform",
    "start_upkeep",
    "unpin",
    "wait_log_interval",
]

# name -> the module that holds it (imported on first use)
_HOMES = {
    "Position": "_board",
    "describe_missing": "_board",
    "post_report": "_board",
    "read_positions": "_board",
    "read_reports": "_board",
    "adopt": "_form",
    "destroy": "_form",
    "destroy_before_exit": "_form",
    "form": "_form",
    "reform": "_form",
    "start_upkeep": "_form",
    "unpin": "_form",
    "handshake": "_handshake",
    "job_facts": "_handshake",
    "Heartbeat": "_heartbeat",
    "wait_log_interval": "_heartbeat",
    "SYNCING": "_meet",
    "meet": "_meet",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
