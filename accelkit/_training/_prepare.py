"""``ak.prepare``: place models, optimizers, schedulers and dataloaders for this process."""

from __future__ import annotations

from typing import Any, Literal, TypeVar, overload

import torch
from torch import nn

from .. import _state
from .._data import PreparedDataLoader, prepare_dataloader
from .._strategies import LAYOUT_OPTIONS, comm_hooks
from ._optim import PreparedOptimizer, PreparedScheduler
from ._precision import MixedPrecisionModule
from ._waits import mark_waits

__all__ = ["prepare"]

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")
F = TypeVar("F")
Kind = Literal["model", "optimizer", "scheduler", "loader", "prepared"]
_MODEL_OPTIONS = {
    "find_unused_parameters", "broadcast_buffers", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
    *LAYOUT_OPTIONS,
}  # fmt: skip
_LOADER_OPTIONS = {"even_batches", "split_batches", "data_seed"}
_OPTIONS = {"join_uneven_inputs", *comm_hooks.PREPARE_OPTIONS}


# Each object's own type back, in order (a prepared optimizer forwards what it does not define, so code
# written against torch.optim.AdamW keeps working on it, and the type checker says so).
@overload
def prepare(a: A, /, **options: Any) -> A: ...
@overload
def prepare(a: A, b: B, /, **options: Any) -> tuple[A, B]: ...
@overload
def prepare(a: A, b: B, c: C, /, **options: Any) -> tuple[A, B, C]: ...
@overload
def prepare(a: A, b: B, c: C, d: D, /, **options: Any) -> tuple[A, B, C, D]: ...
@overload
def prepare(a: A, b: B, c: C, d: D, e: E, /, **options: Any) -> tuple[A, B, C, D, E]: ...
@overload
def prepare(a: A, b: B, c: C, d: D, e: E, f: F, /, **options: Any) -> tuple[A, B, C, D, E, F]: ...
@overload
def prepare(*objects: Any, **options: Any) -> tuple[Any, ...]: ...
def prepare(*objects: Any, **options: Any) -> Any:
    """Make each object ready for this process; returns them in the same order.

    - ``nn.Module``: moved to ``ak.device()``, wrapped in DDP when several processes run, its
      forward under the configured precision. With ``strategy="fsdp"`` it is sharded in place with
      FSDP2's ``fully_shard`` instead (units from ``fsdp_wrap`` / ``fsdp_min_params``, then the
      root); on a mesh with ``tp`` > 1, ``tp_plan`` splits its layers first. With one process it
      runs unsharded.
    - optimizer: steps only on real steps, through the fp16 grad scaler. Under FSDP its param
      groups are pointed at the sharded parameters (same groups, same hyper-parameters), so build
      it before or after ``prepare``, as you like, but prepare it before it steps.
    - LR scheduler: steps once per real optimizer step (size it from the prepared loader).
    - ``DataLoader``: this rank's shard of each epoch, its batches on the device.

    With ``strategy="deepspeed"`` the model, its optimizer and scheduler go through one
    ``deepspeed.initialize`` instead (``pip install "accelkit[deepspeed]"``); the model
    comes back as the DeepSpeed engine.

    One object in, that object out (not a 1-tuple). Preparing twice is harmless.

    Args:
        *objects: models, optimizers, LR schedulers and dataloaders, in any order.
        **options: for the objects of their kind, below.

    Other Parameters:
        even_batches (bool): loaders (default ``True``): every rank gets as many batches; the last
            global batch is completed from the epoch's start, and ``ak.gather_for_metrics`` drops the
            padding.
        split_batches (bool): loaders (default ``False``): the loader's ``batch_size`` is the global
            batch, split between the ranks.
        data_seed (int | None): loaders: a fixed seed for the shuffle order (epoch ``e``:
            ``data_seed + e``).
        find_unused_parameters (bool): DDP models: passed to ``DistributedDataParallel``, as are the
            next four (under FSDP they are ignored).
        broadcast_buffers (bool): DDP's.
        static_graph (bool): DDP's.
        gradient_as_bucket_view (bool): DDP's.
        bucket_cap_mb (float): DDP's.
        tp_plan (dict | Callable | str): models, with the mesh's ``tp`` > 1: module-name patterns
            (``"blocks.*.mlp.up"``) to torch's ``ParallelStyle`` objects (``ColwiseParallel()``, ...)
            or transformers' names (``"colwise"``, ``"rowwise"``), a callable
            ``(model, tp_mesh) -> model``, or ``"auto"`` (the plan a transformers model carries).
            Ignored without tensor parallelism.
        activation_checkpointing (Sequence[str | type]): models: these modules' activations are
            recomputed in backward (``("Block",)``).
        comm_hook (str | Callable): DDP models: the gradient communication hook, ``"fp16"`` / ``"bf16"``
            (compressed all-reduce), ``"power_sgd"`` / ``"batched_power_sgd"`` (low rank), or your own
            ``hook(state, bucket)``; the default is ``ak.init(comm_hook=...)``'s.
        comm_hook_options (dict): ``PowerSGDState``'s options (``{"matrix_approximation_rank": 2}``).
        comm_hook_state (Any): your own hook's state.
        comm_wrapper (str): ``"fp16"`` / ``"bf16"``: compresses a PowerSGD (or your) hook's input.
        join_uneven_inputs (bool): with ``even_batches=False``: the loaders of this call iterate inside
            PyTorch's ``Join`` with its DDP models, so a rank that runs out of batches first shadows the
            others' gradient all-reduces instead of leaving them waiting.

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = ak.prepare(model, opt)
    """
    unknown = set(options) - _MODEL_OPTIONS - _LOADER_OPTIONS - _OPTIONS
    if unknown:
        valid = ", ".join(sorted(_MODEL_OPTIONS | _LOADER_OPTIONS | _OPTIONS))
        raise TypeError(f"accelkit.prepare() got an unexpected option {sorted(unknown)[0]!r}; valid options: {valid}")
    if not objects:
        raise TypeError("accelkit.prepare() needs at least one object: ak.prepare(model, optimizer, loader)")
    join = options.get("join_uneven_inputs", False)
    if not isinstance(join, bool):
        raise TypeError(f"accelkit.prepare(join_uneven_inputs={join!r}): expected True or False")
    model_options: dict[str, Any] = {k: v for k, v in options.items() if k in _MODEL_OPTIONS}
    loader_options = {k: v for k, v in options.items() if k in _LOADER_OPTIONS}
    st = _state.get()
    training = _state.training
    kinds = [_classify(obj, training) for obj in objects]
    slots: dict[Kind, list[int]] = {"model": [], "optimizer": [], "scheduler": [], "loader": [], "prepared": []}
    for i, kind in enumerate(kinds):
        slots[kind].append(i)
    if slots["model"] or any(k in options for k in comm_hooks.PREPARE_OPTIONS):
        hook = comm_hooks.comm_hook(options, st.options)
        if hook is not None:
            model_options["comm_hook"] = hook
    prepared: list[Any] = list(objects)
    for i in slots["loader"]:
        prepared[i] = prepare_dataloader(objects[i], **loader_options)
    models = [objects[i] for i in slots["model"]]
    batch_sizes = [objects[i].batch_size for i in slots["loader"] if objects[i].batch_size]
    strategy = _state.strategy()
    wrapped_models, optimizers, schedulers = strategy.setup(
        models,
        [objects[i] for i in slots["optimizer"]],
        [objects[i] for i in slots["scheduler"]],
        micro_batch_size=batch_sizes[0] if batch_sizes else None,
        model_options=model_options,
    )
    training.use(strategy)  # its fp16 grad scaler may be new: the step path's flag follows
    if join:
        _join(wrapped_models, [prepared[i] for i in slots["loader"]])
    if st.distributed:
        for model in wrapped_models:
            mark_waits(model)
    for i, model in zip(slots["model"], wrapped_models, strict=True):
        if st.options.precision != "no":  # outermost: DDP, FSDP and DeepSpeed see the user's module
            model = MixedPrecisionModule(model, st.options.precision, st.device.type)
        training.models.add(model)
        prepared[i] = model
    for i, optimizer in zip(slots["optimizer"], optimizers, strict=True):
        prepared[i] = PreparedOptimizer(optimizer)
        training.optimizers.add(prepared[i])
    for i, scheduler in zip(slots["scheduler"], schedulers, strict=True):
        prepared[i] = PreparedScheduler(scheduler)
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


