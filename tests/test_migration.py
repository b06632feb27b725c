"""Porting an Accelerate script: ak.init where Accelerator() was, options that reach the workers, and
Accelerate habits that fail loudly instead of quietly."""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from processes import alive, subprocess_env
from torch import nn

import accelkit as ak
from accelkit.testing import WorkerPool

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
PORTED = str(SCRIPTS / "ported.py")
EXPECTED = "precision=bf16 steps=2 autocast=torch.bfloat16 summed=2"


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


# --- ak.init inside the training function (high) ------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, PORTED, "decorator", "2"],
        [sys.executable, PORTED, "launch", "2"],
        pytest.param([sys.executable, "-m", "accelkit", "launch", "-n", "2", "--cpu", PORTED], marks=pytest.mark.smoke),
    ],
    ids=["@ak.distributed", "ak.launch", "accelkit launch"],
)
@pytest.mark.slow
def test_a_ported_script_with_init_inside_the_function_runs_as_asked(argv: list[str]) -> None:
    done = _run(*argv)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"rank={rank} world=2 {EXPECTED}" in done.stdout
        # logging.basicConfig under __main__ reaches spawned workers, and the script's logger is __main__
        assert f"__main__|INFO|rank {rank} of 2 ready" in done.stderr


def test_init_inside_the_function_on_one_process() -> None:
    for mode in ("decorator", "launch"):
        done = _run(sys.executable, PORTED, mode, "1")
        assert done.returncode == 0 and "rank=0 world=1 precision=bf16 steps=2" in done.stdout, done.stderr


def precision_here() -> str:
    return ak.state().options.precision


def init_differently() -> str:
    ak.init(precision="bf16")
    return precision_here()


def test_options_set_before_a_launch_reach_the_workers() -> None:
    ak.init(precision="bf16", gradient_accumulation_steps=4)
    assert ak.launch(precision_here, num_processes=2, cpu=True) == "bf16"
    ak.init(precision="bf16")  # the launch reset this process's state; set it again
    assert ak.launch(precision_here, num_processes=1) == "bf16"
    ak.reset_state()
    ak.init(precision="bf16")
    with pytest.raises(ak.ConfigurationError, match=r"precision='fp16'.*precision='bf16' was set earlier"):
        ak.launch(precision_here, num_processes=2, cpu=True, precision="fp16")


@pytest.mark.slow
def test_a_launch_option_and_a_different_init_in_the_workers_name_both() -> None:
    with pytest.raises(ak.WorkerError) as info:
        ak.launch(init_differently, num_processes=2, cpu=True, precision="fp16")
    message = str(info.value)
    assert "'bf16' in code (accelkit.init(precision=...)" in message
    assert "'fp16' by accelkit.launch(precision='fp16')" in message
    assert ak.launch(init_differently, num_processes=2, cpu=True, precision="bf16") == "bf16"  # the same: fine


def world_here() -> int:
    return ak.world_size()


def test_the_config_file_s_process_count_is_used_by_a_bare_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ak.write_basic_config("no", tmp_path / "c.yaml", num_processes=2, cpu=True)  # as `accelkit config`
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", str(config))
    assert ak.launch(world_here) == 2
    assert ak.launch(world_here, num_processes=1) == 1  # code wins over the file


def sum_of_ranks() -> float:
    return ak.reduce(torch.tensor(float(ak.rank() + 1))).item()


def test_reduce_sums_by_default_like_accelerate(pool: WorkerPool) -> None:
    assert pool.run(sum_of_ranks) == [3.0, 3.0]


# --- habits that fail loudly (medium) -----------------------------------------------------------


def test_sync_gradients_used_as_a_property_says_to_call_it() -> None:
    assert ak.sync_gradients() is True
    with pytest.raises(TypeError, match=r"call it, `if ak.sync_gradients\(\):`"):
        if ak.sync_gradients:
            pass


