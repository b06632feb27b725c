"""Experiment tracking on one process: real writers read back, options from every layer, bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from processes import subprocess_env

import accelkit as ak
from accelkit._cli import main as cli_main

HAS_TENSORBOARD = __import__("importlib").util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason='needs pip install "accelkit[tensorboard]"')


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _hparams(directory: Path) -> dict[str, object]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(directory))
    events.Reload()
    data = HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    out: dict[str, object] = {}
    for name, value in data.session_start_info.hparams.items():
        kind = value.WhichOneof("kind")
        out[name] = getattr(value, kind)
    return out


@needs_tensorboard
def test_tensorboard_events_hold_exactly_the_logged_scalars_and_the_hparams(tmp_path: Path) -> None:
    config = {"lr": 0.003, "batch_size": 32, "optimizer": "adamw", "model": {"layers": 2}, "amp": True}
    with ak.init_trackers("tb", config, log_with="tensorboard", project_dir=tmp_path) as run:
        for step in range(5):
            ak.log({"loss": torch.tensor(1.0 / (step + 1)), "eval": {"acc": step / 4}}, step=step * 10)
        ak.log({"lr": 0.5})  # no step: one more than the last
        assert isinstance(ak.get_tracker("tensorboard"), torch.utils.tensorboard.SummaryWriter)
    assert run.directory == tmp_path / "tb"
    scalars = _scalars(run.directory)
    assert scalars == {
        "loss": [(s * 10, pytest.approx(1.0 / (s + 1))) for s in range(5)],
        "eval/acc": [(s * 10, pytest.approx(s / 4)) for s in range(5)],
        "lr": [(41, 0.5)],
    }
    assert _hparams(run.directory) == {
        "lr": pytest.approx(0.003), "batch_size": 32.0, "optimizer": "adamw", "model/layers": 2.0, "amp": True,
    }  # fmt: skip
    assert [p.name for p in run.directory.iterdir() if p.is_dir()] == []  # the hparams are in the run, no sub-run


def test_csv_and_jsonl_rows_are_exact_and_a_new_name_widens_the_csv(tmp_path: Path) -> None:
    with ak.init_trackers("text", {"lr": 0.1, "tags": ["a"]}, log_with=["csv", "jsonl"], project_dir=tmp_path) as run:
        assert run.names == ("csv", "jsonl")
        ak.log({"loss": 0.5, "n": torch.tensor(3)}, step=0)
        ak.log({"loss": 0.25, "eval": {"acc": torch.tensor(0.75)}}, step=1)
        ak.log({"loss": float("nan")})
        assert ak.get_tracker("csv") == run.directory / "metrics.csv"
    with (run.directory / "metrics.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["run", "step", "loss", "n", "eval/acc"],
        ["1", "0", "0.5", "3", ""],
        ["1", "1", "0.25", "", "0.75"],
        ["1", "2", "nan", "", ""],
    ]
    lines = [json.loads(line) for line in (run.directory / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"run": 1, "step": 0, "loss": 0.5, "n": 3},
        {"run": 1, "step": 1, "loss": 0.25, "eval/acc": 0.75},
        {"run": 1, "step": 2, "loss": "nan"},
    ]
    assert json.loads((run.directory / "config.json").read_text()) == {"lr": 0.1, "tags": ["a"]}


def test_a_step_key_in_the_values_is_the_step_as_accelerate_allows(tmp_path: Path) -> None:
    # run_clm_no_trainer: accelerator.log({"perplexity": p, ..., "step": completed_steps}, step=completed_steps)
    with ak.init_trackers("clm", log_with=["csv", "jsonl"], project_dir=tmp_path) as run:
        ak.log({"perplexity": 3.5, "step": 10}, step=10)
        ak.log({"perplexity": 3.0, "step": torch.tensor(20)})  # no step=: the key is the step
        ak.log({"perplexity": 2.5})  # one more than the last
        with pytest.raises(ValueError, match=r"values\['step'\]=30 but step=31.*drop the key, or pass the same"):
            ak.log({"perplexity": 2.0, "step": 30}, step=31)
    assert (run.directory / "metrics.csv").read_text().splitlines() == [
        "run,step,perplexity",
        "1,10,3.5",
        "1,20,3.0",
        "1,21,2.5",
    ]
    lines = [json.loads(line) for line in (run.directory / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20, 21]


def test_a_second_run_of_the_same_project_continues_the_files_as_the_next_run(tmp_path: Path) -> None:
    for _ in range(2):  # each run's steps start again at 0: the run column keeps them apart
        with ak.init_trackers("again", log_with=["csv", "jsonl"], project_dir=tmp_path):
            ak.log({"loss": 1.0}, step=0)
            ak.log({"loss": 0.5, "acc": 1})
    rows = (tmp_path / "again" / "metrics.csv").read_text().splitlines()
    assert rows == ["run,step,loss,acc", "1,0,1.0,", "1,1,0.5,1", "2,0,1.0,", "2,1,0.5,1"]
    lines = [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["run"], line["step"]) for line in lines] == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_a_file_from_before_the_run_column_is_continued(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.csv").write_text("step,loss\r\n0,1.0\r\n")
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    with ak.init_trackers("old", log_with=["csv", "jsonl"], project_dir=tmp_path):
        ak.log({"loss": 0.5}, step=0)
    assert (tmp_path / "old" / "metrics.csv").read_text().splitlines() == ["run,step,loss", ",0,1.0", "1,0,0.5"]
    assert (tmp_path / "old" / "metrics.jsonl").read_text().splitlines()[1] == '{"run": 1, "step": 0, "loss": 0.5}'


def test_options_come_from_init_environment_and_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_LOG_WITH", "jsonl")
    monkeypatch.setenv("ACCELKIT_PROJECT_DIR", str(tmp_path / "from-env"))
    with ak.init_trackers("p") as run:
        assert run.names == ("jsonl",) and run.directory == tmp_path / "from-env" / "p"
    ak.reset_state()
    ak.init(log_with=["csv"], project_dir=tmp_path / "from-init")
    with ak.init_trackers("p") as run:
        assert run.names == ("csv",) and run.directory == tmp_path / "from-init" / "p"
    with ak.init_trackers("p", log_with="jsonl,csv", project_dir=tmp_path / "call") as run:  # the call wins
        assert run.names == ("jsonl", "csv") and run.directory == tmp_path / "call" / "p"


def test_the_config_file_and_launch_flags_carry_the_options(tmp_path: Path) -> None:
    config = tmp_path / "accelkit.yaml"
    config.write_text("log_with: [tensorboard, csv]\nproject_dir: experiments\n")
    from accelkit._config import load_config

    assert load_config(config).state == {"log_with": ("tensorboard", "csv"), "project_dir": "experiments"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("log_with: [tensorbord]\n")
    with pytest.raises(ValueError, match=r"bad.yaml:1: log_with: .*did you mean 'tensorboard'"):
        load_config(bad)
    script = tmp_path / "noop.py"
    script.write_text("")
    from accelkit._cli._script import read_launch
    from accelkit._cli.launch import add_arguments

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    plan, _ = read_launch(parser.parse_args(["--log-with", "csv,jsonl", "--project-dir", "out", str(script)]))
    assert plan.worker_env()["ACCELKIT_LOG_WITH"] == "csv,jsonl"
    assert plan.worker_env()["ACCELKIT_PROJECT_DIR"] == "out"
    assert cli_main(["launch", "--log-with", "tensorbored", str(script)]) == 2


def test_bad_input_gets_errors_that_name_the_value_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'tensorbord' is not one of them; did you mean 'tensorboard'"):
        ak.init_trackers("p", log_with="tensorbord", project_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"call ak.init_trackers\(project_name, config\) first"):
        ak.log({"loss": 1.0})
    with pytest.raises(TypeError, match="project_name"):
        ak.init_trackers("", log_with="csv", project_dir=tmp_path)
    with pytest.raises(ValueError, match="inside project_dir"):
        ak.init_trackers("../escape", log_with="csv", project_dir=tmp_path)
    with pytest.raises(ValueError, match=r"'wandb' not among the trackers started \(csv\)"):
        ak.init_trackers("p", log_with="csv", project_dir=tmp_path, init_kwargs={"wandb": {}})
    with ak.init_trackers("p", log_with="csv", project_dir=tmp_path):
        with pytest.raises(TypeError, match=r"'eval/name' is a str \('best'\)"):
            ak.log({"eval": {"name": "best"}})
        with pytest.raises(TypeError, match=r"'w' is a tensor of shape \(2,\)"):
            ak.log({"w": torch.ones(2)})
        with pytest.raises(TypeError, match="expected a dict of numbers"):
            ak.log([1.0])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"values\['step'\]=3 but step=4: 'step' is the step of every row"):
            ak.log({"step": 3}, step=4)
        with pytest.raises(TypeError, match=r"values\['step'\]=1.5 is taken as the step"):
            ak.log({"step": 1.5})
        with pytest.raises(ValueError, match="'run' is the run number of every row"):
            ak.log({"run": 2})
        with pytest.raises(TypeError, match=r"step=1.5"):
            ak.log({"loss": 1.0}, step=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"step=-1"):
            ak.log({"loss": 1.0}, step=-1)
        with pytest.raises(ValueError, match=r"'jsonl'.*not running \(running: csv\)"):
            ak.get_tracker("jsonl")
        with pytest.raises(ValueError, match="unknown tracker"):
            ak.get_tracker("comet")
    assert (tmp_path / "p" / "metrics.csv").read_text() == "run,step\n"  # nothing bad was written


def test_a_tracker_that_is_not_installed_names_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    hidden = ("wandb", "mlflow")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    with pytest.raises(ImportError, match=r'pip install "accelkit\[wandb\]".*log_with=.all. starts those'):
        ak.init_trackers("p", log_with=["csv", "wandb"], project_dir=tmp_path)  # Accelerate skips it: an error here
    assert not (tmp_path / "p").exists()  # checked before anything starts
    with ak.init_trackers("all", log_with="all", project_dir=tmp_path) as run:
        assert run.names == (("tensorboard", "csv", "jsonl") if HAS_TENSORBOARD else ("csv", "jsonl"))


def test_no_tracker_chosen_warns_once_and_log_records_nothing(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no tracker chosen"):
        run = ak.init_trackers("quiet", project_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ak.log({"loss": 1.0})
    assert run.names == () and not (tmp_path / "quiet").exists()


def test_the_context_manager_ends_the_run_also_on_an_exception(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), ak.init_trackers("boom", log_with="jsonl", project_dir=tmp_path):
        ak.log({"loss": 1.0}, step=0)
        _ = 1 / 0
    with pytest.raises(RuntimeError, match="no tracker to write to"):
        ak.log({"loss": 1.0})
    assert (tmp_path / "boom" / "metrics.jsonl").read_text() == '{"run": 1, "step": 0, "loss": 1.0}\n'


def test_end_training_and_reset_state_close_the_trackers(tmp_path: Path) -> None:
    ak.init_trackers("end", log_with="csv", project_dir=tmp_path)
    ak.log({"loss": 1.0})
    assert ak.is_initialized()
    ak.end_training()
    assert not ak.is_initialized()
    with pytest.raises(RuntimeError, match="no tracker to write to"):
        ak.log({"loss": 1.0})
    ak.init_trackers("reset", log_with="csv", project_dir=tmp_path)
    ak.reset_state()
    with pytest.raises(RuntimeError, match="no tracker to write to"):
        ak.log({"loss": 1.0})


@needs_tensorboard
def test_interpreter_exit_after_an_uncaught_error_flushes_and_closes(tmp_path: Path) -> None:
    script = (
        "import accelkit as ak\n"
        f"ak.init_trackers('exit', log_with='tensorboard,csv', project_dir={str(tmp_path)!r}, "
        "init_kwargs={'tensorboard': {'flush_secs': 3600, 'max_queue': 1000}})\n"
        "ak.log({'loss': 2.0}, step=7)\n"
        "raise SystemExit('stopped')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert _scalars(tmp_path / "exit") == {"loss": [(7, 2.0)]}
    assert (tmp_path / "exit" / "metrics.csv").read_text().splitlines() == ["run,step,loss", "1,7,2.0"]


def test_importing_accelkit_and_every_public_name_loads_no_tracker_or_tqdm() -> None:
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import accelkit as ak\n"
        "[getattr(ak, n) for n in ak.__all__]\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(eval(done.stdout))
    trackers = ("tensorboard", "wandb", "mlflow", "tqdm", "torch.utils.tensorboard")
    assert [m for m in loaded if m.startswith(trackers)] == [], loaded
    assert "accelkit" in loaded


def test_accelkit_env_lists_the_trackers(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU properties read (CUDA) in this process
    assert cli_main(["env"]) == 0
    out = capsys.readouterr().out
    section = out.split("### Trackers")[1].split("###")[0]
    assert "- csv: built in" in section and "- jsonl: built in" in section
    assert ('- wandb: not installed (pip install "accelkit[wandb]")' in section) == (
        __import__("importlib").util.find_spec("wandb") is None
    )


def test_progress_without_tqdm_loops_plainly_and_says_how_to_get_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tqdm", "tqdm.auto", "tqdm.std"):
        monkeypatch.setitem(sys.modules, name, None)  # `import tqdm` now raises ImportError
    with pytest.warns(UserWarning, match="pip install tqdm"):
        bar = ak.progress(range(3), desc="no bar")
    bar.set_postfix(loss=0.5)
    assert list(bar) == [0, 1, 2]


def test_progress_takes_its_total_from_len(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread left behind
    bar = ak.progress(iter(range(5)), desc="no len", file=sys.stdout, mininterval=0)
    assert sum(bar) == 10 and bar.total is None  # type: ignore[attr-defined]
    bar = ak.progress(range(5), desc="with len", file=sys.stdout, mininterval=0)
    assert sum(bar) == 10 and bar.total == 5  # type: ignore[attr-defined]
    bar.close()
    assert "with len: 100%" in capsys.readouterr().out
