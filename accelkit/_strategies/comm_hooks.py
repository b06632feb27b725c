"""DDP communication hooks: how the gradient all-reduce is compressed (``comm_hook=`` of ``ak.prepare``/``ak.init``).

The named hooks are PyTorch's (``torch.distributed.algorithms.ddp_comm_hooks``), as Accelerate's
``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)`` registers
them: ``fp16`` / ``bf16`` (each rank's gradients cast and divided by the world size, summed in that
dtype), ``power_sgd`` / ``batched_power_sgd`` (low-rank approximations, with ``PowerSGDState``'s
options), optionally wrapped in fp16/bf16 compression; or any user hook with its state.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from .._options import COMM_HOOKS, COMM_WRAPPERS, Options, is_int, suggest
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PREPARE_OPTIONS", "CommHook", "comm_hook", "refuse_comm_hook"]

# ak.prepare's options for the hook; the state's options of the same names are the defaults.
PREPARE_OPTIONS = ("comm_hook", "comm_wrapper", "comm_hook_options", "comm_hook_state")
_POWER_SGD = ("power_sgd", "batched_power_sgd")
_CALL = "accelkit.prepare"
# PowerSGDState's options: (kind, smallest value). Options torch adds later pass through unchecked.
_POWER_SGD_OPTIONS: dict[str, tuple[str, float]] = {
    "matrix_approximation_rank": ("int", 1),
    "start_powerSGD_iter": ("int", 0),
    "min_compression_rate": ("number", 0),
    "use_error_feedback": ("bool", 0),
    "warm_start": ("bool", 0),
    "orthogonalization_epsilon": ("number", 0),
    "random_seed": ("int", 0),
    "compression_stats_logging_frequency": ("int", 1),
    "batch_tensors_with_same_shape": ("bool", 0),
}


class CommHook(NamedTuple):
    """A validated hook to register on each DDP model: a named one (with its options) or the user's (with its state)."""

    hook: str | Callable[..., Any]
    wrapper: str
    options: Mapping[str, Any]
    state: Any = None

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Register the hook on ``ddp``; a PowerSGD hook gets a state of its own (it keeps per-model buffers)."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        group = ddp.process_group
        hook: Callable[..., Any]
        if callable(self.hook):
            hook, state = self.hook, self.state
        elif self.hook in _POWER_SGD:
            hook = powerSGD_hook.powerSGD_hook if self.hook == "power_sgd" else powerSGD_hook.batched_powerSGD_hook
            _refuse_cpu_power_sgd(self.hook, ddp)
            state = powerSGD_hook.PowerSGDState(group, **self.options)
        else:
            hook = default_hooks.fp16_compress_hook if self.hook == "fp16" else default_hooks.bf16_compress_hook
            state = group
        if self.wrapper != "no":
            wrappers = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
            hook = wrappers[self.wrapper](hook)
        if "bf16" in (self.hook, self.wrapper) and dist.get_backend(group) == "gloo":
            hook = _renamed(hook)
        ddp.register_comm_hook(state, hook)


def _refuse_cpu_power_sgd(name: str, ddp: nn.parallel.DistributedDataParallel) -> None:
    """torch's PowerSGD hooks call ``torch.cuda.synchronize(device)`` with the gradients' device whenever
    CUDA is available: CPU gradients on a machine with GPUs (``cpu=True``) fail there, in backward."""
    import torch

    param = next(ddp.module.parameters(), None)
    if param is not None and param.device.type == "cpu" and torch.cuda.is_available():
        raise ConfigurationError(
            f"{_CALL}(comm_hook={name!r}) on the CPU of a machine with GPUs: PyTorch's PowerSGD hook synchronises "
            f"CUDA on the gradients' device and fails on CPU gradients there. Train on the GPUs (drop cpu=True), "
            f"or use comm_hook='fp16' or 'bf16' on the CPU"
        )


