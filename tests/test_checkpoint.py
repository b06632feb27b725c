"""save_state / load_state / save_model / latest_checkpoint: atomic, verified, exact to resume."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from weights import load_weights

import accelkit as ak
from accelkit._checkpoint import CheckpointError, _integrity, _manifest, _storage
from accelkit.testing import WorkerPool, run_distributed

# --- a small run with shuffling and dropout ---------------------------------------------------


def make_run() -> tuple[Any, Any, Any, Any]:
    ak.set_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    data = torch.Generator().manual_seed(123)
    dataset = TensorDataset(torch.randn(40, 4, generator=data), torch.randn(40, 1, generator=data))
    return ak.prepare(model, opt, DataLoader(dataset, batch_size=4, shuffle=True), sched)


def train(
    root: str, total: int, save_every: int = 0, resume: bool = False, crash_at: int = 0, blocking: bool = True
) -> list[float]:
    """Losses of ``total`` steps; saves every ``save_every`` steps; resumes from the latest checkpoint.

    With ``blocking=False`` each save returns once staged and training goes on while it is written.
    """
    model, opt, loader, sched = make_run()
    step, losses = 0, []
    ckpt = ak.latest_checkpoint(root) if resume else None
    if ckpt is not None:
        values = ak.load_state(ckpt, model=model, optimizer=opt, scheduler=sched)
        step, losses = values["step"], values["losses"][ak.rank()]
    while step < total:
        for x, y in loader:
            if crash_at and step == crash_at and ak.rank() == 1 and ak.state().restart_count == 0:
                os._exit(3)  # a worker dies without a word
            loss = F.mse_loss(model(x), y)
            ak.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            step += 1
            if save_every and step % save_every == 0:
                objects = {"model": model, "optimizer": opt, "scheduler": sched}
                ak.save_state(
                    f"{root}/step-{step}",
                    keep_last=2,
                    blocking=blocking,
                    **objects,
                    step=step,
                    losses=ak.gather_object(losses),
                )
            if step == total:
                break
    ak.wait_for_checkpoint()  # a save in flight is committed before the task reports back
    return losses


def elastic_train(root: str) -> tuple[int, list[float]]:
    return ak.state().restart_count, train(root, 14, save_every=3, resume=True, crash_at=8)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_resume_is_bit_exact_mid_epoch(tmp_path: Path, blocking: bool) -> None:
    reference = train(str(tmp_path / "ref"), 25)
    # 10 batches per epoch: the last save is mid-epoch 2; asynchronous saves are written while training goes on
    first = train(str(tmp_path / "run"), 16, save_every=6, blocking=blocking)
    assert first == reference[:16]
    ak.reset_state()  # waits for a save still in flight
    assert ak.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "step-12"
    torch.manual_seed(999)  # whatever the RNG was, the checkpoint brings it back
    assert train(str(tmp_path / "run"), 25, resume=True) == reference


@pytest.mark.smoke
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_resume_is_bit_exact_on_two_processes(pool: WorkerPool, tmp_path: Path, blocking: bool) -> None:
    reference = pool.run(train, str(tmp_path / "ref"), 12)
    pool.run(train, str(tmp_path / "run"), 9, save_every=7, blocking=blocking)  # 5 batches per rank and epoch
    assert sorted(os.listdir(tmp_path / "run" / "step-7")) == [
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "rank-0.json",
        "rank-1.json",
        "scheduler.pt",
    ]
    resumed = pool.run(train, str(tmp_path / "run"), 12, resume=True)
    assert resumed == reference and reference[0] != reference[1]


@pytest.mark.slow
def test_elastic_restart_resumes_bit_exact(pool: WorkerPool, tmp_path: Path) -> None:
    reference = pool.run(train, str(tmp_path / "ref"), 14)
    results = run_distributed(elastic_train, (str(tmp_path / "run"),), max_restarts=1, task_timeout=90)
    assert [count for count, _ in results] == [1, 1], "rank 1 died once and the group was restarted"
    assert [losses for _, losses in results] == reference
    assert sorted(os.listdir(tmp_path / "run")) == ["step-12", "step-9"]  # keep_last=2


# --- crashes during a save --------------------------------------------------------------------


def small_model(fill: float) -> nn.Module:
    model = nn.Linear(64, 64)
    nn.init.constant_(model.weight, fill)
    return model


def saved_fill(directory: Path) -> float:
    model = small_model(0.0)
    with warnings.catch_warnings():  # only the weights are compared: leaving the optimizer out is meant
        warnings.filterwarnings("ignore", "accelkit.load_state.*does not restore", UserWarning)
        ak.load_state(directory, model=model)
    fills = model.weight.unique()
    assert fills.numel() == 1, "a checkpoint mixes two saves"
    return float(fills.item())


def save_pair(directory: Path, fill: float, blocking: bool = True) -> None:
    """Save a model filled with ``fill``; asynchronously, the model is changed while the save is written."""
    model = small_model(fill)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ak.save_state(directory, model=model, optimizer=opt, step=int(fill), blocking=blocking)
    nn.init.constant_(model.weight, -fill)  # training goes on: the save holds the state it was called with
    ak.wait_for_checkpoint()


POINTS = [
    "before-file:model.pt",
    "mid-file:model.pt",
    "after-file:model.pt",
    "mid-file:optimizer.pt",
    "mid-file:rank-0.json",
    "before-manifest",
    "mid-file:manifest.json",
    "before-rename",
    "after-rename",
]


def in_child(fn: Callable[[], None]) -> int:
    """Run ``fn`` in a forked child; its wait status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            fn()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def kill_at(point: str) -> Callable[[str], None]:
    def hook(label: str) -> None:
        if label == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("same_dir", [False, True], ids=["new-dir", "same-dir"])
