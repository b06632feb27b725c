"""Entry points that start workers: ``@ak.distributed`` and ``ak.launch``."""

from ._api import distributed, launch

__all__ = ["distributed", "launch"]