def test_save_state_with_nothing_to_save_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"nothing to save; name what to save.*model=model"):
        ak.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_load_state_says_which_saved_objects_it_left_out(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ak.save_state(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched)
    with pytest.warns(UserWarning, match=r"also holds optimizer, scheduler.*pass optimizer=optimizer, scheduler="):
        ak.load_state(tmp_path / "ckpt", model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ak.load_state(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched)  # all restored: no warning


def test_an_unprepared_optimizer_inside_accumulate_is_named() -> None:
    model = ak.prepare(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # not prepared
    with pytest.warns(UserWarning, match=r"SGD.step\(\) ran on a gradient-accumulation micro-step.*not prepared"):
        for _ in range(2):
            with ak.accumulate(model, steps=2):
                ak.backward(model(torch.ones(1, 2)).sum())
                opt.step()  # the line the warning names
    prepared = ak.prepare(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with ak.accumulate(model, steps=2):
                ak.backward(model(torch.ones(1, 2)).sum())
                prepared.step()


@pytest.mark.slow
def test_a_missing_main_guard_is_named_in_the_summary() -> None:
    done = _run(sys.executable, str(SCRIPTS / "unguarded.py"))
    assert done.returncode != 0
    summary = done.stderr.split("WorkerError: ", 1)[-1].splitlines()[0]
    assert "call it under `if __name__ == '__main__':`" in summary, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_an_in_process_launch_stops_every_worker(tmp_path: Path, sig: int, code: int) -> None:
    cmd = [sys.executable, str(SCRIPTS / "interruptible.py"), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("worker-*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)  # both pid files whole
        pids = [int(f.read_text()) for f in tmp_path.glob("worker-*.pid")]
        assert len(pids) == 2, "the workers did not start"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert ("accelkit: interrupted" in err or "accelkit: stopped by SIGTERM" in err) and "Traceback" not in err
    assert "SignalException" not in err
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.slow
def test_accelerate_launch_spellings_are_accepted_and_typos_get_a_hint(tmp_path: Path) -> None:
    launch = [sys.executable, "-m", "accelkit", "launch"]
    done = _run(*launch, "--num_processes", "2", "--mixed_precision", "bf16", "--cpu", PORTED)
    assert done.returncode == 0, done.stderr
    assert f"rank=1 world=2 {EXPECTED}" in done.stdout  # the script's init(precision="bf16") agrees with the flag
    done = _run(*launch, "--num-procs", "2", PORTED)
    assert done.returncode == 2
    assert "usage: accelkit launch" in done.stderr and "did you mean '--num-processes'?" in done.stderr


# --- small ones (low) -----------------------------------------------------------------------------


def test_precision_typos_are_configuration_errors_with_a_suggestion() -> None:
    with pytest.raises(ak.ConfigurationError, match=r"'bf61'.*did you mean 'bf16'\?"):
        with ak.precision("bf61"):  # type: ignore[arg-type]
            pass


def test_launch_errors_name_launch() -> None:
    with pytest.raises(ak.ConfigurationError, match=r"^accelkit\.launch\(num_processes=0\)"):
        ak.launch(world_here, num_processes=0)


def test_dir_lists_the_public_names_only() -> None:
    names = [n for n in dir(ak) if not n.startswith("__")]
    assert names == sorted(n for n in ak.__all__ if not n.startswith("__"))


@pytest.mark.slow
def test_an_editable_install_is_visible_to_type_checkers(tmp_path: Path) -> None:
    pytest.importorskip("hatchling")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # --system-site-packages sees the base interpreter's packages; run from a venv, this one's (torch,
    # hatchling) are elsewhere: a path file makes them visible too, whichever interpreter runs the test.
    where = [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    site_dir = Path(subprocess.run(where, capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    ours = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (site_dir / "this-interpreters-packages.pth").write_text("".join(f"{d}\n" for d in ours if os.path.isdir(d)))
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    script = tmp_path / "user.py"
    script.write_text(
        "import accelkit as ak\nfrom typing_extensions import assert_type\n\n"
        "@ak.distributed(num_processes=2)\ndef f() -> int:\n    return ak.rank()\n\nassert_type(f(), int)\n"
    )
    check = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable", python, str(script)]
    done = subprocess.run(check, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
