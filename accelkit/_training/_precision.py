"""``ak.precision``: an autocast region in the configured (or given) precision."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .. import _state, _tree
from .._options import PRECISIONS, suggest
from .._strategies.single import PRECISION_DTYPES, inner_attribute
from ..errors import ConfigurationError

__all__ = ["MixedPrecisionModule", "Precision", "autocast", "autocast_options", "precision"]


def precision(mode: str | None = None) -> Precision:
    """Run the body under autocast: ``"no"`` (fp32), ``"fp16"``, ``"bf16"``, or ``None`` (the default).

    fp16 works on the CPU too (torch's CPU autocast); with the configured precision fp16,
    ``ak.backward`` scales the loss and the prepared optimizer unscales and skips
    overflowing steps. Regions nest: ``precision("no")`` inside a bf16 region is fp32.
    The object can be kept and entered again, also inside itself, as a ``torch.autocast``
    (``ctx = ak.precision("bf16")``, then ``with ctx:`` wherever needed), and decorates functions.

    Args:
        mode: ``"no"`` (fp32), ``"fp16"``, ``"bf16"``; ``None``: the configured precision, read at
            each entry.

    Example:
        >>> import accelkit as ak, torch
        >>> ctx = ak.precision("bf16")
        >>> with ctx:
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    return Precision(mode)


class Precision(contextlib.ContextDecorator):
    """What :func:`precision` returns: a reusable, re-entrant autocast region.

    The mode is checked at once; ``None`` (the configured precision) and the device are read
    each time the region is entered. Each entry opens its own ``torch.autocast``.
    """

    def __init__(self, mode: str | None) -> None:
        if mode is not None:
            _check_mode(mode)
        self.mode = mode
        self._open = threading.local()  # this thread's open regions, innermost last

    def __enter__(self) -> None:
        st = _state.get()
        region = autocast(st.options.precision if self.mode is None else self.mode, st.device.type)
        region.__enter__()
        stack: list[contextlib.AbstractContextManager[object]] = self._open.__dict__.setdefault("stack", [])
        stack.append(region)

    def __exit__(self, *exc: Any) -> None:
        self._open.stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"accelkit.precision({self.mode!r})"


def autocast(mode: str, device_type: str) -> contextlib.AbstractContextManager[object]:
    """The autocast context for ``mode`` on ``device_type`` (validated; its arguments once per pair)."""
    options = _OPTIONS.get((mode, device_type))
    if options is None:
        options = _OPTIONS[mode, device_type] = autocast_options(mode, device_type)
    return torch.autocast(device_type, **options)


_OPTIONS: dict[tuple[str, str], dict[str, Any]] = {}  # autocast's arguments per (mode, device type), validated


def autocast_options(mode: str, device_type: str) -> dict[str, Any]:
    """``torch.autocast``'s keyword arguments for ``mode`` on ``device_type`` (validated)."""
    if mode == "fp8":
        raise ValueError(f"accelkit.precision('fp8') is not available here: {_fp8_missing(device_type)}")
    _check_mode(mode)
    if mode == "no":
        return {"enabled": False}
    return {"dtype": PRECISION_DTYPES[mode]}


def _check_mode(mode: str) -> None:
    if mode not in PRECISIONS and mode != "fp8":  # fp8 is refused where it is entered, saying what is missing
        valid = ", ".join(PRECISIONS)
        raise ConfigurationError(
            f"accelkit.precision({mode!r}): unknown mode; valid modes: {valid}{suggest(mode, PRECISIONS)}"
        )


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
        self._autocast = autocast_options(mode, device_type)  # validates the mode; once, not per forward
        self.forward_module = module
        self.mode = mode
        self.device_type = device_type
        # torch.autocast regions made for this module and not entered now: each forward enters one
        # (building one costs as much as entering it); more than one only while forward runs in itself.
        self._idle: list[torch.autocast] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        idle = self.__dict__.get("_idle")  # absent from a module pickled before there was one
        region = idle.pop() if idle else torch.autocast(self.device_type, **self._autocast)
        with region:
            outputs = self.forward_module(*args, **kwargs)
        if idle is not None:
            idle.append(region)
        # Outputs leave the region in fp32, so losses computed outside it stay accurate.
        if isinstance(outputs, torch.Tensor):  # the common case, without two calls
            return outputs.float() if outputs.dtype in _HALF else outputs
        return _tree.apply_to_tensors(_to_fp32, outputs)

    def __getattr__(self, name: str) -> Any:
        return inner_attribute(self, name, "forward_module")

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


_HALF = (torch.float16, torch.bfloat16)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _HALF else t