def _join(models: list[nn.Module], loaders: list[PreparedDataLoader]) -> None:
    from torch.distributed.algorithms.join import Joinable

    joinables = [m for m in models if isinstance(m, Joinable)]  # DDP; one process has nothing to join
    if not loaders:
        raise TypeError(
            "accelkit.prepare(join_uneven_inputs=True) needs the DataLoaders in the same call: "
            "ak.prepare(model, optimizer, loader, even_batches=False, join_uneven_inputs=True)"
        )
    for loader in loaders:
        loader.join_with(joinables)


def _classify(obj: Any, training: _state.TrainingState) -> Kind:
    """What ``obj`` is to ``prepare``; a TypeError naming what it takes otherwise."""
    if isinstance(obj, (PreparedOptimizer, PreparedScheduler, PreparedDataLoader)) or obj in training.models:
        return "prepared"
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.utils.data.DataLoader):
        return "loader"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or _looks_like_scheduler(obj):
        return "scheduler"
    raise TypeError(
        f"accelkit.prepare() cannot prepare {type(obj).__module__}.{type(obj).__qualname__}; it takes "
        f"nn.Module, torch.optim.Optimizer, LR schedulers and torch.utils.data.DataLoader objects"
    )


def _looks_like_scheduler(obj: Any) -> bool:
    # ReduceLROnPlateau and third-party schedulers: a step() and an optimizer.
    return callable(getattr(obj, "step", None)) and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
