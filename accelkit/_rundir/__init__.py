"""The run directory a launcher gives its workers (``ACCELKIT_RUN_DIR``), and what a worker leaves there.

- **Failure records**: a worker that fails writes its exception, where it was and its traceback from the
  user's code (:func:`record_failure`, the one writer); the launcher reads them (:func:`read_failures`).
- **Stacks**: a worker that dies from a signal, or is stopped with SIGTERM, leaves its Python stacks
  (:func:`record_stacks`); the launcher reads them (:func:`stacks_of`, :func:`where_it_was`).

Torch-free, and below every package that records a failure (the heartbeat, background saves, the workers of
``accelkit launch`` and ``@ak.distributed``), so that none of them imports the launcher to do it.
"""

from ._records import exception_name, lost_peer, read_failures, record_failure
from ._spot import Spot, spot_of, spot_of_dump
from ._stacks import record_stacks, stacks_of, where_each_was, where_it_was

__all__ = [
    "Spot",
    "exception_name",
    "lost_peer",
    "read_failures",
    "record_failure",
    "record_stacks",
    "spot_of",
    "spot_of_dump",
    "stacks_of",
    "where_each_was",
    "where_it_was",
]
