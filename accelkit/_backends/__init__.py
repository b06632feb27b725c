"""Hardware backends: one small protocol, chosen once when the process state is built.

Call sites ask the chosen backend; they never branch on the kind of hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from .. import _env
from ..errors import ConfigurationError
from .cpu import CPUBackend
from .cuda import CUDABackend
from .unsupported import MPSBackend, XLABackend, XPUBackend


class BatchTransfer(Protocol):
    """How a prepared loader moves batches onto its device, one batch ahead of their use.

    The loader calls :meth:`start` on batch ``i + 1`` right after :meth:`finish` on batch
    ``i`` and before handing batch ``i`` out, so that the copy of the next batch runs while
    the current one computes.
    """

    def start(self, batch: Any) -> Any:
        """Begin moving ``batch`` (a tree of tensors) to the device; a handle for :meth:`finish`."""
        ...

    def finish(self, handle: Any) -> Any:
        """The moved batch, safe to use on the device's current stream from now on."""
        ...

    def pin_in_loader(self, num_workers: int) -> bool:
        """Whether a loader with ``num_workers`` worker processes should pin its batches itself.

        True where the copies want pinned host memory and the loader can pin beside the step: with
        workers, ``DataLoader(pin_memory=True)`` pins each batch in the loader's pin-memory thread. A
        loader without workers would pin on the thread that iterates it, the training thread: there
        :meth:`start` pins instead, off that thread. A user's ``pin_memory=True`` is kept either way.
        """
        ...


# How a checked collective's message travels (accelkit._collectives' Wire): in host memory, its verdict read at
# once; on the device, compared there and its verdict read later (read_later); or over torch's fake process
# group, which moves nothing (host memory: every rank's message is taken to be this rank's own).
WireKind = Literal["host", "device", "loopback"]


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

    def batch_transfer(self, device: torch.device) -> BatchTransfer | None:
        """How prepared loaders move batches to ``device``; None: they are there already (the CPU)."""
        ...

    def read_later(self, flag: torch.Tensor) -> bool | Callable[[], bool]:
        """Whether ``flag`` is nonzero: now where reading costs no wait (host memory), else a reader for later.

        The reader gives the value ``flag`` has at this point of the device's work: calling it
        waits, at most, for the work queued before this call, never for what was queued after.
        """
        ...

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of a small host tensor on ``device``, issued without making the host wait for the device."""
        ...

    def wire(self, dist_backend: str) -> WireKind:
        """How a checked collective's message travels here, over the torch.distributed backend ``dist_backend``."""
        ...


def select_backend(cpu: bool = False) -> Backend:
    """The first available backend in order CUDA, XPU, MPS, XLA, else CPU (``cpu`` forces CPU).

    In the workers of ``accelkit.testing`` its device choice wins: ``"cpu"`` whatever ``cpu``
    says, ``"cuda"`` every local rank on the one visible GPU, over gloo.
    """
    pinned = _env.test_device()
    if pinned == "cuda":
        shared = CUDABackend(shared=True)
        if not shared.is_available():
            raise ConfigurationError(
                f"{_env.TEST_DEVICE}=cuda (accelkit.testing device='cuda'), but torch sees no CUDA device; "
                f"use device='cpu', or skip the test without one: @pytest.mark.skipif(not torch.cuda.is_available())"
            )
        return shared
    if not cpu and pinned is None:
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


__all__ = ["Backend", "BatchTransfer", "WireKind", "accelerator_count", "local_device_count", "select_backend"]
