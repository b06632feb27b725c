"""The options that shape the process state, validated once, shared by every entry point."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, cast, get_args

from . import _env
from .errors import ConfigurationError

Precision = Literal["no", "fp16", "bf16", "fp8"]
DistBackend = Literal["gloo", "nccl", "xccl", "mpi"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
DIST_BACKENDS: tuple[str, ...] = get_args(DistBackend)
DEFAULT_TIMEOUT = 600.0  # seconds a collective may wait before the job fails


@dataclass(frozen=True)
class Options:
    """Options of the process state (precision, accumulation, debug, device, timeouts)."""

    precision: Precision = "no"
    gradient_accumulation_steps: int = 1
    debug: bool = False
    cpu: bool = False
    backend: DistBackend | None = None
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, explicit: Mapping[str, object], call: str = "accelkit.init") -> Options:
        """Explicit options over ``ACCELKIT_*`` variables over defaults, all validated."""
        merged: dict[str, object] = {}
        for name, raw in _env.option_overrides().items():
            merged[name] = _from_env(name, str(raw))
        merged.update({k: v for k, v in explicit.items() if v is not None})
        return replace(cls(), **cast("dict[str, Any]", validate(merged, call)))


def validate(options: Mapping[str, object], call: str) -> dict[str, object]:
    """Checks names and values; returns them normalised. Errors echo the call."""
    out: dict[str, object] = {}
    for name, value in options.items():
        if name not in Options.names():
            raise TypeError(f"{call}() got an unexpected option {name!r}{_suggest(name)}")
        out[name] = _check(name, value, call)
    return out


def _check(name: str, value: object, call: str) -> object:
    def bad(expected: str, fix: str) -> ConfigurationError:
        return ConfigurationError(f"{call}({name}={value!r}): expected {expected}; {fix}")

    if name == "precision":
        if value not in PRECISIONS:
            raise bad(f"one of {', '.join(map(repr, PRECISIONS))}", "bf16 suits most GPUs")
        return value
    if name == "gradient_accumulation_steps":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("an integer >= 1", "use 1 to step the optimizer on every batch")
        return value
    if name in ("debug", "cpu"):
        if not isinstance(value, bool):
            raise bad("True or False", f"pass {name}=True to enable it")
        return value
    if name == "backend":
        if value is not None and value not in DIST_BACKENDS:
            raise bad(f"None or one of {', '.join(map(repr, DIST_BACKENDS))}", "None picks one for the device")
        return value
    if name == "timeout":
        seconds = getattr(value, "total_seconds", lambda: value)()
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise bad("a positive number of seconds (or a timedelta)", f"the default is {DEFAULT_TIMEOUT:g}")
        return float(seconds)
    return value


def _from_env(name: str, raw: str) -> object:
    var = _env.OPTION_VARIABLES[name]
    if name in ("debug", "cpu"):
        return _env.read_bool(var)
    if name == "gradient_accumulation_steps":
        return _env.read_int(var)
    if name == "timeout":
        try:
            return float(raw)
        except ValueError:
            raise ConfigurationError(f"environment variable {var}={raw!r} is not a number of seconds") from None
    value = raw.strip().lower()
    valid = PRECISIONS if name == "precision" else DIST_BACKENDS
    if value not in valid:
        raise ConfigurationError(f"environment variable {var}={raw!r} must be one of {', '.join(valid)}")
    return value


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, Options.names(), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid options: {', '.join(Options.names())}"
