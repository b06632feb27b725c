"""Entry points that start workers: ``@ak.distributed`` and ``ak.launch``.

The names load on first use: the command line imports this package's torch-free modules
(the failure records, the rendezvous) without the entry points, which import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._api import distributed, launch

__all__ = ["distributed", "launch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _api

        return getattr(_api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
