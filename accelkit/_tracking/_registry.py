"""The trackers by name: what each needs installed, and how to start one.

One module per tracker (``_tensorboard``, ``_csv``, ``_jsonl``, ``_wandb``, ``_mlflow``), imported
only when that tracker starts, behind one small protocol. Torch-free, so ``accelkit env`` can list
what is installed without importing any tracker.
"""

import importlib
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from .._options import TRACKERS

__all__ = ["KINDS", "Tracker", "expand", "installed_versions", "is_installed", "require", "start"]


class Tracker(Protocol):
    """A running tracker: one run, written by the main process only."""

    @property
    def writer(self) -> Any:
        """The underlying object (``SummaryWriter``, W&B run, MLflow run, ...), for ``ak.get_tracker``."""

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Record ``values`` at ``step``; what is logged is in the OS's hands (flushed) when it returns."""

    def finish(self, failed: bool) -> None:
        """Flush and close; ``failed`` marks the run failed where the tracker keeps a status."""


class Kind(NamedTuple):
    """How to start one tracker: our module, the package it imports (None: the standard library)."""

    module: str
    package: str | None = None
    distribution: str | None = None

    @property
    def install(self) -> str:
        extra = self.module.lstrip("_")
        return f'pip install "accelkit[{extra}]"'


KINDS: dict[str, Kind] = {
    "tensorboard": Kind("_tensorboard", "tensorboard", "tensorboard"),
    "csv": Kind("_csv"),
    "jsonl": Kind("_jsonl"),
    "wandb": Kind("_wandb", "wandb", "wandb"),
    "mlflow": Kind("_mlflow", "mlflow", "mlflow"),
}
assert tuple(KINDS) == TRACKERS, "one module per tracker name"


def is_installed(name: str) -> bool:
    """Whether tracker ``name`` can start here (nothing is imported to find out)."""
    package = KINDS[name].package
    return package is None or importlib.util.find_spec(package) is not None


def installed_versions() -> dict[str, str | None]:
    """Each tracker's package version (``"built in"`` for the standard library ones), None when missing.

    Example:
        >>> installed_versions()["csv"]
        'built in'
    """
    import importlib.metadata  # a few ms of imports: only for `accelkit env`

    out: dict[str, str | None] = {}
    for name, kind in KINDS.items():
        if kind.package is None:
            out[name] = "built in"
        elif not is_installed(name):
            out[name] = None
        else:
            try:
                out[name] = importlib.metadata.version(kind.distribution or kind.package)
            except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source tree)
                out[name] = "installed"
    return out


def expand(names: Iterable[str]) -> tuple[str, ...]:
    """The trackers to start: ``"all"`` means every installed one, in the table's order.

    Example:
        >>> expand(["csv", "all"])[:2]
        ('csv', 'jsonl')
    """
    chosen = list(names)
    if "all" in chosen:
        chosen = [n for n in chosen if n != "all"] + [n for n in KINDS if is_installed(n)]
    return tuple(dict.fromkeys(chosen))


def require(name: str, call: str) -> None:
    """An ImportError with the install line when tracker ``name`` cannot start here."""
    if not is_installed(name):
        kind = KINDS[name]
        # An error, where Accelerate skips the tracker (saying so at debug level): better a failed start than
        # a run of hours that logs nowhere. "all" takes the installed ones.
        raise ImportError(
            f"{call}: the {name!r} tracker needs the {kind.package!r} package, which is not installed; "
            f"{kind.install}, or choose another tracker (installed: "
            f"{', '.join(n for n in KINDS if is_installed(n))}; log_with='all' starts those)"
        )


def start(name: str, directory: Path, project: str, config: Mapping[str, Any], options: Mapping[str, Any]) -> Tracker:
    """Start tracker ``name`` writing under ``directory``; ``options`` go to its library (``init_kwargs``)."""
    module = importlib.import_module(f".{KINDS[name].module}", __package__)
    tracker: Tracker = module.start(directory, project, config, dict(options))
    return tracker
