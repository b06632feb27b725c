"""``ak.init_trackers``, ``ak.log``, ``ak.get_tracker`` and ``ak.end_training``.

Only the main process writes: it starts one run per tracker under ``project_dir/project_name/``.
The other ranks remember that they do not write, so their ``ak.log`` returns at once: no
collective, no tensor is read (a ``.item()`` there would be a device sync for nothing).
The running trackers' life cycle is in ``_lifecycle``: ``ak.reset_state()`` and ``ak.end_training()``
flush and close them, and so do interpreter exit and a failing worker.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from .. import _env, _state
from .._config import resolve
from .._options import TRACKERS
from . import _registry
from ._lifecycle import TrackingState, current_tracking, end_trackers, start_tracking
from ._values import config_dict, scalars, take_step

__all__ = ["Trackers", "end_training", "get_tracker", "init_trackers", "log"]

_CALL = "accelkit.init_trackers"


class Trackers:
    """What ``ak.init_trackers`` started; as a context manager, ends them on exit (failed on an exception).

    ``names`` are the trackers this process runs (none on other ranks than the main process),
    ``directory`` the run's folder (``project_dir/project_name``).
    """

    def __init__(self, tracking: TrackingState, names: tuple[str, ...]) -> None:
        self._tracking = tracking
        self.names = names
        self.directory = Path(tracking.directory)

    def __repr__(self) -> str:
        return f"Trackers(names={self.names!r}, directory={str(self.directory)!r})"

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if current_tracking() is self._tracking:  # not if they were already ended or replaced
            _raise_if_any(end_trackers(failed=kind is not None), "ending the trackers", exc)


def init_trackers(
    project_name: str,
    config: Mapping[str, Any] | Any | None = None,
    *,
    log_with: str | list[str] | tuple[str, ...] | None = None,
    project_dir: str | os.PathLike[str] | None = None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> Trackers:
    """Start one run per tracker under ``project_dir/project_name/``, on the main process only.

    Call it on every rank (no rank waits for another). ``log_with`` and ``project_dir`` default to
    the options (``ak.init(log_with=...)``, ``ACCELKIT_LOG_WITH``, the config file, ``accelkit launch
    --log-with``). Files of an earlier run with the same project name are continued, not replaced:
    the CSV and JSONL trackers number the runs (a ``run`` column, 1, 2, ...; a job restarted by
    ``max_restarts`` keeps its run).

    Args:
        project_name: the run's folder under ``project_dir`` (and the W&B or MLflow project).
        config: the run's hyper-parameters: a dict, a dataclass or an ``argparse.Namespace``.
        log_with: ``"tensorboard"``, ``"csv"``, ``"jsonl"``, ``"wandb"``, ``"mlflow"``, a list of them,
            or ``"all"`` (the installed ones); ``None``: the ``log_with`` option.
        project_dir: where runs go; ``None``: the ``project_dir`` option, else ``./runs``.
        init_kwargs: keyword arguments for each tracker's library (``{"wandb": {"entity": "me"}}``).

    Example:
        >>> import tempfile, accelkit as ak
        >>> hp, out = {"lr": 0.1}, tempfile.mkdtemp()
        >>> with ak.init_trackers("demo", hp, log_with="csv", project_dir=out) as run:
        ...     ak.log({"loss": 0.5}, step=0)
        >>> (run.directory / "metrics.csv").read_text().splitlines()
        ['run,step,loss', '1,0,0.5']
    """
    directory_name = _check_project(project_name)
    hparams = config_dict(config, _CALL)
    given = {k: v for k, v in {"log_with": log_with, "project_dir": project_dir}.items() if v is not None}
    # Validates them like every option; one that differs from `accelkit launch --log-with` is an error.
    chosen = resolve(given, call=_CALL, config=None).options
    options = _state.get().options
    names = _registry.expand(chosen.log_with if log_with is not None else options.log_with)
    directory = Path(chosen.project_dir if project_dir is not None else options.project_dir) / directory_name
    kwargs = _check_init_kwargs(init_kwargs, names)
    if not _state.get().is_main_process:
        return Trackers(start_tracking(False, {}, str(directory)), ())
    for name in names:
        _registry.require(name, _CALL)
    if not names:
        warnings.warn(
            f"{_CALL}({project_name!r}): no tracker chosen, so ak.log records nothing; choose some with "
            f"log_with=['tensorboard', 'csv'], ak.init(log_with=...), {_env.LOG_WITH}=csv or "
            f"`accelkit launch --log-with csv`",
            stacklevel=2,
        )
    started: dict[str, _registry.Tracker] = {}
    try:
        if names:
            directory.mkdir(parents=True, exist_ok=True)
        for name in names:
            started[name] = _registry.start(name, directory, directory_name, hparams, kwargs.get(name, {}))
    except BaseException as exc:
        for tracker in started.values():
            tracker.finish(True)
        if isinstance(exc, OSError):
            raise OSError(f"{_CALL}: cannot write under {str(directory)!r}: {exc}; choose another project_dir") from exc
        raise
    return Trackers(start_tracking(True, started, str(directory)), names)


def log(values: Mapping[str, Any], step: int | None = None) -> None:
    """Record numbers with every running tracker, on the main process; other ranks return at once.

    Nested dicts are flattened (``{"eval": {"acc": a}}`` is logged as ``eval/acc``). A ``"step"`` key
    in ``values`` (as Accelerate's scripts log it) is the step: equal to ``step=``, or in its place;
    a different value is an error.
    Before ``ak.init_trackers`` (or after ``ak.end_training``) it is an error on the main process.

    Args:
        values: numbers, one-element tensors, and nested dicts of them.
        step: the row's step; ``None``: one more than the last step logged (0 at first).

    Example:
        >>> import tempfile, accelkit as ak
        >>> out = tempfile.mkdtemp()
        >>> with ak.init_trackers("demo", log_with="jsonl", project_dir=out) as run:
        ...     ak.log({"loss": 0.5, "eval": {"acc": 1}})
        >>> (run.directory / "metrics.jsonl").read_text()
        '{"run": 1, "step": 0, "loss": 0.5, "eval/acc": 1}\\n'
    """
    tracking = current_tracking()
    if not tracking.is_main:
        if tracking.started or not _is_main_without_trackers():
            return
        raise RuntimeError(
            "accelkit.log() has no tracker to write to: call ak.init_trackers(project_name, config) first "
            "(after ak.end_training(), or after a `with ak.init_trackers(...):` block, the trackers are closed)"
        )
    rest, chosen = take_step(values, step)
    numbers = scalars(rest)
    at = tracking.step + 1 if chosen is None else chosen
    for tracker in tracking.trackers.values():
        tracker.log(numbers, at)
    tracking.step = at


def get_tracker(name: str) -> Any:
    """The running tracker's own object: TensorBoard's ``SummaryWriter``, the W&B run, the MLflow
    ``ActiveRun``, the CSV or JSONL file's path. ``None`` on other ranks than the main process.

    Args:
        name: one of the running trackers: ``"tensorboard"``, ``"csv"``, ``"jsonl"``, ``"wandb"``,
            ``"mlflow"``.

    Example:
        >>> import tempfile, accelkit as ak
        >>> out = tempfile.mkdtemp()
        >>> with ak.init_trackers("demo", log_with="csv", project_dir=out):
        ...     ak.get_tracker("csv").name
        'metrics.csv'
    """
    if name not in TRACKERS:
        raise ValueError(f"accelkit.get_tracker({name!r}): unknown tracker; valid names: {', '.join(TRACKERS)}")
    tracking = current_tracking()
    if tracking.started and not tracking.is_main:
        return None
    if name not in tracking.trackers:
        running = ", ".join(tracking.trackers) or "none"
        raise ValueError(
            f"accelkit.get_tracker({name!r}): that tracker is not running (running: {running}); start it with "
            f"ak.init_trackers(project_name, log_with=[..., {name!r}])"
        )
    return tracking.trackers[name].writer


def end_training() -> None:
    """Flush and close every tracker, then tear the process group down (``ak.reset_state()``).

    Call it on every rank at the end of training. Trackers are also closed at interpreter exit
    and when a worker fails, so a crash leaves the files readable. A checkpoint still being
    written (``ak.save_state(..., blocking=False)``) is waited for first, and its failure raised.

    Example:
        >>> import accelkit as ak
        >>> ak.end_training()
    """
    st = _state.peek()
    if st is not None and st.distributed:
        from .._collectives import settle

        settle(st)  # the last collective's check, where an accelerator left it on its way
    if st is not None and st.is_main_process and _state.training.schedulers:
        from .._training import check_schedules

        check_schedules()  # a schedule sized Accelerate's way (num_processes times too long)
    saving: Exception | None = None
    if _state.training.saving is not None:
        from .._checkpoint import finish_saving

        try:
            finish_saving("accelkit.end_training()")
        except Exception as exc:  # raised once the rest is torn down
            saving = exc
    errors = end_trackers(failed=False)
    _state.reset_state()
    if saving is not None:
        raise saving
    _raise_if_any(errors, "accelkit.end_training()", None)


def _is_main_without_trackers() -> bool:
    # Without creating the state (and so a process group) for a call that has nothing to do.
    st = _state.peek()
    return (st.rank if st is not None else _env.detect_launch().rank) == 0


def _check_project(project_name: object) -> str:
    if not isinstance(project_name, str) or not project_name.strip():
        raise TypeError(f"{_CALL}(project_name={project_name!r}): expected a non-empty name, e.g. 'digits'")
    parts = Path(project_name).parts
    if Path(project_name).is_absolute() or ".." in parts:
        raise ValueError(
            f"{_CALL}(project_name={project_name!r}): expected a name inside project_dir; "
            f"give the folder as project_dir=... and a plain name, e.g. 'digits'"
        )
    return project_name.strip()


def _check_init_kwargs(init_kwargs: object, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    if init_kwargs is None:
        return {}
    if not isinstance(init_kwargs, Mapping) or not all(isinstance(v, Mapping) for v in init_kwargs.values()):
        raise TypeError(
            f"{_CALL}(init_kwargs={init_kwargs!r:.80}): expected a dict of dicts by tracker name, "
            f"e.g. init_kwargs={{'wandb': {{'entity': 'my-team'}}}}"
        )
    unused = sorted(set(init_kwargs) - set(names))
    if unused:
        raise ValueError(
            f"{_CALL}(init_kwargs=...): {', '.join(map(repr, unused))} not among the trackers started "
            f"({', '.join(names) or 'none'}); add it to log_with, or drop those init_kwargs"
        )
    return {name: dict(value) for name, value in init_kwargs.items()}


def _raise_if_any(errors: list[tuple[str, BaseException]], what: str, during: BaseException | None) -> None:
    if not errors:
        return
    detail = "; ".join(f"{name}: {type(exc).__name__}: {exc}" for name, exc in errors)
    if during is not None:  # the body's exception says more; keep this one beside it
        warnings.warn(f"{what}: could not close every tracker ({detail})", RuntimeWarning, stacklevel=3)
        return
    raise RuntimeError(f"{what}: could not close every tracker ({detail}); the others were closed") from errors[0][1]
