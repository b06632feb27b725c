"""The options that shape the process state, validated once, shared by every entry point."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, cast, get_args

from . import _env
from .errors import ConfigurationError

Precision = Literal["no", "fp16", "bf16", "fp8"]
DistBackend = Literal["gloo", "nccl", "xccl", "mpi"]
Strategy = Literal["ddp", "fsdp", "deepspeed"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
DIST_BACKENDS: tuple[str, ...] = get_args(DistBackend)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
DEFAULT_TIMEOUT = 600.0  # seconds a collective may wait before the job fails
DEFAULT_RDZV_TIMEOUT = 300.0  # seconds the nodes of a job wait for each other


@dataclass(frozen=True)
class Options:
    """Options of the process state (precision, accumulation, debug, device, timeouts)."""

    precision: Precision = "no"
    gradient_accumulation_steps: int = 1
    debug: bool = False
    cpu: bool = False
    backend: DistBackend | None = None
    timeout: float = DEFAULT_TIMEOUT
    # Sharding: how ak.prepare wraps a model when the world has several processes.
    strategy: Strategy = "ddp"
    fsdp_wrap: tuple[str, ...] = ()  # module class names that become their own FSDP unit
    fsdp_min_params: int = 0  # or: submodules with at least this many parameters (0: off)
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    deepspeed_config: str | None = None  # a JSON file path, or JSON text

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, explicit: Mapping[str, object], call: str = "accelkit.init") -> Options:
        """Explicit options over ``ACCELKIT_*`` variables over the config file over defaults.

        An option given in code that ``accelkit launch`` also received as a flag (listed in
        ``ACCELKIT_LAUNCH_FLAGS``) must agree with it: a conflict is an error naming both.
        """

        from .config import _file as _config

        from_config = _config.state_options()  # validated when the file was read
        from_env = validate({n: _from_env(n, str(raw)) for n, raw in _env.option_overrides().items()}, call)
        given = validate({k: v for k, v in explicit.items() if v is not None}, call)
        _check_flag_conflicts(given, from_env, call)
        return replace(cls(), **cast("dict[str, Any]", {**from_config, **from_env, **given}))


def validate(options: Mapping[str, object], call: str) -> dict[str, object]:
    """Checks names and values; returns them normalised. Errors echo the call."""
    out: dict[str, object] = {}
    for name, value in options.items():
        if name not in Options.names():
            raise TypeError(f"{call}() got an unexpected option {name!r}{_suggest(name)}")
        out[name] = _check(name, value, call)
    return out


def _check_flag_conflicts(given: Mapping[str, object], from_env: Mapping[str, object], call: str) -> None:
    for name in _env.launch_flags():
        if name in given and name in from_env and given[name] != from_env[name]:
            flag = "--" + name.replace("_", "-")
            raise ConfigurationError(
                f"{name} is set twice with different values: {given[name]!r} in code ({call}({name}=...) "
                f"at {_code_site()}) and {from_env[name]!r} by `accelkit launch {flag}`. "
                f"Remove one of them (the command line is the usual place for per-run settings)."
            )


def _code_site() -> str:
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


_FLAGS = ("debug", "cpu", "fsdp_reshard_after_forward", "fsdp_cpu_offload")
# name -> (smallest value, how to fix a bad one)
_INTEGERS = {
    "gradient_accumulation_steps": (1, "use 1 to step the optimizer on every batch"),
    "fsdp_min_params": (0, "e.g. 1_000_000; 0 turns size-based wrapping off"),
}
# name -> (valid values, a hint); backend may also be None
_CHOICES = {
    "precision": (PRECISIONS, "bf16 suits most GPUs"),
    "backend": (DIST_BACKENDS, "None picks one for the device"),
    "strategy": (STRATEGIES, "'fsdp' shards parameters, gradients and optimizer state"),
}


def _check(name: str, value: object, call: str) -> object:
    def bad(expected: str, fix: str) -> ConfigurationError:
        return ConfigurationError(f"{call}({name}={value!r}): expected {expected}; {fix}")

    if name in _CHOICES:
        valid, hint = _CHOICES[name]
        if value not in valid and not (name == "backend" and value is None):
            raise bad(f"{'None or ' if name == 'backend' else ''}one of {', '.join(map(repr, valid))}", hint)
        return value
    if name in _INTEGERS:
        low, fix = _INTEGERS[name]
        if name == "fsdp_min_params" and isinstance(value, float) and value.is_integer():
            value = int(value)  # 1e6 is a fine parameter count
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise bad(f"an integer >= {low}", fix)
        return value
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise bad("True or False", f"pass {name}=True to enable it")
        return value
    if name == "fsdp_wrap":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise bad("module classes or class names", "e.g. fsdp_wrap=[TransformerBlock]")
        names = []
        for item in items:
            n = item.__name__ if isinstance(item, type) else item
            if not isinstance(n, str) or not n.strip().isidentifier():
                raise bad("module classes or class names", "e.g. fsdp_wrap=[TransformerBlock]")
            names.append(n.strip())
        return tuple(names)
    if name == "deepspeed_config":
        if isinstance(value, Mapping):
            import json

            return json.dumps(value, sort_keys=True)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise bad("a path to a DeepSpeed JSON config, or a dict", "e.g. deepspeed_config='ds_config.json'")
        return None if value is None else os.fspath(value)
    if name == "timeout":
        seconds = getattr(value, "total_seconds", lambda: value)()
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise bad("a positive number of seconds (or a timedelta)", f"the default is {DEFAULT_TIMEOUT:g}")
        return float(seconds)
    return value


def _from_env(name: str, raw: str) -> object:
    var = _env.OPTION_VARIABLES[name]
    if name in _FLAGS:
        return _env.read_bool(var)
    if name in _INTEGERS:
        return _env.read_int(var)
    if name in ("fsdp_wrap", "deepspeed_config"):
        return raw
    if name == "timeout":
        try:
            return float(raw)
        except ValueError:
            raise ConfigurationError(f"environment variable {var}={raw!r} is not a number of seconds") from None
    value = raw.strip().lower()
    valid = _CHOICES[name][0]
    if value not in valid:
        raise ConfigurationError(f"environment variable {var}={raw!r} must be one of {', '.join(valid)}")
    return value


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, Options.names(), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid options: {', '.join(Options.names())}"