@pytest.mark.parametrize("point", POINTS)
def test_kill_at_any_point_leaves_old_or_new(tmp_path: Path, point: str, same_dir: bool, blocking: bool) -> None:
    save_pair(tmp_path / "a", 1.0)
    new = tmp_path / ("a" if same_dir else "b")

    def crash() -> None:
        _storage.crash_hook = kill_at(point)  # asynchronously: the background thread kills the process
        save_pair(new, 2.0, blocking=blocking)

    status = in_child(crash)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the child did not die at {point}"
    committed = point == "after-rename"
    latest = ak.latest_checkpoint(tmp_path)
    assert latest == (new if committed else tmp_path / "a")
    assert saved_fill(latest) == (2.0 if committed else 1.0)
    if not same_dir:
        assert saved_fill(tmp_path / "a") == 1.0
    save_pair(tmp_path / "c", 3.0)  # the next save cleans up what the crash left behind
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


@pytest.mark.parametrize("point", ["mid-file:optimizer.pt", "before-rename"])
def test_an_error_mid_save_commits_nothing(tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    save_pair(tmp_path / "a", 1.0)

    def fail(label: str) -> None:
        if label == point:
            raise RuntimeError(f"injected at {point}")

    monkeypatch.setattr(_storage, "crash_hook", fail)
    with pytest.raises(CheckpointError, match=f"(?s)nothing was committed.*injected at {point}"):
        save_pair(tmp_path / "a", 2.0)
    assert saved_fill(tmp_path / "a") == 1.0 and ak.latest_checkpoint(tmp_path) == tmp_path / "a"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("point", ["before-rename", "after-rename", "prune:step-1", "prune:step-2"])
def test_rotation_never_leaves_zero_checkpoints(tmp_path: Path, point: str, blocking: bool) -> None:
    for step in (1, 2):
        ak.save_state(tmp_path / f"step-{step}", model=small_model(step), keep_last=1, blocking=blocking)
    ak.wait_for_checkpoint()
    assert os.listdir(tmp_path) == ["step-2"]

    def crash() -> None:
        _storage.crash_hook = kill_at(point.replace("step-1", "step-2"))
        ak.save_state(tmp_path / "step-3", model=small_model(3.0), keep_last=1, blocking=blocking)
        ak.wait_for_checkpoint()

    assert os.WIFSIGNALED(in_child(crash)) or point == "prune:step-1"
    latest = ak.latest_checkpoint(tmp_path)
    assert latest is not None and saved_fill(latest) in (2.0, 3.0)
    ak.save_state(tmp_path / "step-4", model=small_model(4.0), keep_last=1)
    assert os.listdir(tmp_path) == ["step-4"]


# --- damaged and malicious files --------------------------------------------------------------


def checkpoint_files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_files_are_named_and_nothing_is_touched(tmp_path: Path, damage: str) -> None:
    save_pair(tmp_path / "a", 1.0)
    names = checkpoint_files(tmp_path / "a")
    assert names == ["manifest.json", "model.pt", "optimizer.pt", "rank-0.json"]
    for name in names:
        path = tmp_path / "a" / name
        good = path.read_bytes()
        bad = good[:-7] if damage == "truncate" else good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 1])
        path.write_bytes(bad + (b"" if damage == "truncate" else good[len(good) // 2 + 1 :]))
        model = small_model(5.0)
        torch.manual_seed(7)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            ak.load_state(tmp_path / "a", model=model)
        assert torch.equal(torch.get_rng_state(), torch.manual_seed(7).get_state()), f"{name}: the RNG was changed"
        assert torch.equal(model.weight, small_model(5.0).weight), f"{name}: the model was changed"
        path.write_bytes(good)
    assert saved_fill(tmp_path / "a") == 1.0


def test_a_changed_byte_in_any_piece_of_a_large_file_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are checksummed in pieces (64 MiB; 1 MiB here), verified by two threads; a mismatch names its piece."""
    monkeypatch.setattr(_integrity, "PIECE", 1 << 20)
    torch.manual_seed(0)
    model = nn.Linear(1100, 1100)  # 4.8 MB of weights: four pieces and a part
    ak.save_state(tmp_path / "a", model=model)
    path = tmp_path / "a" / "model.pt"
    good = path.read_bytes()
    record = json.loads((tmp_path / "a" / "manifest.json").read_text())["body"]["files"]["model.pt"]
    assert record["piece"] == 1 << 20 and len(record["xxh3_128"]) == 5 and record["size"] == len(good)
    ak.load_state(tmp_path / "a", model=nn.Linear(1100, 1100))
    for at, piece in ((100, 1), ((1 << 20) + 5, 2), (len(good) - 3, 5)):  # in the first, second and last piece
        path.write_bytes(good[:at] + bytes([good[at] ^ 0x10]) + good[at + 1 :])
        fresh = nn.Linear(1100, 1100)
        before = fresh.weight.clone()
        first = (piece - 1) << 20
        with pytest.raises(
            CheckpointError, match=rf"model\.pt has changed bytes in piece {piece} of 5 \(bytes {first} "
        ):
            ak.load_state(tmp_path / "a", model=fresh)
        assert torch.equal(fresh.weight, before), f"byte {at}: the model was changed"
    path.write_bytes(good)
    loaded = nn.Linear(1100, 1100)
    ak.load_state(tmp_path / "a", model=loaded)
    assert torch.equal(loaded.weight, model.weight)


def test_missing_rank_file_is_an_error(tmp_path: Path) -> None:
    save_pair(tmp_path / "a", 1.0)
    os.remove(tmp_path / "a" / "rank-0.json")
    with pytest.raises(CheckpointError, match=r"rank-0\.json is missing"):
        ak.load_state(tmp_path / "a", model=small_model(0.0))


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def forge(directory: Path, name: str, data: bytes) -> None:
    """Replace ``name`` by ``data`` and re-sign the manifest, as an attacker would."""
    (directory / name).write_bytes(data)
    if name == "manifest.json":
        return
    body = json.loads((directory / "manifest.json").read_text())["body"]
    body["files"][name] = {"size": len(data), "piece": _integrity.PIECE, "xxh3_128": [_integrity.digest(data)]}
    forged = _manifest.build(body["files"], body["objects"], body["values"], body["world_size"])
    (directory / "manifest.json").write_bytes(forged)


def test_checkpoints_of_another_format_version_are_refused_naming_the_version(tmp_path: Path) -> None:
    save_pair(tmp_path / "a", 3.0)
    manifest = tmp_path / "a" / "manifest.json"
    body = json.loads(manifest.read_text())["body"]
    assert body["version"] == 3
    for version in (2, 4):  # sum64's format (never released), a later one
        body["version"] = version
        manifest.write_bytes(_manifest._render(body))
        with pytest.raises(CheckpointError, match=rf"format version {version} \(accelkit '0\.1\.0' wrote it\); this "):
            saved_fill(tmp_path / "a")


def test_bytes_added_to_the_manifest_are_refused(tmp_path: Path) -> None:
    save_pair(tmp_path / "a", 3.0)
    manifest = tmp_path / "a" / "manifest.json"
    good = manifest.read_bytes()
    for extra in (b"\n", b" ", b"{}"):
        manifest.write_bytes(good + extra)
        with pytest.raises(CheckpointError, match=r"manifest\.json (holds|is not valid JSON)"):
            saved_fill(tmp_path / "a")
        assert ak.latest_checkpoint(tmp_path) is None
    manifest.write_bytes(good)
    assert saved_fill(tmp_path / "a") == 3.0


def test_no_code_runs_from_any_checkpoint_file(tmp_path: Path) -> None:
    proof = tmp_path / "payload-works"
    pickle.loads(pickle.dumps(Payload(str(proof))))
    assert proof.exists(), "the payload must run when unpickled without restrictions"
    marker = tmp_path / "pwned"
    save_pair(tmp_path / "a", 1.0)
    for name in checkpoint_files(tmp_path / "a"):
        directory = tmp_path / f"evil-{name}"
        save_pair(directory, 1.0)
        if name.endswith(".pt"):
            evil = tmp_path / "evil.pt"
            torch.save({"weight": Payload(str(marker))}, evil)
            forge(directory, name, evil.read_bytes())
        else:
            forge(directory, name, pickle.dumps(Payload(str(marker))))
        model = small_model(0.0)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            ak.load_state(directory, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert not marker.exists(), f"code from {name} ran"


# --- disk full --------------------------------------------------------------------------------


def full_disk(*args: Any) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_raises_and_keeps_the_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_pair(tmp_path / "a", 1.0)
    monkeypatch.setattr(_storage, "_write", full_disk)
    with pytest.raises(CheckpointError, match=r"no space left on device writing .*model\.pt.*free some space"):
        save_pair(tmp_path / "b", 2.0)
    monkeypatch.undo()
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "a" and saved_fill(tmp_path / "a") == 1.0
    assert not (tmp_path / "b").exists()


def test_a_failed_fsync_fails_the_save_and_keeps_the_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are fsynced on threads of their own, beside the next writes: a failure there still stops the commit."""
    save_pair(tmp_path / "a", 1.0)
    fsync, synced = os.fsync, []

    def failing_fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        synced.append(name)
        if name.endswith("model.pt"):
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError, match=r"(?s)nothing was committed.*Input/output error: .*model\.pt"):
        save_pair(tmp_path / "b", 2.0)
    monkeypatch.undo()
    assert any(name.endswith("model.pt") for name in synced)
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "a" and saved_fill(tmp_path / "a") == 1.0
    assert not (tmp_path / "b").exists()
    save_pair(tmp_path / "b", 2.0)  # the next save goes through
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "b" and saved_fill(tmp_path / "b") == 2.0


def save_with_full_disk_on_rank_1(root: str) -> None:
    ak.save_state(f"{root}/a", model=ak.prepare(small_model(1.0)), step=1)
    write = _storage._write
    if ak.rank() == 1:
        _storage._write = full_disk
    try:
        ak.save_state(f"{root}/b", model=ak.prepare(small_model(2.0)), step=2)
    finally:
        _storage._write = write


def test_disk_full_on_one_rank_fails_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    with pytest.raises(ak.WorkerError) as info:
        pool.run(save_with_full_disk_on_rank_1, str(tmp_path))
    failures = info.value.failures
    assert sorted(f.rank for f in failures) == [0, 1] and all(f.exc_type.endswith("CheckpointError") for f in failures)
    assert all("rank 1: no space left on device writing" in f.message for f in failures)
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "a" and not (tmp_path / "b").exists()


# --- the rest of the contract -----------------------------------------------------------------


def export(directory: str) -> str:
    return str(ak.save_model(ak.prepare(small_model(1.5)), directory))


def test_save_model_writes_unwrapped_weights_once(pool: WorkerPool, tmp_path: Path) -> None:
    paths = pool.run(export, str(tmp_path / "export"))
    assert paths[0] == paths[1] and os.listdir(tmp_path / "export") == [os.path.basename(paths[0])]
    assert paths[0].endswith("model.safetensors")  # preferred, as Accelerate does (the test extra installs it)
    weights = load_weights(paths[0])  # plain safetensors, no accelkit
    assert sorted(weights) == ["bias", "weight"] and bool((weights["weight"] == 1.5).all())


def test_save_model_without_safetensors_writes_a_bin_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if it were not installed
    with pytest.warns(UserWarning, match=r"safetensors is not installed.*pytorch_model\.bin.*accelkit\[safetensors\]"):
        path = ak.save_model(small_model(2.0), tmp_path)
    assert path.name == "pytorch_model.bin" and bool((torch.load(path, weights_only=True)["weight"] == 2.0).all())
    with pytest.raises(ImportError, match=r'pip install "accelkit\[safetensors\]"'):
        ak.save_model(small_model(2.0), tmp_path, safe_serialization=True)
    assert ak.save_model(small_model(3.0), tmp_path / "b", safe_serialization=False).name == "pytorch_model.bin"


def test_fp16_scaler_and_plain_values_round_trip(tmp_path: Path) -> None:
    ak.init(precision="fp16")
    model = small_model(1.0)
    opt = ak.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    ak.backward(model(torch.ones(1, 64)).sum())
    opt.step()
    ak._state.strategy().scaler.update(1234.0)  # type: ignore[attr-defined]
    ak.save_state(tmp_path / "a", model=model, optimizer=opt, step=3, note={"name": "x", "lr": [0.1, 1e-300]})
    ak.reset_state()
    ak.init(precision="fp16")
    opt = ak.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    values = ak.load_state(tmp_path / "a", model=model, optimizer=opt)
    assert values == {"step": 3, "note": {"name": "x", "lr": [0.1, 1e-300]}}
    assert ak._state.strategy().scaler.get_scale() == 1234.0  # type: ignore[attr-defined]


def test_errors_say_what_and_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"seen=set .*not JSON-able.*convert it"):
        ak.save_state(tmp_path / "a", seen={1, 2})
    with pytest.raises(ValueError, match=r"keep_last=0.*integer >= 1"):
        ak.save_state(tmp_path / "a", keep_last=0, step=1)
    save_pair(tmp_path / "a", 1.0)
    with pytest.raises(CheckpointError, match=r"has no \['ema'\]; it holds \['model', 'optimizer'\]"):
        ak.load_state(tmp_path / "a", ema=small_model(0.0))
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        ak.load_state(tmp_path, model=small_model(0.0))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="is not an accelkit checkpoint; save elsewhere"):
        save_pair(tmp_path / "mine", 1.0)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    loader = ak.prepare(DataLoader(range(8), batch_size=2))
    with pytest.raises(CheckpointError, match=r"positions of 0 prepared dataloader\(s\) but this process prepared 1"):
        ak.load_state(tmp_path / "a")
    del loader


