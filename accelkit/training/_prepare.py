"""``ak.prepare``: place models, optimizers, schedulers and dataloaders for this process."""

from __future__ import annotations

import functools
from typing import Any, TypeVar, overload

import torch
from torch import nn

from .. import _state, _tree
from ._optim import PreparedOptimizer, PreparedScheduler
from ._precision import autocast

__all__ = ["prepare"]

T = TypeVar("T")
_MODEL_OPTIONS = {
    "find_unused_parameters", "broadcast_buffers", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
}  # fmt: skip
_LOADER_OPTIONS = {"even_batches"}


@overload
def prepare(obj: T, /, **options: Any) -> T: ...
@overload
def prepare(*objects: Any, **options: Any) -> tuple[Any, ...]: ...
def prepare(*objects: Any, **options: Any) -> Any:
    """Make each object ready for this process; returns them in the same order.

    - ``nn.Module``: moved to ``ak.device()``, wrapped in DDP when several processes run
      (DDP options such as ``find_unused_parameters=True`` pass through), forward under the
      configured precision. With ``strategy="fsdp"`` it is sharded in place with FSDP2's
      ``fully_shard`` instead (units from ``fsdp_wrap`` / ``fsdp_min_params``, then the root;
      the DDP options are ignored); with one process it runs unsharded.
    - optimizer: steps only on real steps, through the fp16 grad scaler. Under FSDP its
      param groups are pointed at the sharded parameters (same groups, same hyper-parameters),
      so build it before or after ``prepare``, as you like, but prepare it before it steps.
    - LR scheduler: steps once per real optimizer step.
    - ``DataLoader``: this rank's shard, batches on the device (``even_batches=True``).

    With ``strategy="deepspeed"`` the model, its optimizer and scheduler go through one
    ``deepspeed.initialize`` instead (``pip install "accelkit[deepspeed]"``); the model
    comes back as the DeepSpeed engine.

    One object in, that object out (not a 1-tuple). Preparing twice is harmless.

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = ak.prepare(model, opt)
    """
    unknown = set(options) - _MODEL_OPTIONS - _LOADER_OPTIONS
    if unknown:
        valid = ", ".join(sorted(_MODEL_OPTIONS | _LOADER_OPTIONS))
        raise TypeError(f"accelkit.prepare() got an unexpected option {sorted(unknown)[0]!r}; valid options: {valid}")
    if not objects:
        raise TypeError("accelkit.prepare() needs at least one object: ak.prepare(model, optimizer, loader)")
    model_options = {k: v for k, v in options.items() if k in _MODEL_OPTIONS}
    loader_options = {k: v for k, v in options.items() if k in _LOADER_OPTIONS}
    if _state.get().options.strategy == "deepspeed":
        from .._strategies.deepspeed import prepare_with_deepspeed

        done = prepare_with_deepspeed(objects, loader_options)
        return done[0] if len(done) == 1 else tuple(done)
    # Models first: optimizers must see parameters already on the device.
    ordered = sorted(range(len(objects)), key=lambda i: not isinstance(objects[i], nn.Module))
    prepared: list[Any] = list(objects)
    for i in ordered:
        prepared[i] = _prepare_one(objects[i], model_options, loader_options)
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


def _prepare_one(obj: Any, model_options: dict[str, Any], loader_options: dict[str, Any]) -> Any:
    if isinstance(obj, (PreparedOptimizer, PreparedScheduler)) or getattr(obj, "_accelkit_prepared", False):
        return obj
    if isinstance(obj, nn.Module):
        return _prepare_model(obj, model_options)
    if isinstance(obj, torch.optim.Optimizer):
        return _prepare_optimizer(obj)
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or _looks_like_scheduler(obj):
        return PreparedScheduler(obj)
    if isinstance(obj, torch.utils.data.DataLoader):
        from ..data import prepare_dataloader

        return prepare_dataloader(obj, **loader_options)
    raise TypeError(
        f"accelkit.prepare() cannot prepare {type(obj).__module__}.{type(obj).__qualname__}; it takes "
        f"nn.Module, torch.optim.Optimizer, LR schedulers and torch.utils.data.DataLoader objects"
    )


def _prepare_model(model: nn.Module, options: dict[str, Any]) -> nn.Module:
    st = _state.get()
    model.to(st.device)
    if st.options.precision != "no":
        _autocast_forward(model, st.options.precision, st.device.type)
    if not st.distributed:
        model._accelkit_prepared = True  # type: ignore[assignment]
        return model
    if st.options.strategy == "fsdp":
        from .._strategies.fsdp import shard

        shard(model, st)  # in place: the module is its own wrapper
        model._accelkit_prepared = True  # type: ignore[assignment]
        return model
    device_ids = [st.device.index] if st.device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)
    wrapped._accelkit_prepared = True  # type: ignore[assignment]
    return wrapped


def _autocast_forward(model: nn.Module, mode: str, device_type: str) -> None:
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


def _prepare_optimizer(optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
    from .._strategies.fsdp import grad_scaler, repoint_optimizer

    st = _state.get()
    repoint_optimizer(optimizer)
    if optimizer.state:
        # Move state loaded before prepare onto the parameters' devices.
        optimizer.load_state_dict(optimizer.state_dict())
    training = _state.training
    if st.options.precision == "fp16" and training.scaler is None:
        sharded = st.options.strategy == "fsdp" and st.distributed
        training.scaler = grad_scaler(st.device.type) if sharded else torch.amp.GradScaler(st.device.type)
    prepared = PreparedOptimizer(optimizer)
    training.optimizers.add(prepared)
    return prepared


def _looks_like_scheduler(obj: Any) -> bool:
    # ReduceLROnPlateau and third-party schedulers: a step() and an optimizer.
    return callable(getattr(obj, "step", None)) and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
