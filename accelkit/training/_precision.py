"""``ak.precision``: an autocast region in the configured (or given) precision."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .. import _state, _tree
from .._options import PRECISIONS, suggest
from ..errors import ConfigurationError

__all__ = ["MixedPrecisionModule", "autocast", "precision"]

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


class MixedPrecisionModule(nn.Module):
    r"""A prepared model: its forward runs under autocast in ``mode`` and returns fp32 outputs.

    Everything else is the wrapped module's: attributes and methods (``model.config``,
    DDP's ``model.no_sync()``, ``model.module``), indexing and iteration (``model[0]`` of a
    ``Sequential``), ``state_dict()`` and ``load_state_dict()`` (the same keys as without the
    wrapper). The user's own module is never changed, so
    ``ak.unwrap`` returns it as it was, and the prepared model deep-copies, pickles and
    ``torch.save``\ s like any module.

    Example:
        >>> import torch
        >>> m = MixedPrecisionModule(torch.nn.Linear(2, 2), "bf16", "cpu")
        >>> m(torch.ones(1, 2)).dtype, list(m.state_dict())
        (torch.float32, ['weight', 'bias'])
    """

    def __init__(self, module: nn.Module, mode: str, device_type: str) -> None:
        super().__init__()
        autocast(mode, device_type)  # validates the mode
        self.forward_module = module
        self.mode = mode
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self.mode, self.device_type):
            outputs = self.forward_module(*args, **kwargs)
        # Outputs leave the region in fp32, so losses computed outside it stay accurate.
        return _tree.apply_to_tensors(_to_fp32, outputs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("forward_module")
            if inner is None:  # still being built (or unpickled)
                raise
            return getattr(inner, name)

    # Special methods are looked up on the type, not through __getattr__: Sequential, ModuleList, ModuleDict.
    def __getitem__(self, key: Any) -> Any:
        return self.forward_module[key]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self.forward_module)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.forward_module)  # type: ignore[call-overload,no-any-return]

    def __contains__(self, key: Any) -> bool:
        return key in self.forward_module  # type: ignore[operator]

    def __bool__(self) -> bool:
        return True  # a module is truthy, whatever __len__ says (or cannot say)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.forward_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
