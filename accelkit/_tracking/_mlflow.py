"""The ``"mlflow"`` tracker: an MLflow run (``pip install "accelkit[mlflow]"``).

Without ``MLFLOW_TRACKING_URI`` (or ``init_kwargs={"mlflow": {"tracking_uri": ...}}``) the run
goes to MLflow's default store, an SQLite file, in the run's directory (``mlflow ui
--backend-store-uri sqlite:///runs/<project>/mlflow.db`` shows it); a file store works too
(``tracking_uri="file:///..."``, with ``MLFLOW_ALLOW_FILE_STORE=true`` on MLflow 3). The experiment
is named after the project; the config becomes the run's params. Other ``init_kwargs`` go to ``mlflow.start_run``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._values import flat_hparams

__all__ = ["MlflowTracker", "start"]

_PARAMS_PER_CALL = 100  # MLflow's limit on params in one batch
_PARAM_LENGTH = 500  # the shortest value limit among MLflow's versions


class MlflowTracker:
    """One MLflow run; ``ak.get_tracker("mlflow")`` returns it (an ``mlflow.ActiveRun``)."""

    def __init__(self, run: Any, client: Any) -> None:
        self.writer = run
        self._client = client
        self._run_id: str = run.info.run_id

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric  # type: ignore[import-not-found,unused-ignore]

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, step) for name, value in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def finish(self, failed: bool) -> None:
        import mlflow  # type: ignore[import-not-found,unused-ignore]

        status = "FAILED" if failed else "FINISHED"
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self._run_id:
            mlflow.end_run(status=status)
        else:  # the user ended or replaced it: mark ours all the same
            self._client.set_terminated(self._run_id, status=status)


def start(directory: Path, project: str, config: Mapping[str, Any], options: dict[str, Any]) -> MlflowTracker:
    """A run in the experiment ``project``; ``options`` go to ``mlflow.start_run``."""
    import mlflow  # type: ignore[import-not-found,unused-ignore]
    from mlflow.entities import Param  # type: ignore[import-not-found,unused-ignore]

    uri = options.pop("tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
    # MLflow's own default store (an SQLite file; its file store is refused since 3.x), in the run's folder.
    mlflow.set_tracking_uri(uri or f"sqlite:///{(directory / 'mlflow.db').resolve()}")
    mlflow.set_experiment(options.pop("experiment_name", project))
    run = mlflow.start_run(**options)
    client = mlflow.MlflowClient()
    params = [Param(k, str(v)[:_PARAM_LENGTH]) for k, v in flat_hparams(config).items()]
    for i in range(0, len(params), _PARAMS_PER_CALL):
        client.log_batch(run.info.run_id, params=params[i : i + _PARAMS_PER_CALL])
    return MlflowTracker(run, client)
