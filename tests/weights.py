"""Reading an exported model the way a user would: with safetensors, or plain torch for the ``.bin``."""

from __future__ import annotations

from pathlib import Path

import torch


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights in ``path``, without accelkit (``model.safetensors`` or ``pytorch_model.bin``)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]
