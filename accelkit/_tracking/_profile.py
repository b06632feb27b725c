"""``ak.profile``: ``torch.profiler`` on every rank, one trace per rank, the op table on the main process."""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _state
from .._options import is_int, suggest
from .._process import wait_for_everyone

if TYPE_CHECKING:
    import torch.profiler

__all__ = ["profile", "trace_path"]

_CALL = "accelkit.profile"
_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")
_SORT_KEYS = ("self_cpu_time_total", "cpu_time_total", "self_device_time_total", "device_time_total",
              "self_cpu_memory_usage", "cpu_memory_usage", "self_device_memory_usage", "device_memory_usage",
              "count", "flops")  # fmt: skip


def trace_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank``'s Chrome trace goes: ``rank<N>.pt.trace.json`` (TensorBoard's profiler plugin finds it)."""
    return Path(directory) / f"rank{rank}.pt.trace.json"


@contextlib.contextmanager
def profile(
    *,
    activities: Sequence[str | Any] | None = None,
    schedule_option: Mapping[str, int] | None = None,
    on_trace_ready: Callable[[Any], None] | None = None,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    with_flops: bool = False,
    with_modules: bool = False,
    output_trace_dir: str | os.PathLike[str] | None = None,
    row_limit: int = 0,
    sort_by: str | None = None,
) -> Iterator[torch.profiler.profile]:
    """Profile the body with ``torch.profiler`` on every rank (Accelerate's ``accelerator.profile()``).

    The knobs are Accelerate's ``ProfileKwargs``. Each rank writes its Chrome trace to
    ``output_trace_dir/rank<N>.pt.trace.json`` (``chrome://tracing``, Perfetto, or TensorBoard's
    profiler plugin read it): of the whole block, or with a schedule of the last whole recorded
    window (the window the block's end cuts short counts only when no other was recorded). On
    leaving the block the main process prints nothing unless asked (``row_limit``), as
    Accelerate's does; the ranks then wait for each other, so that every trace exists afterwards.
    When the body raises the trace is still written, with no table and no wait. A schedule whose
    active window never came warns and writes nothing. A later profile overwrites the traces.

    Args:
        activities: ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mtia"``, ``"hpu"`` (or torch's
            ``ProfilerActivity``); ``None``: the CPU and the device.
        schedule_option: ``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first`` steps of
            ``torch.profiler.schedule``; call ``prof.step()`` once per training step.
        on_trace_ready: called with the profiler for every window, as by torch.
        record_shapes: record the operators' input shapes.
        profile_memory: record the tensors' memory.
        with_stack: record the Python stack of each operator.
        with_flops: estimate the FLOPs of matrix products and convolutions.
        with_modules: record the module hierarchy.
        output_trace_dir: where the traces go; ``None``: ``<project_dir>/profile/``.
        row_limit: the main process prints the window's N most expensive operators (0: nothing).
        sort_by: their order; ``None``: self device time when a device was profiled, else self CPU time.

    Example:
        >>> import accelkit as ak, tempfile, torch
        >>> with ak.profile(output_trace_dir=tempfile.mkdtemp()) as prof:
        ...     _ = torch.ones(8, 8) @ torch.ones(8, 8)
        >>> len(prof.key_averages()) > 0
        True
    """
    import torch.profiler

    chosen = _activities(activities)
    schedule = _schedule(schedule_option)
    for name, value in {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack,
                        "with_flops": with_flops, "with_modules": with_modules}.items():  # fmt: skip
        if not isinstance(value, bool):
            raise TypeError(f"{_CALL}({name}={value!r}): expected True or False")
    if on_trace_ready is not None and not callable(on_trace_ready):
        raise TypeError(
            f"{_CALL}(on_trace_ready={on_trace_ready!r}): expected a function of the profiler, e.g. "
            f"torch.profiler.tensorboard_trace_handler('runs/profile')"
        )
    if not is_int(row_limit) or row_limit < 0:
        raise ValueError(f"{_CALL}(row_limit={row_limit!r}): expected an integer >= 0 (0, the default: print no table)")
    if sort_by is not None and sort_by not in _SORT_KEYS:  # checked now: the table is made after the run
        raise ValueError(
            f"{_CALL}(sort_by={sort_by!r}): expected one of {', '.join(map(repr, _SORT_KEYS))}"
            + suggest(sort_by, _SORT_KEYS)
        )
    st = _state.get()
    directory = Path(output_trace_dir) if output_trace_dir is not None else Path(st.options.project_dir) / "profile"
    tables: list[str] = []  # the op table of the last recorded window (main process)
    windows: list[int] = []  # the step at which each recorded window ended
    ending: list[bool] = []  # set once the body is over: the profiler's stop() may then save a window

    def ready(done: torch.profiler.profile) -> None:
        if on_trace_ready is not None:
            on_trace_ready(done)
        if ending and schedule is not None and windows:
            return  # a window cut short by the end of the block: keep the last whole one
        directory.mkdir(parents=True, exist_ok=True)
        done.export_chrome_trace(str(trace_path(directory, st.rank)))
        if st.is_main_process and row_limit:
            device = any(a != torch.profiler.ProfilerActivity.CPU for a in done.activities)
            key = sort_by or ("self_device_time_total" if device else "self_cpu_time_total")
            tables[:] = [done.key_averages().table(sort_by=key, row_limit=row_limit)]
        windows.append(done.step_num)

    prof = torch.profiler.profile(
        activities=chosen,
        schedule=schedule,
        on_trace_ready=ready,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
        with_flops=with_flops,
        with_modules=with_modules,
    )
    with prof:
        try:
            yield prof
        finally:
            ending.append(True)
    if not windows:  # a schedule whose active window never came: warn, keep the run's result
        warnings.warn(
            f"{_CALL}(schedule_option={dict(schedule_option or {})!r}) recorded nothing, so no trace was written: "
            f"prof.step() was called {prof.step_num} times, fewer than the schedule skips, waits and warms up. "
            f"Call prof.step() once per training step, or shorten wait/warmup/skip_first",
            UserWarning,
            stacklevel=3,
        )
    for table in tables:
        print(table)
    wait_for_everyone()


def _activities(given: Sequence[str | Any] | None) -> list[Any] | None:
    from torch.profiler import ProfilerActivity

    if given is None:
        return None
    if isinstance(given, str) or not isinstance(given, Sequence):
        raise TypeError(f"{_CALL}(activities={given!r}): expected a list, e.g. activities=['cpu', 'cuda']")
    out = []
    for item in given:
        if isinstance(item, ProfilerActivity):
            out.append(item)
            continue
        member = getattr(ProfilerActivity, item.upper(), None) if isinstance(item, str) else None
        if item not in _ACTIVITIES or member is None:
            raise ValueError(
                f"{_CALL}(activities={list(given)!r}): unknown activity {item!r}; expected some of "
                f"{', '.join(map(repr, _ACTIVITIES))}{suggest(item, _ACTIVITIES)}"
            )
        out.append(member)
    return out


def _schedule(option: Mapping[str, int] | None) -> Callable[[int], Any] | None:
    import torch.profiler

    if option is None:
        return None
    known = list(inspect.signature(torch.profiler.schedule).parameters)
    example = "e.g. schedule_option={'wait': 1, 'warmup': 1, 'active': 3}"
    if not isinstance(option, Mapping):
        raise TypeError(f"{_CALL}(schedule_option={option!r}): expected a mapping of step counts, {example}")
    for name, value in option.items():
        if name not in known:
            hint = suggest(name, known) or f"; expected some of {', '.join(known)}"
            raise ValueError(f"{_CALL}(schedule_option={dict(option)!r}): unknown key {name!r}{hint}")
        low = 1 if name == "active" else 0
        if not is_int(value) or value < low:
            raise ValueError(
                f"{_CALL}(schedule_option={dict(option)!r}): {name} must be an integer >= {low}, got {value!r}"
            )
    if "active" not in option:
        raise ValueError(f"{_CALL}(schedule_option={dict(option)!r}): needs 'active' (steps recorded), {example}")
    return torch.profiler.schedule(**{"wait": 0, "warmup": 0, **option})
