"""Checkpoints on an object store: the same promises as on a local disk, against a real S3 API on 127.0.0.1.

The S3 tests run against moto's server (``tests/s3_server.py``, started once for this module and
stopped by its pid) through s3fs, as a user's script would reach a bucket: save and resume bit-exact
on two processes (blocking and in the background, plain and sharded), a kill -9 at each moment of a
save, a damaged object, loads racing saves and pruning, and a missing bucket or missing credentials
refused before any work. ``memory://`` (fsspec's in-process store) runs the rest fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import s3_server
import torch
from processes import subprocess_env
from test_checkpoint import in_child, kill_at, save_pair, saved_fill, small_model, train
from test_checkpoint_integrity import race
from test_checkpoint_sharded import assert_equal, run
from torch import nn
from torch_versions import needs_fsdp2_on_cpu

import accelkit as ak
from accelkit._checkpoint import _integrity, _storage
from accelkit.testing import WorkerPool

pytestmark = pytest.mark.skipif(s3_server.missing() is not None, reason=f"no S3 server: {s3_server.missing()}")


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A moto S3 server for this module's tests; this process reaches it (its environment), workers call ``use``."""
    import fsspec.asyn

    before = dict(os.environ)
    with s3_server.serving() as env:
        s3_server.use(env)
        # s3fs's I/O thread and the one thread its loop resolves addresses on, started here, not inside a test
        loop = fsspec.asyn.get_loop()
        resolver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsspec-resolve")
        resolver.submit(lambda: None).result()
        loop.call_soon_threadsafe(loop.set_default_executor, resolver)
        try:
            yield env
        finally:
            os.environ.clear()
            os.environ.update(before)


counter = iter(range(1_000_000))


@pytest.fixture
def bucket(s3: dict[str, str]) -> str:
    """A fresh bucket on the server: its URL."""
    name = f"ckpt-{os.getpid()}-{next(counter)}"
    s3_server.make_bucket(name)
    return f"s3://{name}"


