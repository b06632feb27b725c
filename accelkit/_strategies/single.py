"""One process: models move to the device unwrapped; the base the other strategies refine."""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import _torch_private
from .._options import Options
from ._protocol import Setup, Skipped, Strategy
from .layout import Layout, check_plan, checkpoint_modules, split_layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["PRECISION_DTYPES", "SingleProcess", "StepCalls", "holds_dtensors", "inner_attribute"]

# The dtype each half precision computes in: autocast's, and FSDP's parameters'.
PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class StepCalls:
    """How many times an optimizer's ``step()`` ran (an optimizer post-step hook counts)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1


class SingleProcess:
    """The strategy of a single process, and the default behaviour of every other one."""

    name = "single"
    owns_schedulers = False
    steps_on_micro_steps = False
    torch_step = True  # see Strategy.torch_step: False in a subclass with its own backward or step

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = ("backward", "optimizer_step", "zero_grad")
        if "torch_step" not in cls.__dict__ and any(name in cls.__dict__ for name in own):
            cls.torch_step = False  # its own step: the step path calls it

    def __init__(self, options: Options, device: torch.device) -> None:
        self.options = options
        self.device = device
        self._no_sync_depth: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._calls: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepCalls] = weakref.WeakKeyDictionary()
        self.scaler: Any = None  # the fp16 GradScaler, made when the first optimizer is prepared under fp16
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # those it scales
        self._unscaled = False  # their gradients were unscaled this step (clipping unscales once per step)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy, as of ``ak.state()``) with none of this process's objects.

        What a strategy learned about them sits in weak maps and references, which do not pickle
        and mean nothing in another process: the copy starts with empty ones, and no grad scaler.
        """
        state = {name: _forget(value) for name, value in self.__dict__.items()}
        state["scaler"], state["_unscaled"] = None, False
        if "_mesh" in state:
            state["_mesh"] = None  # its process groups are this process's
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({name: _empty(value) for name, value in state.items()})

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        *,
        micro_batch_size: int | None,
        model_options: Mapping[str, Any],
    ) -> Setup:
        layout, rest = split_layout(model_options, self.options.activation_checkpointing)
        wrapped = [self.wrap_model(self.lay_out(model.to(self.device), layout), rest) for model in models]
        for optimizer in optimizers:
            self.fit_optimizer(optimizer)
            self._optimizers.add(optimizer)
        if optimizers and self.options.precision == "fp16" and self.scaler is None:
            self.scaler = self.new_scaler()
        return wrapped, list(optimizers), list(schedulers)

    def lay_out(self, model: nn.Module, layout: Layout) -> nn.Module:
        """``model`` laid out before wrapping: its tensor-parallel plan checked (applied only on a mesh
        with ``tp > 1``: a script keeps its plan on one process), its activation checkpointing applied."""
        check_plan(model, layout.tp_plan)
        checkpoint_modules(model, layout.activation_checkpointing)
        return model

    def wrap_model(self, model: nn.Module, model_options: Mapping[str, Any]) -> nn.Module:
        """``model`` (already on the device and laid out) as this strategy runs it."""
        return model

    def device_mesh(self) -> Any:
        return None

    def fit_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Fit an optimizer to the prepared models' parameters (nothing to do unsharded)."""
        if optimizer.state:
            # State loaded before prepare moves onto the parameters' devices.
            optimizer.load_state_dict(optimizer.state_dict())

    def new_scaler(self) -> Any:
        """A new fp16 gradient scaler for this strategy's gradients."""
        return torch.amp.GradScaler(self.device.type)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        if isinstance(model, nn.parallel.DistributedDataParallel):  # the common case first
            return model.no_sync()
        if callable(_method(model, "set_requires_gradient_sync")):  # fully_shard-ed (by ak.prepare or by hand)
            return self._gradient_sync_off(model)
        sync_off = _method(model, "no_sync")  # DDP's, under a torch.compile wrapper
        return sync_off() if callable(sync_off) else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, divide_by: int, boundary: bool, **kwargs: Any) -> None:
        if divide_by > 1:
            loss = loss / divide_by
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None, *, boundary: bool
    ) -> tuple[float | None, Skipped]:
        """Step through the fp16 scaler, adding no host-device synchronisation to what the scaler does.

        Whether the step was skipped comes without reading the device: a plain optimizer's
        ``step()`` is not called at all on an overflow (a step hook counts the calls; GradScaler
        itself read the overflow flag to decide); an optimizer that skips on the device (fused
        Adam/AdamW/SGD, ``_step_supports_amp_scaling``) always runs, and its overflow flag comes
        back as a device tensor, read only by whoever asks.
        """
        if not boundary:
            return None, None
        scaler = self.scaler
        if scaler is None:
            return optimizer.step(closure), False
        self._unscaled = False
        if closure is not None:
            raise ValueError(
                f"optimizer.step(closure) under fp16: the grad scaler cannot re-evaluate a closure (it would see "
                f"scaled gradients); step {type(optimizer).__name__} without one, or use precision='bf16' or 'no'"
            )
        fused = _torch_private.skips_on_device(optimizer)
        if fused is None:  # a torch accelkit was not checked on: the public way, reading the scale twice
            before = scaler.get_scale()
            loss = scaler.step(optimizer)
            scaler.update()
            return loss, scaler.get_scale() < before
        if fused:  # GradScaler always calls its step()
            loss = scaler.step(optimizer)
            # Read before update(), which forgets it: the flag the step skipped on, one per device.
            flags = _torch_private.found_inf_flags(scaler, optimizer)
            scaler.update()
            if len(flags) <= 1:
                return loss, flags[0] if flags else False  # none: a disabled scaler, nothing skipped
            return loss, torch.stack([f.to(flags[0].device) for f in flags]).sum()
        calls = self._step_calls(optimizer)
        before = calls.count
        loss = scaler.step(optimizer)
        scaler.update()
        return loss, calls.count == before  # GradScaler calls step() unless it found inf/NaN gradients

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def unscale(self) -> None:
        if self.scaler is None or self._unscaled:
            return
        for optimizer in self._optimizers:
            self.scaler.unscale_(optimizer)
        self._unscaled = True

    def gradient_scale(self) -> torch.Tensor | float | None:
        if self.scaler is None:
            return None
        scale = _torch_private.scale_on_device(self.scaler)  # get_scale() would read it back to the host
        return scale if scale is not None else float(self.scaler.get_scale())

    def scaler_state_dict(self) -> dict[str, Any] | None:
        return None if self.scaler is None else dict(self.scaler.state_dict())

    def load_scaler_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)

    def keep_from(self, previous: Strategy) -> None:
        if isinstance(previous, SingleProcess):
            self.scaler, self._unscaled = previous.scaler, previous._unscaled
            self._optimizers.update(previous._optimizers)

    def _step_calls(self, optimizer: torch.optim.Optimizer) -> StepCalls:
        """A counter of ``optimizer.step()`` calls, kept by a post-step hook registered once.

        The hook goes with this strategy (a new process state registers its own): it is removed
        when the strategy is garbage collected.
        """
        calls = self._calls.get(optimizer)
        if calls is None:
            calls = self._calls[optimizer] = StepCalls()
            handle = optimizer.register_step_post_hook(calls.hook)
            weakref.finalize(self, handle.remove)
        return calls

    def unwrap(self, model: nn.Module) -> nn.Module:
        wrappers = _wrapper_types()
        while isinstance(model, wrappers):
            inner = _torch_private.compiled_inner(model) or model.module
            if not isinstance(inner, nn.Module):
                break
            model = inner
        return model

    def release(self, model: nn.Module) -> None:
        pass  # nothing holds a process group

    def shards_state(self, obj: Any) -> bool:
        return holds_dtensors(obj)

    def process_group(self, name: str) -> ProcessGroup | None:
        if name == "dp":
            return None  # without a mesh, every process holds its own data: the world
        raise ValueError(
            f"accelkit: group={name!r} names a device mesh dimension, but this job has no device mesh, so its one "
            f"group name is 'dp' (the data-parallel processes: all of them here). The names are 'dp', "
            f"'dp_replicate', 'dp_shard', 'tp' and 'cp'; a mesh is configured with the dp_shard, dp_replicate "
            f"and tp options (ak.init, @ak.distributed, `accelkit launch`)."
        )

    @contextlib.contextmanager
    def _gradient_sync_off(self, model: nn.Module) -> Iterator[None]:
        """FSDP2's ``no_sync``: gradients accumulate unreduced until the outermost region ends."""
        depth = self._no_sync_depth.get(model, 0)
        self._no_sync_depth[model] = depth + 1
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self._no_sync_depth[model] = depth
            if depth == 0:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]


