from __future__ import annotations

from typing import Any

import torch


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
