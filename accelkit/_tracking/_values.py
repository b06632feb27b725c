"""What ``ak.log`` accepts, turned into flat ``name -> number`` dicts, and configs into hyper-parameters.

Nested dicts become slash-separated names (``{"eval": {"acc": 0.9}}`` -> ``eval/acc``), as
TensorBoard groups them; anything that is not a number is a ``TypeError`` naming its key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import _safe_io

__all__ = [
    "check_step", "config_dict", "flat_hparams", "json_number", "last_line", "next_run", "scalars",
    "start_file_tracker", "take_step",
]  # fmt: skip

_RESERVED = ("run", "step")  # the run and step columns of the CSV and JSONL files
_STEP = "step"


def scalars(values: object, call: str = "accelkit.log") -> dict[str, float | int]:
    """``values`` flattened to ``name -> int | float``; one-element tensors become Python numbers.

    Example:
        >>> scalars({"loss": torch.tensor(0.5), "eval": {"acc": 1}})
        {'loss': 0.5, 'eval/acc': 1}
    """
    if type(values) is not dict and not isinstance(values, Mapping):
        raise TypeError(
            f"{call}(values={values!r:.80}): expected a dict of numbers, e.g. {call}({{'loss': loss}}, step=step)"
        )
    out: dict[str, float | int] = {}
    _flatten(values, "", out, call)
    return out


def _flatten(values: Mapping[Any, Any], prefix: str, out: dict[str, float | int], call: str) -> None:
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{call}: key {prefix}{key!r} is not a non-empty string; name each value, e.g. 'loss'")
        name = prefix + key
        if name == "step":  # take_step removed the accepted one
            raise ValueError(f"{call}: {name!r} is the step of every row; pass it as {call}(values, step=...)")
        if name in _RESERVED:
            raise ValueError(
                f"{call}: {name!r} is the run number of every row of the CSV and JSONL files (a job's "
                f"ak.init_trackers starts the next run); log it under another name, e.g. 'trial'"
            )
        kind = type(value)
        if kind is float or kind is int:  # the common case first: ABC checks cost a few µs per call
            out[name] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            number = value.item()  # a device sync on a GPU: only the main process gets here
            out[name] = int(number) if isinstance(number, (bool, int)) else float(number)
        elif kind is dict or isinstance(value, Mapping):
            _flatten(value, name + "/", out, call)
        elif isinstance(value, numbers.Integral):  # bool too
            out[name] = int(value)
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
        elif isinstance(value, torch.Tensor):
            raise TypeError(
                f"{call}: {name!r} is a tensor of shape {tuple(value.shape)} ({value.dtype}); log one real "
                f"number per name, e.g. {{{name!r}: tensor.mean()}}"
            )
        else:
            raise TypeError(
                f"{call}: {name!r} is a {type(value).__name__} ({value!r:.60}); log numbers, one-element tensors "
                f"or dicts of them, e.g. {{{name!r}: float(x)}}"
            )


def take_step(values: object, step: object, call: str = "accelkit.log") -> tuple[object, int | None]:
    """``values`` without a top-level ``"step"`` key, and the step of the row (None: the next one).

    The key is accepted as Accelerate accepts it: equal to ``step=``, or as the step when ``step=``
    is not given (an integer, or a one-element integer tensor); a different value is an error.

    Example:
        >>> take_step({"ppl": 3.5, "step": 7}, 7)
        ({'ppl': 3.5}, 7)
    """
    chosen = check_step(step, call)
    if not isinstance(values, Mapping) or _STEP not in values:
        return values, chosen
    given = values[_STEP]
    if isinstance(given, torch.Tensor) and given.numel() == 1 and not (given.is_floating_point() or given.is_complex()):
        given = given.item()  # a device sync on a GPU: only the main process gets here
    if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < 0:
        raise TypeError(
            f"{call}: values[{_STEP!r}]={values[_STEP]!r} is taken as the step of the row, and a step is an "
            f"integer >= 0; pass the step as {call}(values, step=...) and log this value under another name"
        )
    if chosen is not None and given != chosen:
        raise ValueError(
            f"{call}: values[{_STEP!r}]={int(given)} but step={chosen}: 'step' is the step of every row, one "
            f"value per row; drop the key, or pass the same value ({call}({{..., 'step': s}}, step=s))"
        )
    return {k: v for k, v in values.items() if k != _STEP}, int(given)


def check_step(step: object, call: str = "accelkit.log") -> int | None:
    """``step`` as an int (``None`` stays None); an error for anything but a non-negative integer."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{call}(step={step!r}): expected an integer >= 0 (e.g. the optimizer step), or None")
    if step < 0:
        raise ValueError(f"{call}(step={step!r}): expected an integer >= 0; steps count from 0")
    return int(step)


def config_dict(config: object, call: str) -> dict[str, Any]:
    """A config given as a dict, a dataclass or an ``argparse.Namespace``, as a plain dict."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if hasattr(config, "__dict__") and type(config).__name__ == "Namespace":  # argparse's
        return dict(vars(config))
    raise TypeError(
        f"{call}(config={config!r:.80}): expected a dict of hyper-parameters (a dataclass or an argparse "
        f"Namespace also works), e.g. config={{'lr': 3e-3, 'batch_size': 32}}"
    )


def flat_hparams(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """The config flattened for trackers that take flat hyper-parameters (TensorBoard, MLflow).

    Example:
        >>> flat_hparams({"lr": 0.1, "model": {"layers": [2, 3]}, "seed": None})
        {'lr': 0.1, 'model/layers': '[2, 3]', 'seed': 'None'}
    """
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update({f"{key}/{k}": v for k, v in flat_hparams(value).items()})
        elif isinstance(value, (bool, int, float, str)):
            out[str(key)] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[str(key)] = value.item()
        else:
            out[str(key)] = str(value)
    return out


def start_file_tracker(name: str, directory: Path, config: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    """Start a tracker that writes plain files: it takes no options; the config goes to ``config.json``.

    Values JSON cannot hold are written as their ``str``.
    """
    if options:
        raise TypeError(f"the {name} tracker takes no init_kwargs, got {sorted(options)}")
    if config:
        text = json.dumps(config, indent=2, default=str, allow_nan=True) + "\n"
        _safe_io.write_atomic(directory / "config.json", text.encode("utf-8"))


def json_number(value: float | int) -> float | int | str:
    """A number for a JSON line: NaN and infinities as strings (strict JSON has no such numbers)."""
    return value if isinstance(value, int) or math.isfinite(value) else str(value)


def next_run(last: int | None) -> int:
    """The run number a new ``ak.init_trackers`` writes after rows of run ``last`` (None: no row yet).

    A job the elastic agent restarted (``max_restarts``) continues its run: it resumes from a
    checkpoint, and its steps go on. Anything else starts the next run.
    """
    from .. import _state

    if last is not None and _state.get().restart_count > 0:
        return last
    return (last or 0) + 1


def last_line(path: Path) -> str:
    """The last non-empty line of the text file at ``path`` ("" when it has none), read from its end."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        chunk = 4096
        while True:
            start = max(0, size - chunk)
            f.seek(start)
            lines = f.read(size - start).splitlines()
            text = [line for line in (lines if start == 0 else lines[1:]) if line.strip()]
            if text or start == 0:
                return text[-1].decode("utf-8") if text else ""
            chunk *= 4
