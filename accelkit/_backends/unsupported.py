"""Accelerators accelkit detects but does not drive yet: each says what is missing."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch

from ..errors import ConfigurationError
from .cpu import is_set


class _Unsupported:
    name = "unsupported"
    dist_backend = "gloo"
    missing = ""

    def is_available(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int) -> torch.device:
        raise ConfigurationError(
            f"accelkit found a {self.name} device but does not support it yet: {self.missing}. "
            f"Pass cpu=True (or set ACCELKIT_CPU=1) to run on the CPU meanwhile."
        )

    def barrier_kwargs(self, device: torch.device) -> dict[str, Any]:
        return {}

    def empty_cache(self) -> None:
        pass

    def batch_transfer(self, device: torch.device) -> None:
        return None  # never reached: device() refuses first

    def read_later(self, flag: torch.Tensor) -> bool:
        return is_set(flag)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device)

    def wire(self, dist_backend: str) -> Literal["device"]:
        return "device"  # never reached: device() refuses first


class XPUBackend(_Unsupported):
    name = "xpu"
    dist_backend = "xccl"
    missing = "device placement per local rank and the xccl process group are not wired up"

    def is_available(self) -> bool:
        xpu = getattr(torch, "xpu", None)
        return bool(xpu is not None and xpu.is_available())


class MPSBackend(_Unsupported):
    name = "mps"
    missing = "autocast and memory handling on Apple's MPS are not wired up"

    def is_available(self) -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps is not None and mps.is_available())


class XLABackend(_Unsupported):
    name = "xla"
    dist_backend = "xla"
    missing = "torch_xla devices, the xla process group and XLA's step marking are not wired up"

    def is_available(self) -> bool:
        return importlib.util.find_spec("torch_xla") is not None
