from __future__ import annotations

import torch


class CPUBackend:
    name = "cpu"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def barrier_kwargs(self, device: torch.device) -> dict[str, object]:
        return {}

    def empty_cache(self) -> None:
        pass
