"""The process group's own upkeep: the handshake when it forms, the heartbeat while it lives.

Everything here goes through the job's key-value store (the one the group was formed on), never
through the process group itself, so it still works when a collective is stuck or a rank is gone.
"""

from ._board import LATEST_BOARD, Position, describe_missing, post_report, read_positions, read_reports
from ._form import adopt, destroy, destroy_and_release, form, reform, start_upkeep
from ._handshake import handshake, job_facts
from ._heartbeat import NOT_WAITING, PASSES_THAT_WAIT, Heartbeat, Waiting, wait_log_interval
from ._meet import DDP_SYNCING, MAY_SYNC, SYNCING, meet

__all__ = [
    "DDP_SYNCING",
    "LATEST_BOARD",
    "MAY_SYNC",
    "NOT_WAITING",
    "PASSES_THAT_WAIT",
    "SYNCING",
    "Heartbeat",
    "Position",
    "Waiting",
    "adopt",
    "describe_missing",
    "destroy",
    "destroy_and_release",
    "form",
    "handshake",
    "job_facts",
    "meet",
    "post_report",
    "read_positions",
    "read_reports",
    "reform",
    "start_upkeep",
    "wait_log_interval",
]
