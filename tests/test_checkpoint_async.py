"""save_state(blocking=False): staged, written in the background, failures raised at the next call on every rank.

The crash-point and resume tests of tests/test_checkpoint.py run for the asynchronous path too
(their ``async`` ids); these are the behaviours only the background save has.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import subprocess_env
from test_checkpoint import saved_fill, small_model
from test_checkpoint_sharded import assert_equal, run
from torch_versions import needs_default_stager, needs_fsdp2_on_cpu

import accelkit as ak
from accelkit import _state
from accelkit._checkpoint import CheckpointError, _async, _storage
from accelkit.testing import WorkerPool


def full_disk(*args: Any) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def hidden(root: str | Path) -> list[str]:
    """What saves left beside their checkpoints (``.accelkit-tmp-*``, ``.accelkit-trash-*``)."""
    return sorted(name for name in os.listdir(root) if name.startswith("."))


def fail_in_the_background_on_rank_1(root: str) -> tuple[str, str, list[str], bool]:
    """An async save whose write fails on rank 1: (what save_state did, what the next call raised, what it left
    beside the checkpoints as the main process sees it then, retried)."""
    ak.save_state(f"{root}/a", model=ak.prepare(small_model(1.0)), step=1)
    write = _storage._write
    if ak.rank() == 1:
        _storage._write = full_disk
    try:
        returned = str(ak.save_state(f"{root}/b", blocking=False, model=ak.prepare(small_model(2.0)), step=2))
        try:
            ak.wait_for_checkpoint()
        except CheckpointError as exc:
            raised = str(exc)
        else:
            raised = "no error"
        left = hidden(root)
    finally:
        _storage._write = write
    ak.save_state(f"{root}/b", blocking=False, model=ak.prepare(small_model(3.0)), step=3)  # the error was raised once
    ak.wait_for_checkpoint()
    return returned, raised, left, ak.read_checkpoint(f"{root}/b")["step"] == 3


def test_a_background_write_failure_raises_at_the_next_call_on_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    results = pool.run(fail_in_the_background_on_rank_1, str(tmp_path))
    for returned, raised, _, retried in results:
        assert returned == str(tmp_path / "b"), "the call itself returns once the state is staged"
        assert raised.startswith("accelkit.wait_for_checkpoint(): the earlier save in the background failed")
        assert "nothing was committed" in raised and "rank 1: no space left on device writing" in raised
        assert re.search(r"the temporary directory \.accelkit-tmp-b-\w+ was removed", raised)
        assert retried
    assert results[0][2] == [], "the main process removed the temporary directory before the failure was raised"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_failed_save_removes_its_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    ak.save_state(tmp_path / "a", model=small_model(1.0))
    monkeypatch.setattr(_storage, "_write", full_disk)
    with pytest.raises(
        CheckpointError, match=r"untouched and the temporary directory \.accelkit-tmp-b-\w+ was removed"
    ):
        ak.save_state(tmp_path / "b", blocking=blocking, model=small_model(2.0))
        ak.wait_for_checkpoint()
    assert os.listdir(tmp_path) == ["a"] and saved_fill(tmp_path / "a") == 1.0


@contextlib.contextmanager
def tiny_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where`` (root only): a real full disk."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_raises_at_the_next_save_state_and_at_end_training(tmp_path: Path) -> None:
    with tiny_disk(tmp_path / "disk", "256k") as disk:
        ak.save_state(disk / "a", model=small_model(1.0))  # 16 KB: fits
        big = torch.nn.Linear(512, 512)  # 1 MB: does not
        assert ak.save_state(disk / "b", blocking=False, model=big) == disk / "b"
        with pytest.raises(CheckpointError, match=r"(?s)accelkit.save_state\('.*c'\): the earlier save in the back"):
            ak.save_state(disk / "c", model=small_model(3.0))
        assert not (disk / "c").exists(), "the failure is raised before the next save begins"
        ak.save_state(disk / "b", blocking=False, model=big)
        with pytest.raises(CheckpointError, match=r"(?s)accelkit.end_training\(\): .*no space left on device writing"):
            ak.end_training()
        assert not ak.is_initialized(), "end_training still tore the state down"
        assert ak.latest_checkpoint(disk) == disk / "a" and saved_fill(disk / "a") == 1.0
        assert [n for n in os.listdir(disk) if not n.startswith(".")] == ["a"]


def test_a_failure_no_call_reported_is_a_warning_at_reset_state_and_stays_on_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_storage, "_write", full_disk)
    ak.save_state(tmp_path / "a", blocking=False, model=small_model(1.0))
    unreported = _async._unreported()
    try:
        with pytest.warns(UserWarning, match=r"(?s)blocking=False\) failed, and no later call reported it: .*no space"):
            ak.reset_state()
        assert [call for _, call, _ in unreported] == [f"accelkit.save_state({str(tmp_path / 'a')!r})"]
    finally:
        unreported.clear()  # else this process would end with exit code 1, as the script below does
    assert hidden(tmp_path) == []


def test_one_save_in_flight_the_next_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(label: str) -> None:
        if label == "before-rename":
            time.sleep(0.5)

    monkeypatch.setattr(_storage, "crash_hook", slow)
    started = time.monotonic()
    ak.save_state(tmp_path / "a", blocking=False, model=small_model(1.0), keep_last=1)
    assert time.monotonic() - started < 0.5 and not (tmp_path / "a").exists(), "the first save is in flight"
    ak.save_state(tmp_path / "b", blocking=False, model=small_model(2.0), keep_last=1)
    assert (tmp_path / "a").exists(), "the second save began after the first was committed"
    ak.wait_for_checkpoint()
    assert os.listdir(tmp_path) == ["b"] and saved_fill(tmp_path / "b") == 2.0  # pruned after the commit
    ak.wait_for_checkpoint()  # nothing in flight: returns at once


@needs_default_stager
def test_each_save_stages_anew_where_torchs_stager_closes_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager.stage

    def stage_then_close(self: DefaultStager, state: Any, **kwargs: Any) -> Any:
        staged = stage(self, state, **kwargs)
        self.close()  # what torch < 2.13 does after each stage: a second stage then fails
        return staged

    monkeypatch.setattr(DefaultStager, "stage", stage_then_close)
    monkeypatch.setattr(_async, "_STAGER_KEEPS_BUFFERS", False)
    for step in (1, 2, 3):  # a closed stager's copier is empty: it fails on the first dict
        ak.save_state(tmp_path / f"s{step}", blocking=False, model=small_model(float(step)), step=step)
    ak.wait_for_checkpoint()
    assert [ak.read_checkpoint(tmp_path / f"s{step}")["step"] for step in (1, 2, 3)] == [1, 2, 3]
    assert saved_fill(tmp_path / "s3") == 3.0


# --- a failure no call raised fails the process at exit ----------------------------------------

SCRIPT = Path(__file__).parent / "bg_failure_script.py"
NOT_RAISED = "(blocking=False) failed in the background, and no later call raised it"


def run_script(root: Path, how: str) -> subprocess.CompletedProcess[str]:
    """tests/bg_failure_script.py: a small save to ROOT/a, then a 1 MB one to ROOT/b in the background; see there."""
    command = [sys.executable, str(SCRIPT), str(root), how]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=root)


def test_a_script_whose_background_save_fails_unreported_exits_non_zero_and_cleans_up(tmp_path: Path) -> None:
    done = run_script(tmp_path, "fail")  # RLIMIT_FSIZE: the write of model.pt raises OSError(EFBIG)
    assert done.returncode == 1, done.stderr
    assert f"accelkit: accelkit.save_state({str(tmp_path / 'b')!r}) {NOT_RAISED}:" in done.stderr
    assert "rank 0: OSError: [Errno 27] File too large" in done.stderr, "the error itself"
    assert "call ak.wait_for_checkpoint()" in done.stderr, "the fix"
    assert os.listdir(tmp_path) == ["a"], "no checkpoint, no temporary directory left"
    assert ak.read_checkpoint(tmp_path / "a")["step"] == 1


def test_a_script_that_ends_right_after_the_call_still_commits(tmp_path: Path) -> None:
    done = run_script(tmp_path, "ok")  # and nothing else is said
    assert done.returncode == 0, done.stderr
    assert "accelkit" not in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and ak.read_checkpoint(tmp_path / "b")["step"] == 2


def test_a_failure_the_script_caught_leaves_the_exit_code_alone(tmp_path: Path) -> None:
    done = run_script(tmp_path, "caught")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("caught: accelkit.wait_for_checkpoint(): the earlier save in the background failed")
    assert NOT_RAISED not in done.stderr
    assert os.listdir(tmp_path) == ["a"]


def test_a_failure_reset_state_warned_about_still_fails_the_process(tmp_path: Path) -> None:
    done = run_script(tmp_path, "reset")
    assert done.returncode == 1, done.stderr
    assert "UserWarning" in done.stderr and "no later call reported it" in done.stderr
    assert NOT_RAISED in done.stderr and "File too large" in done.stderr
    assert os.listdir(tmp_path) == ["a"]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_whose_background_save_fails_unreported_fail_the_job(tmp_path: Path) -> None:
    done = run_script(tmp_path, "distributed")  # @ak.distributed(num_processes=2): rank 0's write fails
    assert done.returncode == 1, done.stderr
    assert "accelkit.errors.WorkerError: rank" in done.stderr, "the launcher reports the failed ranks"
    for rank in (0, 1):
        assert f"- rank {rank} (local rank {rank}, pid" in done.stderr
    assert "rank 0: OSError: [Errno 27] File too large" in done.stderr and NOT_RAISED in done.stderr
    assert os.listdir(tmp_path) == ["a"]


@pytest.mark.smoke
@needs_fsdp2_on_cpu
def test_sharded_state_resumes_bit_exact_after_an_async_save(pool: WorkerPool, tmp_path: Path) -> None:
    reference = pool.run(run, str(tmp_path / "ref"), 6)
    saved = pool.run(run, str(tmp_path / "run"), 5, save_at=3, blocking=False)  # trains on while it is written
    resumed = pool.run(run, str(tmp_path / "run"), 6, resume=True)
    for rank in (0, 1):
        assert_equal(resumed[rank], reference[rank])
    assert not torch.equal(saved[0]["0.weight"], reference[0]["0.weight"])


def fail_to_stage_on_rank_1(root: str) -> str:
    model = ak.prepare(small_model(1.0))
    ak.save_state(f"{root}/a", blocking=False, model=model)
    ak.wait_for_checkpoint()

    def out_of_memory(state: Any) -> Any:
        raise MemoryError("cannot allocate the staging buffers")

    if ak.rank() == 1:
        ak._state.training.saving.stager.stage = out_of_memory
    ak.save_state(f"{root}/b", blocking=False, model=model)
    try:
        ak.wait_for_checkpoint()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_rank_that_cannot_stage_fails_the_save_on_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    for message in pool.run(fail_to_stage_on_rank_1, str(tmp_path)):
        assert "nothing was written; the temporary directory .accelkit-tmp-b-" in message
        assert "rank 1: MemoryError: cannot allocate the staging" in message
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "a" and not (tmp_path / "b").exists()
    assert hidden(tmp_path) == [], "the main process removed the temporary directory"


def background_agreement_tensors(root: str) -> tuple[bool, list[Any]]:
    """After an async save: whether its group's last calls' tensors are held from Python; a big exchange."""
    from accelkit._collectives import _exchange, exchange_objects

    _exchange._KEPT.clear()
    ak.save_state(f"{root}/a", blocking=False, model=ak.prepare(small_model(1.0)), step=1)
    ak.wait_for_checkpoint()
    group = _state.group.checkpoint_group
    kept = [t for calls in _exchange._KEPT.values() for args in calls for t in args if isinstance(t, torch.Tensor)]
    big = exchange_objects({"rank": ak.rank(), "pad": "x" * 5000 * (ak.rank() + 1)}, group)
    return bool(kept), [(b["rank"], len(b["pad"])) for b in big]


def test_the_background_group_keeps_its_last_calls_tensors_alive(pool: WorkerPool, tmp_path: Path) -> None:
    # gloo's worker thread drops a finished call's tensors after the caller's wait; were that the last reference,
    # it would need the GIL while ak.end_training destroys the group on the main thread, holding it (a hang).
    for kept, big in pool.run(background_agreement_tensors, str(tmp_path)):
        assert kept, "the agreements of the background save keep their tensors (as the collectives do)"
        assert big == [(0, 5000), (1, 10000)]  # beyond one message slot, in rank order
