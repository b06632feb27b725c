from __future__ import annotations

from typing import Any

import torch

__all__ = ["CPUBackend", "is_set"]


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

    def batch_transfer(self, device: torch.device) -> None:
        return None  # batches are made on the CPU: no copy at all

    def read_later(self, flag: torch.Tensor) -> bool:
        return is_set(flag)  # host memory: reading it never waits for a device


def is_set(flag: torch.Tensor) -> bool:
    """Whether a host tensor has a nonzero element (a one-element flag, as GradScaler's, without a kernel)."""
    return bool(flag) if flag.numel() == 1 else bool(flag.any())