def objects(url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(p[len(path) + 1 :] for p in fs.find(path))


# --- memory://: fsspec's store in this process -------------------------------------------------


def test_a_round_trip_through_memory_is_bit_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    root = f"memory://round-trip-{os.getpid()}"
    assert ak.save_state(f"{root}/step-1", model=model, optimizer=opt, step=1, loss=torch.tensor(0.25)) == (
        f"{root}/step-1"
    )
    assert ak.latest_checkpoint(root) == f"{root}/step-1"
    fresh = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    values = ak.load_state(f"{root}/step-1", model=fresh, optimizer=fresh_opt)
    assert values["step"] == 1 and torch.equal(values["loss"], torch.tensor(0.25))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"])
    info = ak.read_checkpoint(f"{root}/step-1")
    assert info.path == f"{root}/step-1" and info.step == 1 and info.objects == ["model", "optimizer"]
    assert objects(f"{root}/step-1")[-1] == "manifest.json" and len(objects(f"{root}/step-1")) == 5


def test_memory_keeps_the_last_and_replaces_in_place() -> None:
    root = f"memory://rotation-{os.getpid()}"
    for step in (1, 2, 3):
        ak.save_state(f"{root}/step-{step}", model=small_model(step), keep_last=2)
    assert [p.split("/")[0] for p in objects(root) if p.endswith("manifest.json")] == ["step-2", "step-3"]
    save_pair(f"{root}/step-3", 7.0)  # type: ignore[arg-type]  # into the same checkpoint: replaced whole
    assert saved_fill(f"{root}/step-3") == 7.0  # type: ignore[arg-type]
    folders = {p.split("/")[0] for p in objects(f"{root}/step-3") if "/" in p}
    assert len(folders) == 1, f"the replaced save's folder was removed: {folders}"
    save_pair(f"{root}/step-4", 8.0, blocking=False)  # type: ignore[arg-type]
    assert ak.latest_checkpoint(root) == f"{root}/step-4"
    assert ak.save_model(small_model(1.0), f"{root}/export", safe_serialization=False) == (
        f"{root}/export/pytorch_model.bin"
    )


def test_a_url_no_driver_serves_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no fsspec driver serves nosuchscheme://: nothing was read or written"):
        ak.save_state("nosuchscheme://bucket/run/step-1", model=small_model(1.0))
    assert os.listdir(tmp_path) == [] and not ak.is_initialized()


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    ak.save_state(f"file://{tmp_path}/step-1", model=small_model(2.0))
    assert ak.latest_checkpoint(f"file://{tmp_path}") == tmp_path / "step-1"
    assert saved_fill(tmp_path / "step-1") == 2.0


# --- S3: a real S3 API on 127.0.0.1 --------------------------------------------------------------


def train_on(env: dict[str, str], root: str, total: int, **options: Any) -> list[float]:
    s3_server.use(env)
    return train(root, total, **options)


@pytest.mark.distributed
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_resume_from_s3_on_two_processes_is_bit_exact(
    pool: WorkerPool, s3: dict[str, str], bucket: str, tmp_path: Path, blocking: bool
) -> None:
    reference = pool.run(train, str(tmp_path / "ref"), 12)
    pool.run(train_on, s3, f"{bucket}/run", 9, save_every=7, blocking=blocking)  # 5 batches per rank and epoch
    files = objects(f"{bucket}/run/step-7")
    data = files[0].split("/")[0]
    assert data.startswith(".accelkit-data-") and files == [
        f"{data}/{name}" for name in ("model.pt", "optimizer.pt", "rank-0.json", "rank-1.json", "scheduler.pt")
    ] + ["manifest.json"]
    resumed = pool.run(train_on, s3, f"{bucket}/run", 12, resume=True)
    assert resumed == reference and reference[0] != reference[1]


def sharded_on(env: dict[str, str], root: str, stop: int, **options: Any) -> dict[str, torch.Tensor]:
    s3_server.use(env)
    return run(root, stop, **options)


@pytest.mark.distributed
@needs_fsdp2_on_cpu
def test_a_sharded_resume_from_s3_is_bit_exact(
    pool: WorkerPool, s3: dict[str, str], bucket: str, tmp_path: Path
) -> None:
    reference = pool.run(run, str(tmp_path / "ref"), 6)
    pool.run(sharded_on, s3, f"{bucket}/run", 3, save_at=3, blocking=False)
    files = objects(f"{bucket}/run/ckpt")
    for name in ("model", "optimizer"):
        assert sorted(f.split("/", 1)[1] for f in files if f"/{name}.dcp/" in f) == [
            f"{name}.dcp/.metadata",
            f"{name}.dcp/__0_0.distcp",
            f"{name}.dcp/__1_0.distcp",
        ]
    resumed = pool.run(sharded_on, s3, f"{bucket}/run", 6, resume=True)
    for rank in (0, 1):
        assert_equal(resumed[rank], reference[rank])


POINTS = [
    "before-file:model.pt",
    "mid-file:model.pt",
    "after-file:model.pt",
    "mid-file:optimizer.pt",
    "before-manifest",
    "after-manifest",
]


@pytest.mark.parametrize("same_dir", [False, True], ids=["new-dir", "same-dir"])
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_any_moment_of_a_save_to_s3_leaves_the_previous_checkpoint(
    bucket: str, point: str, same_dir: bool
) -> None:
    root = f"{bucket}/run"
    save_pair(f"{root}/a", 1.0)  # type: ignore[arg-type]
    new = f"{root}/{'a' if same_dir else 'b'}"

    def crash() -> None:
        _storage.crash_hook = kill_at(point)
        save_pair(new, 2.0)  # type: ignore[arg-type]

    status = in_child(crash)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the child did not die at {point}"
    committed = point == "after-manifest"
    latest = ak.latest_checkpoint(root)
    assert latest == (new if committed else f"{root}/a")
    assert saved_fill(latest) == (2.0 if committed else 1.0)  # type: ignore[arg-type]
    save_pair(f"{root}/c", 3.0)  # type: ignore[arg-type]  # the next save removes what the kill left
    for name in {"a", "b", "c"}:
        folders = {p.split("/")[0] for p in objects(f"{root}/{name}") if "/" in p}
        assert len(folders) <= 1, f"{name}: leftovers of the killed save: {folders}"
    assert saved_fill(f"{root}/a") == (2.0 if committed and same_dir else 1.0)  # type: ignore[arg-type]


def test_a_damaged_object_is_refused_naming_it_and_nothing_changes(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    monkeypatch.setattr(_integrity, "PIECE", 4096)  # several pieces: the message names the damaged one
    save_pair(f"{bucket}/a", 1.0)  # type: ignore[arg-type]
    save_pair(f"{bucket}/b", 2.0)  # type: ignore[arg-type]
    fs, _ = fsspec.core.url_to_fs(bucket)
    model_file = next(p for p in objects(f"{bucket}/b") if p.endswith("model.pt"))
    key = f"{bucket[len('s3://') :]}/b/{model_file}"
    good = fs.cat_file(key)
    at = len(good) // 2
    fs.pipe_file(key, good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])
    model = small_model(5.0)
    torch.manual_seed(7)
    piece = at // 4096 + 1
    with pytest.raises(ak.CheckpointError, match=rf"model\.pt has changed bytes in piece {piece} of \d+ ") as raised:
        ak.load_state(f"{bucket}/b", model=model)
    assert f"{bucket}/a verifies: load it instead" in str(raised.value)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(7).get_state()), "the RNG was changed"
    assert torch.equal(model.weight, small_model(5.0).weight), "the model was changed"
    fs.pipe_file(key, good[:-5])  # cut short: a cheap check sees it
    assert ak.latest_checkpoint(bucket) == f"{bucket}/a"


