"""NVIDIA GPUs: one device per local rank over nccl, or, for tests, every rank on cuda:0 over gloo.

The CUDA-only parts of the hot path live here, so that call sites stay free of device checks:
how a prepared loader copies batches (pinned host memory, pinned beside the step and never on the
training thread; non-blocking copies on a side stream, one batch ahead) and how a flag on the
device is read without stalling it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch

from .. import _tree
from ..errors import ConfigurationError
from .cpu import is_set

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["CUDABackend", "CUDATransfer"]

# A batch on its way: moved already (its copies issued), or being pinned and moved on the transfer's thread.
Moving: TypeAlias = "tuple[Any, list[torch.Tensor]] | Future[tuple[Any, list[torch.Tensor]]]"


class CUDABackend:
    """CUDA devices. ``shared``: every local rank on cuda:0 with gloo (``accelkit.testing``'s device="cuda").

    gloo moves CUDA tensors through host memory, so several ranks can share one GPU; nccl cannot
    (it refuses two ranks on one device).
    """

    name = "cuda"

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self.dist_backend = "gloo" if shared else "nccl"

    def is_available(self) -> bool:
        # Counted through NVML, as torch.cuda.is_available() counts with PYTORCH_NVML_BASED_CUDA_CHECK=1:
        # the CUDA driver stays uninitialised here, so a notebook that asks (ak.launch counting its
        # GPUs) can still fork workers that use CUDA.
        return torch.cuda.device_count() > 0

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device(self, local_rank: int) -> torch.device:
        index = 0 if self.shared else local_rank
        count = self.device_count()
        if index >= count:
            raise ConfigurationError(
                f"local rank {local_rank} needs cuda:{local_rank}, but {count} CUDA device(s) are visible; "
                f"start at most {count} process(es) per node, or run on the CPU: --cpu (accelkit launch and "
                f"the examples), cpu=True in code, or ACCELKIT_CPU=1"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def barrier_kwargs(self, device: torch.device) -> dict[str, Any]:
        return {} if self.shared else {"device_ids": [device.index]}  # device_ids: nccl's

    def empty_cache(self) -> None:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()

    def batch_transfer(self, device: torch.device) -> CUDATransfer:
        return CUDATransfer(device)

    def read_later(self, flag: torch.Tensor) -> bool | Callable[[], bool]:
        if flag.device.type != "cuda":
            return is_set(flag)
        stream = torch.cuda.current_stream(flag.device)
        # A non-blocking copy into pinned memory, and an event after it: reading waits for this
        # point of the stream only (cudaEventSynchronize), while the work queued later runs on.
        host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(stream)

        def read() -> bool:
            copied.synchronize()
            return is_set(host)

        return read

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.pin_memory().to(device, non_blocking=True)  # from pinned memory: the host does not wait

    def wire(self, dist_backend: str) -> Literal["device"]:
        return "device"


class CUDATransfer:
    """Batches to one CUDA device: from pinned host memory, copied on a side stream, ahead of use.

    A copy from host memory overlaps the device's work only from pinned memory, and pinning is a
    copy too: it must not run on the training thread. A loader with workers pins in its
    pin-memory thread (:meth:`pin_in_loader`; a user's ``pin_memory=True`` the same), so batches
    come pinned and :meth:`start` only issues ``non_blocking`` copies on this transfer's own stream.
    A batch with host tensors that are not pinned (a loader without workers) goes to this
    transfer's thread, which pins those and issues the copies there, while the calling thread
    goes on with the step before it. :meth:`finish` waits for that thread's work on the batch (the
    host waits for the host, never for the device), makes the current stream wait for the copies
    (``wait_stream``) and marks each copy as used on it (``record_stream``), so that the caching
    allocator does not hand its memory to the side stream again before the step that reads it is
    done. Tensors already on the device pass through untouched; a batch with tensors on another
    GPU is moved on the calling thread, where the streams that made them are current.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None  # made on first use: preparing a loader creates no stream
        self._pinner: ThreadPoolExecutor | None = None  # started by the first batch to pin

    def pin_in_loader(self, num_workers: int) -> bool:
        return num_workers > 0  # without workers, DataLoader would pin on the iterating thread: start() does

    def start(self, batch: Any) -> Moving:
        pageable, elsewhere = self._survey(batch)
        if pageable and not elsewhere:
            return self._pinning().submit(self._move, batch, True)
        return self._move(batch, pageable)

    def finish(self, handle: Moving) -> Any:
        batch, copies = handle if isinstance(handle, tuple) else handle.result()
        if copies:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)  # type: ignore[arg-type]
            for t in copies:
                t.record_stream(current)
        return batch

    def _survey(self, batch: Any) -> tuple[bool, bool]:
        """Whether ``batch`` holds host tensors that are not pinned, and tensors on another GPU."""
        pageable = elsewhere = False

        def look(t: torch.Tensor) -> torch.Tensor:
            nonlocal pageable, elsewhere
            if t.device.type == "cpu":
                pageable = pageable or not t.is_pinned()
            elif t.device != self.device:
                elsewhere = True
            return t

        _tree.apply_to_tensors(look, batch)
        return pageable, elsewhere

    def _pinning(self) -> ThreadPoolExecutor:
        if self._pinner is None:
            from concurrent.futures import ThreadPoolExecutor

            # One thread, so batches are pinned and copied in their order; it ends with this transfer.
            self._pinner = ThreadPoolExecutor(
                1, thread_name_prefix="accelkit-pin", initializer=torch.cuda.set_device, initargs=(self.device,)
            )
            weakref.finalize(self, self._pinner.shutdown, wait=False)
        return self._pinner

    def _move(self, batch: Any, pin: bool) -> tuple[Any, list[torch.Tensor]]:
        """``batch`` with copies to the device issued on the side stream (host tensors pinned first, if ``pin``)."""
        if pin:  # a copy from pageable memory would block the host
            batch = _tree.apply_to_tensors(_pinned, batch)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream = self.stream
        copies: list[torch.Tensor] = []

        def copy(t: torch.Tensor) -> torch.Tensor:
            if t.device == self.device:
                return t
            if t.device.type != "cpu":  # another GPU's tensor: copy it once the work that made it is done
                stream.wait_stream(torch.cuda.current_stream(t.device))
                t.record_stream(stream)
            moved = t.to(self.device, non_blocking=True)
            copies.append(moved)
            return moved

        with torch.cuda.stream(stream):
            moved = _tree.apply_to_tensors(copy, batch)
        return moved, copies


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t
