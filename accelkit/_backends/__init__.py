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

    def device_count(self) -> int:
        """How many devices of this kind this machine shows (the CPU counts as one)."""
        ...

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


def accelerator_count() -> int:
    """The visible accelerators of the first available kind; 0 on a machine without one."""
    hardware = select_backend()
    return 0 if hardware.name == "cpu" else hardware.device_count()


def local_device_count(cpu: bool = False) -> int:
    """Processes to start per node by default: one per visible accelerator, else one.

    Example:
        >>> local_device_count(cpu=True)
        1
    """
    return 1 if cpu else max(1, accelerator_count())


__all__ = ["Backend", "accelerator_count", "local_device_count", "select_backend"]