def _renamed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` under another name: DDP refuses torch's bf16 hooks by name unless torch was built with
    NCCL >= 2.10 (or XCCL), a check of the build rather than of the group in use; gloo sums bf16."""

    def gloo_bf16_hook(state: Any, bucket: Any) -> Any:
        return hook(state, bucket)

    # DDP checks the hook's signature: show it torch's (these annotations are strings), keep our name.
    functools.update_wrapper(gloo_bf16_hook, hook, assigned=("__doc__",))
    return gloo_bf16_hook


def comm_hook(given: Mapping[str, Any], options: Options) -> CommHook | None:
    """The hook that ``ak.prepare``'s options ask for, validated; None for none.

    A ``comm_hook`` passed to ``ak.prepare`` replaces the configured one (``ak.init``,
    ``ACCELKIT_COMM_HOOK``, the config file) with its own wrapper and options; otherwise
    ``comm_wrapper`` / ``comm_hook_options`` passed there refine the configured hook.
    """
    if given.get("comm_hook") is not None:
        hook, wrapper = given["comm_hook"], given.get("comm_wrapper") or "no"
        hook_options = given.get("comm_hook_options")
    else:
        configured = json.loads(options.comm_hook_options) if options.comm_hook_options else None
        hook = options.comm_hook
        wrapper = given.get("comm_wrapper") or options.comm_wrapper
        hook_options = given["comm_hook_options"] if given.get("comm_hook_options") is not None else configured
    state = given.get("comm_hook_state")
    if not callable(hook) and hook not in COMM_HOOKS:
        raise ConfigurationError(
            f"{_CALL}(comm_hook={hook!r}): expected one of {', '.join(map(repr, COMM_HOOKS))}, or your own hook, a "
            f"callable hook(state, bucket) -> torch.futures.Future (see torch.distributed.algorithms.ddp_comm_hooks)"
            + suggest(hook, COMM_HOOKS)
        )
    if wrapper not in COMM_WRAPPERS:
        raise ConfigurationError(
            f"{_CALL}(comm_wrapper={wrapper!r}): expected one of {', '.join(map(repr, COMM_WRAPPERS))}"
            + suggest(wrapper, COMM_WRAPPERS)
        )
    named = f"comm_hook={hook!r}" if isinstance(hook, str) else "your own comm_hook"
    if hook_options is not None and hook not in _POWER_SGD:
        raise ConfigurationError(
            f"{_CALL}({named}, comm_hook_options={hook_options!r}): the options are PowerSGD's; they go with "
            f"comm_hook='power_sgd' or 'batched_power_sgd'"
            + (" (your own hook's state goes in comm_hook_state=...)" if callable(hook) else "; drop them")
        )
    if state is not None and not callable(hook):
        raise ConfigurationError(
            f"{_CALL}({named}, comm_hook_state=...): the state goes with your own hook (comm_hook=fn); accelkit "
            f"builds the state of the named hooks (for PowerSGD from comm_hook_options)"
        )
    if hook == "no":
        if wrapper != "no":
            raise ConfigurationError(
                f"{_CALL}(comm_wrapper={wrapper!r}) without a comm_hook: the wrapper compresses another hook's "
                f"gradients; add comm_hook='power_sgd', or use comm_hook={wrapper!r} alone for plain {wrapper} "
                f"compression"
            )
        return None
    if hook in ("fp16", "bf16") and wrapper != "no":
        raise ConfigurationError(
            f"{_CALL}({named}, comm_wrapper={wrapper!r}): comm_hook={hook!r} compresses already; a wrapper goes "
            f"around 'power_sgd', 'batched_power_sgd' or your own hook"
        )
    if hook == "batched_power_sgd":
        _refuse_broken_batched_power_sgd()
    checked = _power_sgd_options(hook_options or {}) if hook in _POWER_SGD else {}
    return CommHook(hook, wrapper, checked, state)


def _refuse_broken_batched_power_sgd() -> None:
    import torch

    from .. import _torch_private

    if not _torch_private.batched_power_sgd_runs():
        raise ConfigurationError(
            f"{_CALL}(comm_hook='batched_power_sgd'): PyTorch {torch.__version__}'s batched_powerSGD_hook fails as "
            f"soon as it compresses (it hands one matrix to a helper that now takes a batch of them: an "
            f"AssertionError in backward). Use comm_hook='power_sgd', which compresses each layer's gradient"
        )


def _power_sgd_options(given: Mapping[str, Any]) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if not isinstance(given, Mapping):
        raise ConfigurationError(
            f"{_CALL}(comm_hook_options={given!r}): expected a mapping of PowerSGD options, e.g. "
            f"{{'matrix_approximation_rank': 2, 'start_powerSGD_iter': 10}}"
        )
    known = [n for n in inspect.signature(PowerSGDState).parameters if n not in ("self", "process_group")]
    for name, value in given.items():
        if name not in known:
            hint = suggest(name, known) or f"; PowerSGD's options: {', '.join(known)}"
            raise ConfigurationError(f"{_CALL}(comm_hook_options={dict(given)!r}): unknown option {name!r}{hint}")
        kind, low = _POWER_SGD_OPTIONS.get(name, ("any", 0))
        ok = {
            "int": is_int(value) and value >= low,
            "number": isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low,
            "bool": isinstance(value, bool),
            "any": True,
        }[kind]
        if not ok:
            number = "an integer" if kind == "int" else "a number"
            expected = "True or False" if kind == "bool" else f"{number} >= {low:g}"
            raise ConfigurationError(
                f"{_CALL}(comm_hook_options={{{name!r}: {value!r}}}): expected {expected} for {name}"
            )
    try:
        PowerSGDState(None, **given)  # its own checks, before any process group is needed
    except (TypeError, ValueError) as err:
        raise ConfigurationError(f"{_CALL}(comm_hook_options={dict(given)!r}): {err}") from None
    return dict(given)


def refuse_comm_hook(model_options: Mapping[str, Any], strategy: str) -> None:
    """A strategy that does not reduce gradients through DDP refuses a communication hook, naming the fix."""
    hook = model_options.get("comm_hook")
    if isinstance(hook, CommHook):
        named = f"comm_hook={hook.hook!r}" if isinstance(hook.hook, str) else "comm_hook=<your hook>"
        raise ConfigurationError(
            f"{_CALL}({named}): a DDP communication hook, and strategy={strategy!r} does not reduce gradients "
            f"through DDP. Drop the hook (from ak.prepare, ak.init, ACCELKIT_COMM_HOOK or the config file), or "
            f"use strategy='ddp'"
        )