_WEAK_MAPS = (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet, WeakIdKeyDictionary)


class _EmptyMap:
    """What a weak map pickles as: its type, to make an empty one of when unpickled."""

    def __init__(self, kind: type) -> None:
        self.kind = kind


def _forget(value: Any) -> Any:
    if isinstance(value, _WEAK_MAPS):
        return _EmptyMap(type(value))
    return None if isinstance(value, weakref.ref) else value


def _empty(value: Any) -> Any:
    return value.kind() if isinstance(value, _EmptyMap) else value


def _method(model: nn.Module, name: str) -> Any:
    """``getattr(model, name, None)``, without nn.Module.__getattr__'s exception on a plain module.

    That miss costs more than the rest of ``ak.accumulate`` (it runs on every micro-step). Only a
    module whose class overrides ``__getattr__`` (a ``torch.compile`` wrapper) can have more than
    its class and its instance dictionary offer.
    """
    kind: Any = type(model)
    plain = getattr(kind, "__getattr__", None) is nn.Module.__getattr__
    if plain and name not in model.__dict__ and not _class_has(kind, name):
        return None
    return getattr(model, name, None)


@functools.lru_cache(maxsize=256)
def _class_has(kind: type, name: str) -> bool:
    return hasattr(kind, name)


def _wrapper_types() -> tuple[type, ...]:
    found: list[type] = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    # Only look for the wrappers of modules already imported: importing them is slow.
    compiled = _torch_private.compiled_type()
    if compiled is not None:
        found.append(compiled)
    if "torch.distributed.fsdp" in sys.modules:
        found.append(sys.modules["torch.distributed.fsdp"].FullyShardedDataParallel)
    return tuple(found)


def inner_attribute(wrapper: nn.Module, name: str, inner: str) -> Any:
    """``name`` of ``wrapper`` as nn.Module finds it (parameters, buffers, submodules), else of its module
    ``inner``: a wrapper's ``__getattr__`` that shows the wrapped module's attributes."""
    try:
        return nn.Module.__getattr__(wrapper, name)
    except AttributeError as missing:
        try:
            wrapped = nn.Module.__getattr__(wrapper, inner)
        except AttributeError:  # still being built (or unpickled)
            raise missing from None
        return getattr(wrapped, name)


def holds_dtensors(obj: Any) -> bool:
    """Whether ``obj`` (a module, or an optimizer) holds DTensors: parameters, buffers or optimizer state."""
    # A DTensor exists only once its module was imported: no need to import it (slow) to look.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return False
    if isinstance(obj, nn.Module):
        return any(isinstance(t, dtensor) for t in (*obj.parameters(), *obj.buffers()))
    if isinstance(obj, torch.optim.Optimizer):  # a prepared optimizer too: its param_groups are the user's
        return any(isinstance(p, dtensor) for group in obj.param_groups for p in group["params"])
    return False
