"""``ak.prepare`` under ``strategy="deepspeed"``: one ``deepspeed.initialize`` for the model,
its optimizer and scheduler (``pip install "accelkit[deepspeed]"``; imported only here).

The DeepSpeed engine takes over what accelkit does otherwise: ``ak.backward(loss)`` is
``engine.backward(loss)`` (the engine scales for fp16), ``optimizer.step()`` is
``engine.step()`` on every micro-step (the engine steps the optimizer and the scheduler on
the boundary and zeroes the gradients), ``zero_grad()`` and the scheduler's ``step()`` do
nothing. ``ak.accumulate`` still decides where the boundary is, as under the other
strategies: ``ak.backward`` tells the engine whether this micro-step is one
(``set_gradient_accumulation_boundary``) and divides the loss by ``ak.accumulate``'s
steps, so the last batch of a loader steps, and ``steps=`` need not match the config.

Put gradient clipping in the config (``gradient_clipping``): without it nothing is clipped,
as under the other strategies (accelkit writes ``"gradient_clipping": 0.0``; DeepSpeed's own
default, 1.0 in recent releases, would clip silently). ZeRO refuses optimizers it has not
tested unless ``zero_allow_untested_optimizer`` is set; accelkit sets it for torch.optim's
element-wise optimizers (SGD, Adam, RMSprop, ...), which ZeRO's partitioning cannot change,
and leaves it to the config for any other.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import _state
from ..errors import ConfigurationError
from ..training._optim import PreparedOptimizer, PreparedScheduler

__all__ = ["DEFAULT_CONFIG", "fill_auto", "load_config", "prepare_with_deepspeed", "set_defaults"]

# Used when no deepspeed_config is given: ZeRO stage 2, everything else from accelkit's options.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def load_config(value: str | None) -> dict[str, Any]:
    """The DeepSpeed config from ``deepspeed_config``: a JSON file path or JSON text (None: the default)."""
    if value is None:
        return json.loads(json.dumps(DEFAULT_CONFIG))  # type: ignore[no-any-return]
    text = value
    if not value.lstrip().startswith(("{", "[")):
        if not os.path.isfile(value):
            raise ConfigurationError(
                f"deepspeed_config={value!r} is neither JSON text nor an existing file; "
                f"pass the path of a DeepSpeed JSON config, or a dict"
            )
        with open(value, encoding="utf-8") as f:
            text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"deepspeed_config={value!r} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(config, dict):
        raise ConfigurationError(f"deepspeed_config={value!r} must hold a JSON object, not {type(config).__name__}")
    return config


def fill_auto(
    config: Mapping[str, Any],
    *,
    micro_batch_size: int | None,
    gradient_accumulation_steps: int,
    precision: str,
    world_size: int,
) -> dict[str, Any]:
    """A copy of ``config`` with its ``"auto"`` values filled from accelkit's options.

    Fills ``train_micro_batch_size_per_gpu`` (the prepared loader's batch size),
    ``gradient_accumulation_steps``, ``train_batch_size`` (their product times the world
    size) and ``bf16.enabled`` / ``fp16.enabled`` (from the precision). Any other ``"auto"``
    is an error naming it.

    Example:
        >>> cfg = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}
        >>> fill_auto(cfg, micro_batch_size=8, gradient_accumulation_steps=1, precision="bf16", world_size=2)
        {'train_micro_batch_size_per_gpu': 8, 'bf16': {'enabled': True}}
    """
    out: dict[str, Any] = json.loads(json.dumps(config))
    micro_auto = out.get("train_micro_batch_size_per_gpu") == "auto"
    total_auto = out.get("train_batch_size") == "auto"
    micro_known = isinstance(out.get("train_micro_batch_size_per_gpu"), int)
    if (micro_auto or (total_auto and not micro_known)) and micro_batch_size is None:
        raise ConfigurationError(
            "the DeepSpeed config says 'auto' for the batch size, but ak.prepare got no DataLoader with a "
            "batch_size; prepare the loader in the same call: ak.prepare(model, optimizer, loader), or put "
            "a number in the config"
        )
    if micro_auto:
        out["train_micro_batch_size_per_gpu"] = micro_batch_size
    if out.get("gradient_accumulation_steps") == "auto":
        out["gradient_accumulation_steps"] = gradient_accumulation_steps
    if total_auto:
        micro = out.get("train_micro_batch_size_per_gpu", micro_batch_size)
        out["train_batch_size"] = (
            micro * out.get("gradient_accumulation_steps", gradient_accumulation_steps) * world_size
        )
    for mode in ("bf16", "fp16"):
        section = out.get(mode)
        if isinstance(section, dict):
            if section.get("enabled") == "auto":
                section["enabled"] = precision == mode
            elif section.get("enabled") is True and precision not in ("no", mode):
                raise ConfigurationError(
                    f"the DeepSpeed config enables {mode}, but accelkit's precision is {precision!r}; "
                    f'set "{mode}": {{"enabled": "auto"}} in the config, or precision={mode!r}'
                )
    left = _autos(out)
    if left:
        raise ConfigurationError(
            f"the DeepSpeed config has 'auto' at {', '.join(left)}, which accelkit cannot fill; "
            f"put values there (accelkit fills train_micro_batch_size_per_gpu, train_batch_size, "
            f"gradient_accumulation_steps and bf16/fp16.enabled)"
        )
    return out


# torch.optim's optimizers whose update is element-wise: ZeRO's flattening and partitioning of
# the parameters cannot change their result (LBFGS, SparseAdam and third-party ones may).
_ELEMENTWISE_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD",
)  # fmt: skip


def set_defaults(config: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """A copy of ``config`` with accelkit's defaults where it says nothing.

    - ``gradient_clipping``: 0.0, no clipping (DeepSpeed's default, 1.0 in 0.19.8,
      would clip every step unasked; ``ak.clip_grad_norm_`` is explicit elsewhere too).
    - ``zero_allow_untested_optimizer``: True when ``optimizer`` is one of torch.optim's
      element-wise optimizers (ZeRO tests only Adam, AdamW and Adagrad among them).

    Example:
        >>> set_defaults({}, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
        {'gradient_clipping': 0.0, 'zero_allow_untested_optimizer': True}
    """
    out: dict[str, Any] = json.loads(json.dumps(config))
    out.setdefault("gradient_clipping", 0.0)
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in _ELEMENTWISE_OPTIMIZERS:
        out.setdefault("zero_allow_untested_optimizer", True)
    return out


def _autos(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _autos(v, f"{path}.{k}" if path else str(k))]
    return [path] if node == "auto" else []


def prepare_with_deepspeed(objects: Sequence[Any], loader_options: dict[str, Any]) -> list[Any]:
    """``ak.prepare``'s objects through ``deepspeed.initialize``; the same order."""
    try:
        deepspeed = importlib.import_module("deepspeed")
    except ImportError as exc:
        raise ImportError(
            f'strategy="deepspeed" needs DeepSpeed, which is not installed ({exc}); '
            f'run: pip install "accelkit[deepspeed]", or use strategy="fsdp"'
        ) from exc
    from ..data import prepare_dataloader

    st = _state.get()
    slots: dict[str, list[int]] = {"model": [], "optimizer": [], "scheduler": [], "loader": []}
    for i, obj in enumerate(objects):
        slots[_kind(obj)].append(i)
    for kind in ("model", "optimizer", "scheduler"):
        if len(slots[kind]) > 1:
            raise ConfigurationError(
                f'strategy="deepspeed" prepares one {kind} per ak.prepare call (one DeepSpeed engine), '
                f"got {len(slots[kind])}; prepare each model with its own optimizer and scheduler"
            )
    prepared = list(objects)
    for i in slots["loader"]:
        prepared[i] = prepare_dataloader(objects[i], **loader_options)
    batch_sizes = [objects[i].batch_size for i in slots["loader"] if objects[i].batch_size]
    if not slots["model"]:
        return prepared
    model = objects[slots["model"][0]]
    optimizer = objects[slots["optimizer"][0]] if slots["optimizer"] else None
    scheduler = objects[slots["scheduler"][0]] if slots["scheduler"] else None
    config = fill_auto(
        set_defaults(load_config(st.options.deepspeed_config), optimizer),
        micro_batch_size=batch_sizes[0] if batch_sizes else None,
        gradient_accumulation_steps=st.options.gradient_accumulation_steps,
        precision=st.options.precision,
        world_size=st.world_size,
    )
    if st.options.precision != "no":
        from ..training._prepare import _autocast_forward

        # The engine casts the weights; autocast lets fp32 batches meet them, as under DDP and FSDP.
        _autocast_forward(model, st.options.precision, st.device.type)
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    engine._accelkit_prepared = engine._accelkit_deepspeed = True
    prepared[slots["model"][0]] = engine
    if optimizer is not None:
        wrapped = DeepSpeedOptimizer(ds_optimizer, engine)
        _state.training.optimizers.add(wrapped)
        prepared[slots["optimizer"][0]] = wrapped
    if scheduler is not None:
        prepared[slots["scheduler"][0]] = DeepSpeedScheduler(ds_scheduler or scheduler)
    return prepared


def _kind(obj: Any) -> str:
    from ..training._prepare import _looks_like_scheduler

    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.utils.data.DataLoader):
        return "loader"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or _looks_like_scheduler(obj):
        return "scheduler"
    raise TypeError(
        f"accelkit.prepare() cannot prepare {type(obj).__module__}.{type(obj).__qualname__} under "
        f'strategy="deepspeed"; it takes one nn.Module, its optimizer and LR scheduler, and DataLoaders'
    )


