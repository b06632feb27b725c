"""Hardware backends: one small protocol, chosen once when the process state is built.

Call sites ask the chosen backend; they never branch on the kind of hardware.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .cpu import CPUBackend
from .cuda import CUDABackend
from .unsupported import MPSBackend, XLABackend, XPUBackend


class Backend(Protocol):
    """What accelkit needs to know about one kind of accelerator."""

    name: str
    dist_backend: str  # the torch.distributed backend that suits it

    def is_available(self) -> bool: ...

    def device(self, local_rank: int) -> torch.device:
        """The device local rank ``local_rank`` uses; makes it current where that applies."""
        ...

    def barrier_kwargs(self, device: torch.device) -> dict[str, Any]: ...

    def empty_cache(self) -> None: ...


def select_backend(cpu: bool = False) -> Backend:
    """The first available backend in order CUDA, XPU, MPS, XLA, else CPU (``cpu`` forces CPU)."""
    if not cpu:
        for candidate in (CUDABackend(), XPUBackend(), MPSBackend(), XLABackend()):
            if candidate.is_available():
                return candidate
    return CPUBackend()


__all__ = ["Backend", "select_backend"]
