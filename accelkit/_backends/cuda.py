from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigurationError


class CUDABackend:
    name = "cuda"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device(self, local_rank: int) -> torch.device:
        count = self.device_count()
        if local_rank >= count:
            raise ConfigurationError(
                f"local rank {local_rank} needs cuda:{local_rank}, but {count} CUDA "
                f"device(s) are visible; start at most {count} process(es) per node, "
                f"or pass cpu=True (ACCELKIT_CPU=1) to run on the CPU"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def barrier_kwargs(self, device: torch.device) -> dict[str, Any]:
        return {"device_ids": [device.index]}

    def empty_cache(self) -> None:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()