class _Engine:
    """The engine as ``ak.backward`` sees it: ``backward`` on ``ak.accumulate``'s boundary and scale.

    Anything else is the engine's own.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        training = _state.training
        # Before the backward: the engine reduces the gradients during it on a boundary.
        self.engine.set_gradient_accumulation_boundary(training.sync_gradients)
        if training.accumulation_steps > 1:
            loss = loss / training.accumulation_steps
        return self.engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)


class DeepSpeedOptimizer(PreparedOptimizer):
    """The engine's optimizer: ``step()`` is ``engine.step()``, ``zero_grad()`` is the engine's business."""

    def __init__(self, optimizer: Any, engine: Any) -> None:
        super().__init__(optimizer)
        self.engine = _state.training.deepspeed_engine = _Engine(engine)  # what ak.backward drives
        self._skipped = getattr(engine, "skipped_steps", 0)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        # On every micro-step: the engine steps the optimizer only on the boundary ak.backward set.
        engine = self.engine.engine
        engine.step()
        skipped = getattr(engine, "skipped_steps", 0)  # fp16 overflows
        self.step_was_skipped, self._skipped = skipped > self._skipped, skipped
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class DeepSpeedScheduler(PreparedScheduler):
    """The scheduler DeepSpeed steps itself: ``step()`` does nothing."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"DeepSpeedScheduler({self.scheduler!r})"
