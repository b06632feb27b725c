"""W&B (offline) and MLflow (local stores): what ak.log wrote, read back from their own files.

Both are optional extras (``accelkit[wandb]``, ``accelkit[mlflow]``) that CI does not install:
these tests skip without them. Each run happens in a fresh interpreter, so that W&B's service
process and MLflow's global state end with it.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import subprocess_env

ROOT = Path(__file__).parent.parent
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason='needs pip install "accelkit[wandb]"'
)
needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason='needs pip install "accelkit[mlflow]"'
)

SCRIPT = """
import sys, torch, accelkit as ak
ak.init_trackers("proj", {{"lr": 0.1, "model": {{"layers": 2}}}}, log_with={log_with!r}, project_dir={dir!r},
                 init_kwargs={init_kwargs!r})
for step in range(3):
    ak.log({{"loss": torch.tensor(1.0 / (step + 1)), "eval": {{"acc": step / 2}}}}, step=step)
if "fail" in sys.argv:
    raise RuntimeError("the job fails")
ak.end_training()
"""


def _run(tmp_path: Path, log_with: str, *args: str, init_kwargs: dict[str, object] | None = None, **env: str) -> str:
    code = SCRIPT.format(log_with=log_with, dir=str(tmp_path), init_kwargs=init_kwargs)
    environ = {k: v for k, v in subprocess_env().items() if not k.startswith("MLFLOW_")}
    environ.update(WANDB_MODE="offline", WANDB_SILENT="true", **env)
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=environ, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == (1 if "fail" in args else 0), done.stderr
    return done.stderr


def _wandb_records(path: str) -> Iterator[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB's log format in 32 KiB blocks."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, block = 7, b"", 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if room < 7 or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            yield chunk
        elif kind == 2:  # first, middle, last pieces
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk


def _wandb_run(tmp_path: Path) -> tuple[list[dict[str, object]], dict[str, object], int | None]:
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(tmp_path / "proj" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, exit_code = [], {}, None
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_") or k == "_step"})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return history, config, exit_code


@needs_wandb
def test_wandb_offline_run_holds_the_logged_metrics_and_the_config(tmp_path: Path) -> None:
    _run(tmp_path, "wandb")
    history, config, exit_code = _wandb_run(tmp_path)
    assert history == [
        {"_step": 0, "loss": 1.0, "eval/acc": 0.0},
        {"_step": 1, "loss": 0.5, "eval/acc": 0.5},
        {"_step": 2, "loss": pytest.approx(1 / 3), "eval/acc": 1.0},
    ]
    assert config["lr"] == 0.1 and config["model"] == {"layers": 2}
    assert exit_code == 0


@needs_wandb
def test_a_failing_job_marks_the_wandb_run_failed_and_keeps_its_metrics(tmp_path: Path) -> None:
    _run(tmp_path, "wandb", "fail")
    history, _, exit_code = _wandb_run(tmp_path)
    assert [row["_step"] for row in history] == [0, 1, 2]
    assert exit_code == 1


def _mlflow_run(uri: str) -> tuple[str, dict[str, str], dict[str, list[tuple[int, float]]]]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in ("loss", "eval/acc")
    }
    return run.info.status, run.data.params, metrics


@needs_mlflow
@pytest.mark.parametrize("store", ["default", "file"])
def test_mlflow_run_holds_the_logged_metrics_and_the_params(tmp_path: Path, store: str) -> None:
    if store == "file":
        uri = (tmp_path / "mlruns").as_uri()
        _run(tmp_path, "mlflow", init_kwargs={"mlflow": {"tracking_uri": uri}}, MLFLOW_ALLOW_FILE_STORE="true")
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # to read it back here; the hygiene fixture restores it
    else:
        _run(tmp_path, "mlflow")
        uri = f"sqlite:///{tmp_path / 'proj' / 'mlflow.db'}"
    status, params, metrics = _mlflow_run(uri)
    try:
        assert status == "FINISHED"
        assert params == {"lr": "0.1", "model/layers": "2"}
        assert metrics == {
            "loss": [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))],
            "eval/acc": [(0, 0.0), (1, 0.5), (2, 1.0)],
        }
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


@needs_mlflow
def test_a_failing_job_marks_the_mlflow_run_failed(tmp_path: Path) -> None:
    _run(tmp_path, "mlflow", "fail")
    status, _, metrics = _mlflow_run(f"sqlite:///{tmp_path / 'proj' / 'mlflow.db'}")
    assert status == "FAILED" and len(metrics["loss"]) == 3