def test_a_checkpoint_replaced_between_its_manifest_and_its_listing_is_replaced_not_damaged(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    from accelkit._checkpoint._remote_snapshot import RemoteSnapshot
    from accelkit._checkpoint._where import storage_for

    url = f"{bucket}/c"
    save_pair(url, 1.0)  # type: ignore[arg-type]
    storage = storage_for("load_state", url)
    read_before = storage.manifest()  # type: ignore[attr-defined]
    save_pair(url, 2.0)  # type: ignore[arg-type]  # a new folder, the manifest, then the old folder removed
    answers = iter([read_before])
    real = storage.manifest  # type: ignore[attr-defined]
    monkeypatch.setattr(storage, "manifest", lambda: next(answers, None) or real())
    with pytest.raises(ak.CheckpointError, match="was replaced or removed while it was being loaded"):
        RemoteSnapshot.take(storage)  # type: ignore[arg-type]
    # A file gone under a manifest that still names it is damage, and said so.
    fs, _ = fsspec.core.url_to_fs(bucket)
    model_file = next(p for p in objects(url) if p.endswith("model.pt"))
    fs.rm_file(f"{bucket[len('s3://') :]}/c/{model_file}")
    with pytest.raises(ak.CheckpointError, match=r"model\.pt is missing; the checkpoint is damaged"):
        ak.load_state(url, model=small_model(5.0))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["same", "prune"], ids=["replaced", "pruned"])
def test_loads_racing_saves_and_pruning_on_s3_load_one_whole_save(bucket: str, mode: str, tmp_path: Path) -> None:
    root = f"{bucket}/run"
    target = (lambda: f"{root}/ckpt") if mode == "same" else (lambda: ak.latest_checkpoint(root))
    outcomes = race(root, tmp_path / "saver.log", mode, target, seconds=20.0)
    print(dict(outcomes))
    assert outcomes["loaded"] >= 3, outcomes
    assert outcomes["distinct steps loaded"] >= 2, f"no save replaced the checkpoint during the loads: {outcomes}"


def test_a_missing_bucket_is_refused_before_any_work(s3: dict[str, str], tmp_path: Path) -> None:
    missing = f"s3://no-such-bucket-{os.getpid()}/run"
    for call in (
        lambda: ak.save_state(f"{missing}/step-1", model=small_model(1.0)),
        lambda: ak.load_state(f"{missing}/step-1", model=small_model(1.0)),
        lambda: ak.latest_checkpoint(missing),
        lambda: ak.save_model(small_model(1.0), f"{missing}/export", safe_serialization=False),
    ):
        with pytest.raises(ak.CheckpointError, match=rf"the bucket 'no-such-bucket-{os.getpid()}' does not exist"):
            call()


NO_CREDENTIALS = """
import sys, torch, accelkit as ak
try:
    ak.save_state(sys.argv[1], model=torch.nn.Linear(2, 2))
except ak.CheckpointError as exc:
    print(exc)
"""


def test_missing_credentials_are_refused_before_any_work(s3: dict[str, str], bucket: str) -> None:
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL_S3=s3["AWS_ENDPOINT_URL_S3"], AWS_EC2_METADATA_DISABLED="true")
    env.update(AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull)
    done = subprocess.run(
        [sys.executable, "-c", NO_CREDENTIALS, f"{bucket}/run/step-1"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "cannot be reached (NoCredentialsError: Unable to locate credentials)" in done.stdout, done.stdout
    assert "AWS_ACCESS_KEY_ID" in done.stdout and "nothing was read or written" in done.stdout
    assert objects(bucket) == []
