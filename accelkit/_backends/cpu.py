from __future__ import annotations

from typing import Any, Literal

import torch

from .. import _tree

__all__ = ["CPUBackend", "ToDevice", "is_set"]


class CPUBackend:
    name = "cpu"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def barrier_kwargs(self, device: torch.device) -> dict[str, Any]:
        return {}

    def empty_cache(self) -> None:
        pass

    def batch_transfer(self, device: torch.device) -> ToDevice | None:
        # Batches are made on the CPU: no copy at all. (Another device here is a state built by hand.)
        return None if device.type == "cpu" else ToDevice(device)

    def read_later(self, flag: torch.Tensor) -> bool:
        return is_set(flag)  # host memory: reading it never waits for a device

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device)

    def wire(self, dist_backend: str) -> Literal["host", "loopback"]:
        return "loopback" if dist_backend == "fake" else "host"


class ToDevice:
    """Plain copies of each batch's tensors to ``device``, made when the batch is read (no streams)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, batch: Any) -> Any:
        return _tree.apply_to_tensors(lambda t: t.to(self.device), batch)

    def finish(self, handle: Any) -> Any:
        return handle

    def pin_in_loader(self, num_workers: int) -> bool:
        return False  # plain copies: pinned memory would buy nothing


def is_set(flag: torch.Tensor) -> bool:
    """Whether a host tensor has a nonzero element (a one-element flag, as GradScaler's, without a kernel)."""
    return bool(flag) if flag.numel() == 1 else bool(flag.any())
