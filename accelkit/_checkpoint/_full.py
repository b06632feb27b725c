"""Full (consolidated) state of sharded modules and their optimizers, gathered and spread again.

The format is ``torch.distributed.checkpoint.state_dict``'s full state dict: a module's is its
plain ``state_dict()``; an optimizer's is keyed by parameter names instead of positions, so that
it fits the same model sharded any other way, or not at all. Gathering and spreading are
collectives when the module is sharded (every rank must call them); the gathered tensors are on
the main process' CPU, the other ranks get an empty dict.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import _state
from . import _sharded

__all__ = ["full_state_dict", "load_module", "load_optimizer", "state"]


def _options(cpu_offload: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The unsharded state of ``model`` (unwrapped): see :func:`accelkit.full_state_dict`."""
    if not _state.strategy().shards_state(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(model, options=_options(cpu_offload=True))
    return _tie(model, full)


def _tie(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with tied parameters (one parameter, several names) one tensor again, as ``state_dict()`` has."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        seen = first.setdefault(id(param), name)
        if seen != name and seen in state and name in state:
            state[name] = state[seen]
    return state


def state(obj: Any, owner: nn.Module | None) -> dict[str, Any]:
    """The full state of a module (``owner`` None) or of an optimizer over ``owner``'s parameters."""
    if isinstance(obj, nn.Module):
        return full_state_dict(obj)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = _sharded.torch_optimizer(obj)
    if owner is None:
        raise TypeError(f"{type(obj).__qualname__}: pass the module it optimizes (optimizer_owner)")
    fresh = not optimizer.state
    full = get_optimizer_state_dict(owner, optimizer, options=_options(cpu_offload=True))
    if fresh:  # torch initialised the state with a zero-lr step to save it; leave the optimizer as it was
        optimizer.state.clear()
    return full


def load_module(module: nn.Module, full: dict[str, Any]) -> None:
    """Load a module's full state into ``module``, sharded (every rank must call it) or not."""
    if not _state.strategy().shards_state(module):
        module.load_state_dict(full)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, full, options=_options())


def load_optimizer(owner: nn.Module, optimizer: Any, full: dict[str, Any]) -> None:
    """Load an optimizer's full state (keyed by parameter names) into ``optimizer`` over ``owner``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(owner, _sharded.torch_optimizer(optimizer), full, options=_options())
