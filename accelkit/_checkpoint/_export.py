"""``ak.save_model``: the unwrapped model's weights, for inference or sharing (no training state)."""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _state
from ._where import storage_for

__all__ = ["save_model"]


def save_model(
    model: nn.Module, directory: str | os.PathLike[str], *, safe_serialization: bool | None = None
) -> Path | str:
    """Write the unwrapped ``model``'s weights to ``directory`` (on the main process only).

    ``model.safetensors`` (as Accelerate writes by default) when safetensors is installed
    (``pip install "accelkit[safetensors]"``); without it, ``pytorch_model.bin`` (``torch.save``
    of the state dict, which ``torch.load(weights_only=True)`` reads) and a warning saying so.
    ``safe_serialization=True`` insists on safetensors, ``False`` always writes the ``.bin``.
    Either loads into the unwrapped, unsharded model. ``directory`` may be a URL of an object
    store (``s3://bucket/export``; the ``fsspec`` extra): the file is uploaded whole. Returns the
    file's path (or URL), on every
    rank (no collective: other ranks should ``ak.wait_for_everyone()`` before reading it),
    except for a sharded model (``fully_shard``): every rank must call it then, to gather
    the full weights.

    Args:
        model: a prepared or plain model, sharded or not.
        directory: the folder to write the weights into (created if missing).
        safe_serialization: ``None``: safetensors when installed, else ``pytorch_model.bin`` and a
            warning; ``True``: safetensors or an error; ``False``: always ``pytorch_model.bin``.

    Example:
        >>> import accelkit as ak, torch
        >>> path = ak.save_model(torch.nn.Linear(2, 1), "export")  # doctest: +SKIP
        >>> torch.load(path, weights_only=True).keys()  # doctest: +SKIP
        odict_keys(['weight', 'bias'])
    """
    folder = storage_for(f"accelkit.save_model(model, {os.fspath(directory)!r})", directory)  # before any work
    folder.check_access()  # a missing bucket or missing credentials: before the weights are gathered
    from .._training import unwrap
    from . import _full  # with the first call (see _save_load)

    safetensors_torch = _safetensors(safe_serialization)
    name = "model.safetensors" if safetensors_torch else "pytorch_model.bin"
    module = unwrap(model)
    full = _full.full_state_dict(module) if _state.strategy().shards_state(module) else None  # a collective
    if not _state.get().is_main_process:
        return folder.child(name).location()
    if safetensors_torch is None:
        state = full if full is not None else {k: v.detach().cpu() for k, v in module.state_dict().items()}
        return folder.write_whole(name, lambda f: torch.save(state, f))
    if full is None:
        return folder.write_whole(name, lambda f: safetensors_torch.save_model(module, f.name))  # shared weights once
    tensors, metadata = _once(full)  # gathered: tied weights are one tensor under several names (safetensors refuses)
    return folder.write_whole(name, safetensors_torch.save(tensors, metadata=metadata))


def _once(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str] | None]:
    """``state`` with each tied tensor under one name, as ``safetensors.torch.save_model`` writes a module.

    Of the names of one tensor the first in sorted order is kept, and the metadata maps each
    name left out to it (as save_model's does): the file is the one an unsharded model writes, and
    ``safetensors.torch.load_model`` (or transformers, which ties the weights again) reads it.
    """
    names: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in state.items():
        # The same view of the same memory (tied); empty tensors have no memory to share. Views that only
        # overlap stay apart: safetensors refuses them, as it would a module's.
        same = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        names.setdefault(same if tensor.numel() else (id(tensor),), []).append(name)
    tensors, left_out = {}, {}
    for group in names.values():
        kept, *others = sorted(group)
        tensors[kept] = state[kept].contiguous()
        left_out.update(dict.fromkeys(others, kept))
    return {name: tensors[name] for name in state if name in tensors}, left_out or None


def _safetensors(wanted: bool | None) -> Any:
    """``safetensors.torch`` when it is wanted and installed; None for the ``.bin`` fallback."""
    if wanted is False:
        return None
    try:
        return importlib.import_module("safetensors.torch")
    except ImportError:
        install = 'pip install "accelkit[safetensors]"'
        if wanted:
            raise ImportError(f"accelkit.save_model(safe_serialization=True) needs safetensors: {install}") from None
        if _state.get().is_main_process:
            warnings.warn(
                f"accelkit.save_model: safetensors is not installed, so the weights go to pytorch_model.bin "
                f"(torch.save; load it with torch.load(path, weights_only=True)); {install} for model.safetensors, "
                f"or pass safe_serialization=False to say that the .bin is what you want",
                stacklevel=3,
            )
        return None
