"""How ``ak.prepare`` lays a model out before wrapping it: a tensor-parallel plan, activation checkpointing.

- ``tp_plan``: module-name patterns (``*`` matches one name: ``"blocks.*.attn.q"``) to torch's
  ``ParallelStyle``\\ s (or their names as transformers writes them: ``"colwise"``, ``"rowwise"``, ...),
  a callable ``(model, tp_mesh) -> model``, or ``"auto"``: the plan a transformers model carries.
  Checked on every strategy (a mistake shows on one process too); applied on the mesh's ``tp`` dimension.
- ``activation_checkpointing``: module class names whose forward is recomputed in the backward pass
  (``torch.utils.checkpoint``, non-reentrant), in place: the module, its names and its state keep theirs.

torch's tensor-parallel module is imported only when a plan is applied or its style names are resolved.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from torch import nn

from .._options import suggest, validate
from ..errors import ConfigurationError
from ._protocol import LAYOUT_OPTIONS

__all__ = ["Layout", "apply_plan", "check_plan", "checkpoint_modules", "split_layout"]

_CALL = "accelkit.prepare"
# transformers' names of plan entries that torch's styles implement as they are.
_STYLE_NAMES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel")


class Layout(NamedTuple):
    """``ak.prepare``'s layout options for a model."""

    tp_plan: Any = None
    activation_checkpointing: tuple[str, ...] = ()


def split_layout(
    model_options: Mapping[str, Any], default_checkpointing: tuple[str, ...]
) -> tuple[Layout, dict[str, Any]]:
    """The layout options (checked) and the rest (DDP's), from ``ak.prepare``'s model options."""
    rest = {k: v for k, v in model_options.items() if k not in LAYOUT_OPTIONS}
    names = model_options.get("activation_checkpointing")
    if names is not None:
        names = validate({"activation_checkpointing": names}, _CALL)["activation_checkpointing"]
    plan = model_options.get("tp_plan")
    if plan is not None and not (plan == "auto" or callable(plan) or isinstance(plan, Mapping)):
        raise ConfigurationError(
            f"{_CALL}(tp_plan={plan!r}): expected a mapping of module-name patterns to ParallelStyles "
            f"(e.g. {{'blocks.*.mlp.up': ColwiseParallel()}}), a callable (model, tp_mesh) -> model, or 'auto'"
        )
    return Layout(plan, default_checkpointing if names is None else names), rest  # type: ignore[arg-type]


def check_plan(model: nn.Module, plan: Any) -> dict[str, Any] | Callable[..., Any] | None:
    """``plan`` for ``model``: a callable as it is, else ``{module name: ParallelStyle}`` with every
    pattern matched and every style resolved. Raises ConfigurationError naming what does not fit."""
    if plan is None or callable(plan):
        return plan  # type: ignore[no-any-return]
    if plan == "auto":
        plan = _carried_plan(model)
        if not isinstance(plan, Mapping) or not plan:
            raise ConfigurationError(
                f"{_CALL}(tp_plan='auto'): {type(model).__name__} carries no tensor-parallel plan (transformers "
                f"models have one in model.tp_plan); pass the plan: {{'layers.*.mlp.up_proj': 'colwise', ...}}"
            )
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise ConfigurationError(f"{_CALL}(tp_plan=...): {pattern!r} is not a module name pattern")
        matched = [name for name in names if _matches(name, pattern)]
        if not matched:
            hint = suggest(pattern, names)[2:] or f"its modules include {', '.join(names[:8])}"
            raise ConfigurationError(
                f"{_CALL}(tp_plan=...): {pattern!r} names no module of {type(model).__name__}; {hint} "
                f"(a pattern's '*' matches one name between dots)"
            )
        parallel_style = _style(pattern, style)
        resolved.update(dict.fromkeys(matched, parallel_style))
    return resolved


def apply_plan(model: nn.Module, plan: Any, tp_mesh: Any) -> nn.Module:
    """``model`` with ``plan`` (see :func:`check_plan`) applied over ``tp_mesh``; returns the model."""
    from torch.distributed.tensor.parallel import parallelize_module

    checked = check_plan(model, plan)
    if callable(checked):
        out = checked(model, tp_mesh)
        if not isinstance(out, nn.Module):
            raise ConfigurationError(
                f"{_CALL}(tp_plan={getattr(checked, '__name__', checked)!r}): the plan returned "
                f"{type(out).__name__}; a callable plan returns the model it parallelised"
            )
        return out
    if checked:
        parallelize_module(model, tp_mesh, checked)
    return model


def _carried_plan(model: nn.Module) -> Any:
    """The plan a transformers model carries: ``model.tp_plan``, else its config's ``base_model_tp_plan``
    (names relative to the base model, ``model.<base_model_prefix>``)."""
    plan = getattr(model, "tp_plan", None)
    if plan:
        return plan
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    if isinstance(base, Mapping) and prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{name}": style for name, style in base.items()}
    return base


def _matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted, strict=True))


def _style(pattern: str, style: Any) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

    if isinstance(style, ParallelStyle):
        return style
    made: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }
    if isinstance(style, str) and style in made:
        return made[style]()
    raise ConfigurationError(
        f"{_CALL}(tp_plan={{{pattern!r}: {style!r}}}): expected a torch ParallelStyle (ColwiseParallel(), "
        f"RowwiseParallel(), SequenceParallel(), ...) or one of the names {', '.join(map(repr, _STYLE_NAMES))}"
        f"{suggest(style, _STYLE_NAMES)}; other transformers plan entries have no torch style: give the "
        f"ParallelStyle"
    )


# --- activation checkpointing -----------------------------------------------------------------


class _Recompute:
    """A module's forward, run under ``torch.utils.checkpoint`` (non-reentrant): its activations are
    recomputed in the backward pass instead of kept. Set as the module's instance ``forward``."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.module, self.inner = module, inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        run = self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def checkpoint_modules(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """Recompute the forward of every submodule of ``model`` whose class ``__name__`` is in ``names``
    (in place; once, however often prepared); returns those modules."""
    if not names:
        return []
    classes = {type(m).__name__ for m in model.modules()}
    for name in names:
        if name not in classes:
            hint = suggest(name, sorted(classes))[2:]
            raise ConfigurationError(
                f"{_CALL}(activation_checkpointing=...): {type(model).__name__} has no submodule of class {name!r}; "
                f"{hint + ' ' if hint else ''}name classes of this model: {', '.join(sorted(classes))}"
            )
    chosen = [m for m in model.modules() if type(m).__name__ in names]
    for module in chosen:
        inner = module.__dict__.get("forward")
        if not isinstance(inner, _Recompute):
            module.forward = _Recompute(module, inner)
    return chosen
