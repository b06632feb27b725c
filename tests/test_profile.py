"""ak.profile: a torch.profiler trace per rank under the project directory, the op table on the main process."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import accelkit as ak
from accelkit.testing import WorkerPool


def step(model: torch.nn.Module) -> None:
    ak.backward(model(torch.ones(4, 8)).sum())


def profiled(directory: str, schedule: dict[str, int] | None) -> tuple[str, list[str]]:
    """Profile a few DDP steps; what this rank printed and the trace files it sees afterwards."""
    model = ak.prepare(torch.nn.Linear(8, 8))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        with ak.profile(output_trace_dir=directory, schedule_option=schedule, record_shapes=True, row_limit=10) as prof:
            for _ in range(6):
                step(model)
                prof.step()
    return out.getvalue(), sorted(p.name for p in Path(directory).iterdir())


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", [None, {"wait": 1, "warmup": 1, "active": 2}])
def test_each_rank_writes_a_chrome_trace_and_the_main_process_prints_the_table(
    pool: WorkerPool, tmp_path: Path, schedule: dict[str, int] | None
) -> None:
    (printed0, seen0), (printed1, seen1) = pool.run(profiled, str(tmp_path), schedule)
    assert seen0 == seen1 == ["rank0.pt.trace.json", "rank1.pt.trace.json"]  # both exist when the block ends
    assert "aten::addmm" in printed0 and "Self CPU time total" in printed0
    assert "Self CPU time total" not in printed1
    for rank in (0, 1):
        events = json.loads((tmp_path / f"rank{rank}.pt.trace.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "aten::addmm" in names
        steps = sorted(n for n in names if isinstance(n, str) and n.startswith("ProfilerStep#"))
        # With the schedule: step 0 waits, 1 warms up, 2 and 3 are recorded; 4 waits and 5 warms up
        # again, and the block ends in that unrecorded window: the trace is still the one of 2 and 3.
        assert steps == (["ProfilerStep#2", "ProfilerStep#3"] if schedule else [])


def test_the_traces_go_under_the_project_directory_by_default(tmp_path: Path) -> None:
    ak.init(project_dir=str(tmp_path))
    with ak.profile(activities=["cpu"]) as prof:
        torch.ones(4, 4).sum()
    assert isinstance(prof, torch.profiler.profile)
    trace = tmp_path / "profile" / "rank0.pt.trace.json"
    assert "traceEvents" in json.loads(trace.read_text())


def test_a_schedule_that_never_records_warns_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"recorded nothing, so no trace was written: prof.step\(\) was called 1 "):
        with ak.profile(output_trace_dir=tmp_path, schedule_option={"wait": 3, "warmup": 1, "active": 1}) as prof:
            prof.step()
    assert list(tmp_path.iterdir()) == []


def test_nothing_is_printed_unless_a_table_is_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As Accelerate's profile: a literal port of its example, which prints the table itself, shows it once."""
    with ak.profile(output_trace_dir=tmp_path, activities=["cpu"]) as prof:
        torch.ones(4, 4).sum()
    assert capsys.readouterr().out == ""
    assert "Self CPU time total" in prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=5)


def test_the_body_raising_still_writes_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KeyError), ak.profile(output_trace_dir=tmp_path, activities=["cpu"]):  # no CUDA here
        torch.ones(4, 4).sum()
        raise KeyError("stop")
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.pt.trace.json"]
    assert "Self CPU time total" not in capsys.readouterr().out


def test_your_handler_sees_every_window(tmp_path: Path) -> None:
    seen: list[int] = []
    schedule = {"wait": 1, "warmup": 1, "active": 2}  # 6 steps: windows end after steps 3 and (cut short) 6
    with ak.profile(
        output_trace_dir=tmp_path,
        schedule_option=schedule,
        on_trace_ready=lambda p: seen.append(p.step_num),
        activities=["cpu"],  # CUDA's profiler would initialise CUDA in the test process
    ) as prof:
        for _ in range(6):
            torch.ones(4, 4).sum()
            prof.step()
    assert seen == [4, 6]


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"activities": ["gpu"]}, ValueError, "unknown activity 'gpu'; expected some of 'cpu', 'cuda'"),
        ({"activities": "cpu"}, TypeError, "activities='cpu'): expected a list"),
        ({"schedule_option": {"wait": 1}}, ValueError, "needs 'active' (steps recorded)"),
        ({"schedule_option": {"activ": 2}}, ValueError, "unknown key 'activ'; did you mean 'active'?"),
        ({"schedule_option": {"active": 0}}, ValueError, "active must be an integer >= 1, got 0"),
        ({"schedule_option": {"active": 2, "repeat": -1}}, ValueError, "repeat must be an integer >= 0, got -1"),
        ({"schedule_option": [("active", 1)]}, TypeError, "expected a mapping of step counts"),
        ({"record_shapes": "yes"}, TypeError, "profile(record_shapes='yes'): expected True or False"),
        ({"row_limit": -1}, ValueError, "row_limit=-1): expected an integer >= 0"),
        ({"sort_by": "self_cuda_time"}, ValueError, "sort_by='self_cuda_time'): expected one of 'self_cpu_time_total'"),
        ({"on_trace_ready": "trace.json"}, TypeError, "on_trace_ready='trace.json'): expected a function"),
    ],
)
def test_bad_options_are_explained(options: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info, ak.profile(**options):
        pass
    assert words in str(info.value)
