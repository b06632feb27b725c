"""What ``ak.save_state`` writes of each object it is given, decided once, on the calling thread.

- An object with ``state_dict()``: its state, written by the main process to ``NAME.pt``; a
  sharded one (DTensor state: a ``fully_shard``-ed module and its optimizer, passed together)
  by every rank to ``NAME.dcp/``, or, with ``full_state=True``, gathered on the main process
  into ``NAME.pt`` in the format of ``torch.distributed.checkpoint.state_dict`` (an optimizer's
  state keyed by parameter names), which loads on any number of processes and strategies.
- A plain value: JSON-able ones go into the manifest; values holding tensors (a 0-d loss,
  containers of tensors) into ``values.pt``, detached copies on the CPU.
"""

import json
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import _state
from . import _full, _sharded

__all__ = ["Contents", "collect", "owners", "unwrapped"]

_PLAIN_LEAVES = (str, int, float, bool, type(None))


class Contents(NamedTuple):
    """The state to write, by file: every tensor in it may be replaced by a staged copy."""

    plain: dict[str, Any]  # NAME.pt, written by the main process (empty on the others for full states)
    sharded: dict[str, Any]  # NAME.dcp/: this rank's shards
    full: list[str]  # names in ``plain`` in DCP's full-state format (optimizers keyed by parameter names)
    values: dict[str, Any]  # JSON-able values (a copy: later changes to the caller's objects do not show)
    tensors: dict[str, Any]  # values holding tensors: values.pt

    @property
    def objects(self) -> list[str]:
        return sorted([*self.plain, *self.sharded])


def unwrapped(obj: Any) -> Any:
    """Modules without DDP/FSDP/compile wrappers: a checkpoint loads on any number of processes."""
    from .._training import unwrap

    return unwrap(obj) if isinstance(obj, nn.Module) else obj


def owners(call: str, sharded: dict[str, Any], objects: dict[str, Any]) -> dict[str, nn.Module | None]:
    """For each optimizer in ``sharded``, the module among ``objects`` it optimizes (None for modules)."""
    modules = {name: unwrapped(obj) for name, obj in objects.items() if isinstance(obj, nn.Module)}
    return {
        name: None if isinstance(obj, nn.Module) else _sharded.optimizer_owner(call, name, obj, modules)
        for name, obj in sharded.items()
    }


def collect(call: str, objects: dict[str, Any], full_state: bool) -> Contents:
    """The state of ``objects``; every rank must call it (gathering full states is a collective)."""
    stateful, values, tensors = {}, {}, {}
    for name, obj in objects.items():
        if not name.isidentifier():
            raise ValueError(f"{call}: object name {name!r} is not an identifier; name objects like model=...")
        if callable(getattr(obj, "state_dict", None)):
            stateful[name] = obj
        elif _holds_tensors(obj):
            tensors[name] = _tensor_value(call, name, obj)
        else:
            values[name] = _json_value(call, name, obj)
    strategy = _state.strategy()
    sharded = {name: obj for name, obj in stateful.items() if strategy.shards_state(unwrapped(obj))}
    if full_state:  # modules and optimizers, sharded or not: one format that loads everywhere
        gathered = {n: o for n, o in stateful.items() if n in sharded or _is_optimizer(o)}
        owner = owners(call, {n: o for n, o in gathered.items() if not isinstance(o, nn.Module)}, objects)
        plain = {
            name: _full.state(unwrapped(obj), owner.get(name)) if name in gathered else unwrapped(obj).state_dict()
            for name, obj in stateful.items()
        }
        return Contents(plain, {}, sorted(gathered), values, tensors)
    owner = owners(call, sharded, objects)
    plain = {name: unwrapped(obj).state_dict() for name, obj in stateful.items() if name not in sharded}
    shards = {name: _sharded.state_dict(unwrapped(obj), owner[name]) for name, obj in sharded.items()}
    return Contents(plain, shards, [], values, tensors)


def _is_optimizer(obj: Any) -> bool:
    return isinstance(_sharded.torch_optimizer(obj), torch.optim.Optimizer)


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def _tensor_value(call: str, name: str, value: Any, path: str = "") -> Any:
    """``value`` with each tensor a detached CPU copy; only what ``torch.load(weights_only=True)`` reads back."""
    where = f"{name}{path}"
    if isinstance(value, torch.Tensor):
        if type(value.detach()) is not torch.Tensor:
            raise TypeError(
                f"{call}: {where} is a {type(value).__qualname__}; save a plain tensor "
                f"(for a DTensor: {where}.full_tensor())"
            )
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict) and type(value) is dict:
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{call}: {where} has the key {bad[0]!r}; keys of saved values are strings")
        return {k: _tensor_value(call, name, v, f"{path}[{k!r}]") for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_tensor_value(call, name, v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(value, _PLAIN_LEAVES):
        return value
    raise TypeError(
        f"{call}: {where}={type(value).__qualname__} {value!r:.60} cannot be saved beside tensors; values hold "
        f"tensors, numbers, strings, None, and dicts (string keys), lists and tuples of them"
    )


def _json_value(call: str, name: str, value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))  # a copy: a background save writes it later
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{call}: {name}={type(value).__qualname__} {value!r:.60} has no state_dict() and is not JSON-able "
            f"({exc}); pass an object with state_dict()/load_state_dict(), or convert it (tensors, lists, dicts, "
            f"numbers, strings)"
        ) from None
