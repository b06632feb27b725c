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

import contextlib
import importlib
import json
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .._options import Options
from ..errors import ConfigurationError, StateError
from ._protocol import Setup
from .comm_hooks import refuse_comm_hook
from .layout import split_layout
from .single import SingleProcess

__all__ = ["DEFAULT_CONFIG", "DeepSpeed", "fill_auto", "read_deepspeed_config", "set_defaults"]

# Used when no deepspeed_config is given: ZeRO stage 2, everything else from accelkit's options.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def read_deepspeed_config(value: str | None) -> dict[str, Any]:
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


class DeepSpeed(SingleProcess):
    """One ``deepspeed.initialize`` per model, with its optimizer and scheduler; the engine runs the step."""

    name = "deepspeed"
    owns_schedulers = True
    steps_on_micro_steps = True  # engine.step() counts the micro-steps

    def __init__(self, options: Options, device: torch.device, world_size: int) -> None:
        super().__init__(options, device)
        self.world_size = world_size
        self._engine: weakref.ref[Any] | None = None  # the trained engine: ak.backward and optimizer.step() drive it
        self._skipped = 0  # the engine's fp16 overflow count at the last step

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        *,
        micro_batch_size: int | None,
        model_options: Mapping[str, Any],
    ) -> Setup:
        refuse_comm_hook(model_options, self.name)
        for kind, given in (("model", models), ("optimizer", optimizers), ("scheduler", schedulers)):
            if len(given) > 1:
                raise ConfigurationError(
                    f'strategy="deepspeed" prepares one {kind} per ak.prepare call (one DeepSpeed engine), '
                    f"got {len(given)}; prepare each model with its own optimizer and scheduler"
                )
        if not models:
            if optimizers or schedulers:
                raise ConfigurationError(
                    'strategy="deepspeed" builds a model and its optimizer and scheduler into one engine: '
                    "prepare them in the same call, ak.prepare(model, optimizer, scheduler)"
                )
            return [], [], []
        if optimizers and self._engine is not None and self._engine() is not None:
            raise ConfigurationError(
                'strategy="deepspeed" trains one model per job (ak.backward and optimizer.step() drive its engine), '
                'and one with an optimizer is prepared already; use strategy="fsdp" to train several'
            )
        deepspeed = _import_deepspeed()
        layout, _ = split_layout(model_options, self.options.activation_checkpointing)
        self.lay_out(models[0], layout)
        optimizer = optimizers[0] if optimizers else None
        scheduler = schedulers[0] if schedulers else None
        config = fill_auto(
            set_defaults(read_deepspeed_config(self.options.deepspeed_config), optimizer),
            micro_batch_size=micro_batch_size,
            gradient_accumulation_steps=self.options.gradient_accumulation_steps,
            precision=self.options.precision,
            world_size=self.world_size,
        )
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=models[0], optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        if optimizer is not None:
            self._engine = weakref.ref(engine)
            self._skipped = getattr(engine, "skipped_steps", 0)
        return (
            [engine],
            [ds_optimizer] if optimizer is not None else [],
            [ds_scheduler or scheduler] if scheduler else [],
        )

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the engine accumulates itself (ZeRO has no no_sync)

    def backward(self, loss: torch.Tensor, *, divide_by: int, boundary: bool, **kwargs: Any) -> None:
        engine = self._current_engine()
        # Before the backward: the engine reduces the gradients during it on a boundary.
        engine.set_gradient_accumulation_boundary(boundary)
        if divide_by > 1:
            loss = loss / divide_by
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None, *, boundary: bool
    ) -> tuple[float | None, bool | None]:
        # On every micro-step: the engine steps the optimizer only on the boundary ak.backward set.
        engine = self._current_engine()
        engine.step()
        skipped = getattr(engine, "skipped_steps", 0)  # fp16 overflows
        was_skipped, self._skipped = skipped > self._skipped, skipped
        return None, was_skipped if boundary else None

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        pass  # the engine zeroes the gradients after its step

    def unwrap(self, model: nn.Module) -> nn.Module:
        engine_type = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)
        if engine_type is not None and isinstance(model, engine_type):
            model = model.module
        return super().unwrap(model)

    def _current_engine(self) -> Any:
        engine = self._engine() if self._engine is not None else None
        if engine is None:
            raise StateError(
                'strategy="deepspeed": no DeepSpeed engine is alive; ak.prepare(model, optimizer) first, '
                "then ak.backward(loss) and optimizer.step()"
            )
        return engine


def _import_deepspeed() -> Any:
    try:
        return importlib.import_module("deepspeed")
    except ImportError as exc:
        raise ImportError(
            f'strategy="deepspeed" needs DeepSpeed, which is not installed ({exc}); '
            f'run: pip install "accelkit[deepspeed]", or use strategy="fsdp"'
        ) from exc