def test_a_two_process_checkpoint_needs_two_processes(pool: WorkerPool, tmp_path: Path) -> None:
    pool.run(train, str(tmp_path), 2, save_every=2)
    model, *_ = make_run()
    with pytest.raises(CheckpointError, match=r"saved by 2 processes, this job has 1.*strict=False"):
        ak.load_state(tmp_path / "step-2", strict=True, model=model)
    rng = torch.get_rng_state()
    with pytest.warns(UserWarning) as caught:
        assert ak.load_state(tmp_path / "step-2", strict=False, model=model)["step"] == 2
    messages = [str(w.message) for w in caught]
    assert any("holds optimizer, scheduler, which this call does not restore" in m for m in messages), messages
    skipped = [m for m in messages if "strict=False" in m]  # once, naming this rank and its file
    assert len(skipped) == 1 and caught[messages.index(skipped[0])].filename == __file__, messages
    assert f"rank 0 skipped {tmp_path / 'step-2' / 'rank-0.json'} (saved by 2 processes, this job has 1)" in skipped[0]
    assert torch.equal(torch.get_rng_state(), rng), "strict=False leaves the per-rank state of another world size"


@pytest.mark.parametrize("damage", ["truncated", "bytes changed"])
def test_a_damaged_checkpoint_names_the_newest_whole_one(tmp_path: Path, damage: str) -> None:
    save_pair(tmp_path / "step-1", 1.0)
    save_pair(tmp_path / "step-2", 2.0)
    save_pair(tmp_path / "step-3", 3.0)
    damaged = tmp_path / "step-3" / "model.pt"
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2] if damage == "truncated" else data[:-8] + b"\xff" * 8)
    (tmp_path / "step-2" / "optimizer.pt").unlink()  # not whole either
    # A truncated file is seen without reading it; changed bytes only by load_state's checksums.
    expected = tmp_path / ("step-1" if damage == "truncated" else "step-3")
    assert ak.latest_checkpoint(tmp_path) == expected
    with pytest.raises(CheckpointError) as info:
        ak.load_state(tmp_path / "step-3", model=small_model(0.0))
    assert str(damaged) in str(info.value) and "the checkpoint is damaged" in str(info.value)
    assert f"{tmp_path / 'step-1'} verifies: load it instead, ak.load_state({str(tmp_path / 'step-1')!r}, ...)" in str(
        info.value
    )
    (tmp_path / "step-1" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=rf"no other checkpoint in {tmp_path} verifies \(no other is whole\)"):
        ak.load_state(tmp_path / "step-3", model=small_model(0.0))
