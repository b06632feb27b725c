"""``ak.precision``: an autocast region in the configured (or given) precision."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import _state, _tree
from .._options import PRECISIONS, suggest
from ..errors import ConfigurationError

__all__ = ["autocast", "autocast_forward", "precision"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def precision(mode: str | None = None) -> Iterator[None]:
    """Run the body under autocast: ``"no"`` (fp32), ``"fp16"``, ``"bf16"``, or ``None`` (the default).

    fp16 works on the CPU too (torch's CPU autocast); with the configured precision fp16,
    ``ak.backward`` scales the loss and the prepared optimizer unscales and skips
    overflowing steps. Regions nest: ``precision("no")`` inside a bf16 region is fp32.

    Example:
        >>> import accelkit as ak, torch
        >>> with ak.precision("bf16"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    st = _state.get()
    mode = st.options.precision if mode is None else mode
    device_type = st.device.type
    with autocast(mode, device_type):
        yield


def autocast(mode: str, device_type: str) -> contextlib.AbstractContextManager[object]:
    """The autocast context for ``mode`` on ``device_type`` (validated)."""
    if mode not in PRECISIONS:
        valid = ", ".join(PRECISIONS)
        raise ConfigurationError(
            f"accelkit.precision({mode!r}): unknown mode; valid modes: {valid}{suggest(mode, PRECISIONS)}"
        )
    if mode == "fp8":
        raise ValueError(f"accelkit.precision('fp8') is not available here: {_fp8_missing(device_type)}")
    if mode == "no":
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=_DTYPES[mode])


def _fp8_missing(device_type: str) -> str:
    if device_type != "cuda":
        return f"fp8 needs an NVIDIA GPU of compute capability 8.9 or newer, and this process runs on {device_type}"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"fp8 needs compute capability 8.9 or newer; this GPU has {major}.{minor}; use 'bf16'"
    if importlib.util.find_spec("torchao") is None:
        return "fp8 training needs torchao (pip install torchao); use 'bf16' meanwhile"
    return "accelkit does not convert models to fp8 yet; use 'bf16'"


def autocast_forward(model: nn.Module, mode: str, device_type: str) -> None:
    """Make ``model``'s forward run under ``mode``'s autocast and return fp32 outputs."""
    # Preparing the module again (e.g. on each find_executable_batch_size retry) re-wraps
    # its own forward, not the wrapper of last time.
    forward = getattr(model.forward, "__accelkit_forward__", model.forward)

    @functools.wraps(forward)
    def forward_in_precision(*args: Any, **kwargs: Any) -> Any:
        with autocast(mode, device_type):
            outputs = forward(*args, **kwargs)
        # Outputs leave the region in fp32, so losses computed outside it stay accurate.
        return _tree.apply_to_tensors(_to_fp32, outputs)

    forward_in_precision.__accelkit_forward__ = forward  # type: ignore[attr-defined]
    model.forward = forward_in_precision


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
