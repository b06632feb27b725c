"""Sharded (FSDP2 / DTensor) state in save_state / load_state / save_model, in real gloo groups."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_versions import needs_fsdp2_on_cpu
from weights import load_weights

import accelkit as ak
from accelkit._checkpoint import CheckpointError, _integrity, _manifest, _storage
from accelkit.testing import WorkerPool, run_distributed

# --- a small sharded run ----------------------------------------------------------------------


def plain_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def sharded_model(seed: int = 0) -> tuple[nn.Module, Any]:
    """A ``fully_shard``-ed model (by hand) and its prepared AdamW; needs the process group."""
    model = plain_model(seed)
    shard_by_hand(model[0], model[2], model)
    return model, ak.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))


def shard_by_hand(*modules: nn.Module) -> None:
    """``fully_shard`` each module over the ranks on ``ak.device()``: without a mesh, torch shards onto
    the GPU whenever one is visible, a test that runs on the CPU too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ak.device().type, (ak.world_size(),))
    for module in modules:
        fully_shard(module, mesh=mesh)


def train_step(model: nn.Module, opt: Any, step: int) -> None:
    data = torch.Generator().manual_seed(1000 + 10 * step + ak.rank())
    x, y = torch.randn(4, 4, generator=data), torch.randn(4, 2, generator=data)
    ak.backward(F.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, unsharded by hand (every rank must call it)."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for name, param in model.named_parameters():
        out[name] = full(param)
        for key, value in sorted(opt.state[param].items()):
            out[f"{name}.{key}"] = full(value)
    return out


def run(root: str, stop: int, save_at: int = 0, resume: bool = False, blocking: bool = True) -> dict[str, torch.Tensor]:
    model, opt = sharded_model()
    step = ak.load_state(f"{root}/ckpt", model=model, optimizer=opt)["step"] if resume else 0
    while step < stop:
        train_step(model, opt, step)
        step += 1
        if step == save_at:
            ak.save_state(f"{root}/ckpt", model=model, optimizer=opt, step=step, blocking=blocking)
    ak.wait_for_checkpoint()
    return full_state(model, opt)


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.smoke
@needs_fsdp2_on_cpu
def test_resume_on_the_same_world_size_is_bit_exact(pool: WorkerPool, tmp_path: Path) -> None:
    reference = pool.run(run, str(tmp_path / "ref"), 6)
    saved = pool.run(run, str(tmp_path / "run"), 3, save_at=3)
    resumed = pool.run(run, str(tmp_path / "run"), 6, resume=True)
    for rank in (0, 1):
        assert_equal(resumed[rank], reference[rank])
    assert not torch.equal(saved[0]["0.weight"], reference[0]["0.weight"]), "training moved the weights"
    assert "0.weight.exp_avg" in reference[0] and "2.bias.step" in reference[0]
    ckpt = tmp_path / "run" / "ckpt"
    body = json.loads((ckpt / "manifest.json").read_text())["body"]
    assert body["sharded"] == ["model", "optimizer"] and body["objects"] == ["model", "optimizer"]
    for name in ("model", "optimizer"):
        on_disk = sorted(os.listdir(ckpt / f"{name}.dcp"))
        assert on_disk == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert {f"{name}.dcp/{n}" for n in on_disk} <= set(body["files"]), "every DCP file is in the manifest"


def test_a_two_process_sharded_checkpoint_loads_on_one_process(pool: WorkerPool, tmp_path: Path) -> None:
    saved = pool.run(run, str(tmp_path), 3, save_at=3)[0]
    wrong = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    wrong_opt = torch.optim.AdamW(wrong.parameters(), lr=0.05)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"model\.dcp could not be loaded into Sequential \(nothing was changed\)"
    ):
        ak.load_state(tmp_path / "ckpt", strict=False, model=wrong, optimizer=wrong_opt)
    assert_equal(wrong.state_dict(), before)
    model = plain_model(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    with pytest.raises(CheckpointError, match=r"saved by 2 processes, this job has 1.*strict=False"):
        ak.load_state(tmp_path / "ckpt", strict=True, model=model, optimizer=opt)
    assert ak.load_state(tmp_path / "ckpt", strict=False, model=model, optimizer=opt) == {"step": 3}
    assert_equal(full_state(model, opt), saved)


def export(directory: str) -> tuple[str, dict[str, torch.Tensor]]:
    model, opt = sharded_model()
    train_step(model, opt, 0)
    path = ak.save_model(model, directory)
    names = [name for name, _ in model.named_parameters()]
    return str(path), {k: v for k, v in full_state(model, opt).items() if k in names}


def test_save_model_gathers_the_full_weights_once(pool: WorkerPool, tmp_path: Path) -> None:
    (path, full), (path_1, _) = pool.run(export, str(tmp_path / "export"))
    assert path == path_1 and os.listdir(tmp_path / "export") == [os.path.basename(path)]
    weights = load_weights(path)  # plain safetensors or torch, no accelkit
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert_equal(weights, full)
    plain_model().load_state_dict(weights)  # strict: it fits the unsharded model


# --- failures and damage ----------------------------------------------------------------------


def fail_mid_shard(label: str) -> None:
    if label == "mid-file:__1_0.distcp":
        raise RuntimeError("injected write failure")


def save_fails_on_rank_1(root: str) -> tuple[str, dict[str, torch.Tensor]]:
    model, opt = sharded_model()
    train_step(model, opt, 0)
    ak.save_state(f"{root}/a", model=model, optimizer=opt, step=1)
    first = full_state(model, opt)
    train_step(model, opt, 1)
    _storage.crash_hook = fail_mid_shard if ak.rank() == 1 else None
    try:
        ak.save_state(f"{root}/a", model=model, optimizer=opt, step=2)
    except CheckpointError as exc:
        return str(exc), first
    finally:
        _storage.crash_hook = None
    return "no error", first


def test_a_write_failure_on_one_rank_fails_every_rank_and_commits_nothing(pool: WorkerPool, tmp_path: Path) -> None:
    (message_0, first), (message_1, _) = pool.run(save_fails_on_rank_1, str(tmp_path))
    for message in (message_0, message_1):
        assert "nothing was committed" in message and "rank 1: RuntimeError: injected write failure" in message
    assert ak.latest_checkpoint(tmp_path) == tmp_path / "a"
    model = plain_model(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert ak.load_state(tmp_path / "a", strict=False, model=model, optimizer=opt) == {"step": 1}
    assert_equal(full_state(model, opt), first)


def kill_mid_second_save(root: str, point: str, victim: int, blocking: bool = True) -> None:
    """Save sharded state to ``ROOT/run/ckpt``, then SIGKILL rank ``victim`` at ``point`` of a second save there."""
    model, opt = sharded_model()
    train_step(model, opt, 0)
    ak.save_state(f"{root}/run/ckpt", model=model, optimizer=opt, step=1)
    first = full_state(model, opt)
    if ak.is_main_process():
        torch.save(first, f"{root}/first.pt")  # the killed job returns nothing: the test reads it here
    train_step(model, opt, 1)

    def kill(label: str) -> None:
        if label == point:
            os.kill(os.getpid(), signal.SIGKILL)

    _storage.crash_hook = kill if ak.rank() == victim else None
    ak.save_state(f"{root}/run/ckpt", model=model, optimizer=opt, step=2, blocking=blocking)
    train_step(model, opt, 2)  # asynchronously: killed while training on
    ak.wait_for_checkpoint()


def load_on_one_process(ckpt: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model = plain_model(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    values = ak.load_state(ckpt, strict=False, model=model, optimizer=opt)
    return values, full_state(model, opt)


@pytest.mark.parametrize(
    ("point", "victim", "blocking"),
    [
        ("mid-file:__1_0.distcp", 1, True),  # DCP is writing the first shard file of rank 1
        ("after-file:__0_0.distcp", 0, True),  # rank 0's first shard file is whole, the rest is not written
        ("before-rename", 0, True),  # every shard file and the manifest are written, not yet moved into place
        ("mid-file:__1_0.distcp", 1, False),  # the same, in the background thread of save_state(blocking=False)
        ("before-rename", 0, False),
    ],
)
def test_a_worker_killed_mid_sharded_save_keeps_the_previous_checkpoint(
    pool: WorkerPool, tmp_path: Path, point: str, victim: int, blocking: bool
) -> None:
    started = time.monotonic()
    with pytest.raises(ak.WorkerError) as info:  # real processes: a killed worker would restart the pool
        run_distributed(kill_mid_second_save, (str(tmp_path), point, victim, blocking), task_timeout=90)
    assert time.monotonic() - started < 80, "a killed worker must end the job, not hang it"
    assert info.value.ranks[0] == victim and f"rank {victim} failed" in str(info.value) and "SIGKILL" in str(info.value)
    assert next(f for f in info.value.failures if f.rank == victim).exitcode == -signal.SIGKILL
    folder, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    left = [name for name in os.listdir(folder) if name.startswith(".accelkit-tmp-")]
    assert left, "the kill came before the save began"
    assert ak.latest_checkpoint(folder) == ckpt
    values, state = load_on_one_process(ckpt)  # load_state checks every file against the manifest first
    assert values == {"step": 1}
    assert_equal(state, torch.load(tmp_path / "first.pt", weights_only=True))

    second = pool.run(run, str(folder), 2, save_at=2)[0]  # the next sharded save into the same directory
    assert sorted(os.listdir(folder)) == ["ckpt"], "the next save leaves nothing of the crashed one behind"
    values, state = load_on_one_process(ckpt)
    assert values == {"step": 2}
    assert_equal(state, second)


def load_damaged(root: str, name: str) -> tuple[str, bool]:
    """Save, let rank 0 flip one byte of ``name``, then load on every rank: (error, model unchanged)."""
    model, opt = sharded_model()
    train_step(model, opt, 0)
    ak.save_state(f"{root}/a", model=model, optimizer=opt)
    if ak.is_main_process():
        path = Path(root, "a", name)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    ak.wait_for_everyone()
    fresh, fresh_opt = sharded_model(seed=1)
    before = full_state(fresh, fresh_opt)
    try:
        ak.load_state(f"{root}/a", model=fresh, optimizer=fresh_opt)
    except CheckpointError as exc:
        message = str(exc)
    else:
        message = "no error"
    after = full_state(fresh, fresh_opt)
    return message, sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", ["model.dcp/__1_0.distcp", "optimizer.dcp/.metadata"])
def test_a_damaged_dcp_file_is_named_on_every_rank(pool: WorkerPool, tmp_path: Path, name: str) -> None:
    results = pool.run(load_damaged, str(tmp_path), name)
    for message, unchanged in results:
        assert f"{name} has changed bytes in piece 1 of 1" in message and "nothing was changed" in message
        assert unchanged, "the model or optimizer was changed"


def read_fails_on_rank_1(root: str) -> str:
    """Save, then load while rank 1's reads of verified shards fail (a disk error): every rank's error."""
    from accelkit._checkpoint import _sharded_load

    model, opt = sharded_model()
    ak.save_state(f"{root}/a", model=model, optimizer=opt)
    reader = _sharded_load._reader_type()  # DCP's FileSystemReader, over the checkpoint's snapshot
    read_data = reader.read_data

    def broken_read(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, "Input/output error")

    if ak.rank() == 1:
        reader.read_data = broken_read
    try:
        ak.load_state(f"{root}/a", model=model, optimizer=opt)
    except CheckpointError as exc:
        return str(exc)
    finally:
        reader.read_data = read_data
    return "no error"


def test_a_shard_read_failing_on_one_rank_fails_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    """Each rank reads its own shards without DCP's collectives: the ranks still share the outcome."""
    for message in pool.run(read_fails_on_rank_1, str(tmp_path)):
        assert "partly loaded" in message and "rank 1:" in message and "Input/output error" in message
        assert "rank 0:" not in message


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def forge(directory: Path, files: dict[str, bytes]) -> None:
    """Replace ``files`` and re-sign the manifest, as an attacker would."""
    body = json.loads((directory / "manifest.json").read_text())["body"]
    for name, data in files.items():
        (directory / name).write_bytes(data)
        body["files"][name] = {"size": len(data), "piece": _integrity.PIECE, "xxh3_128": [_integrity.digest(data)]}
    signed = _manifest.build(body["files"], body["objects"], body["values"], body["world_size"], body["sharded"])
    (directory / "manifest.json").write_bytes(signed)


def plant_bytes_payload(folder: Path, marker: Path) -> dict[str, bytes]:
    """A non-tensor item of DCP's (an optimizer hyper-parameter) pointed at a pickled payload."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # written by the test itself
    index = next(i for i in metadata.storage_data if i.fqn == "param_groups.0.lr")
    info = metadata.storage_data[index]
    shard = (folder / info.relative_path).read_bytes()
    buffer = io.BytesIO()
    torch.save(Payload(str(marker)), buffer)
    metadata.storage_data[index] = type(info)(info.relative_path, len(shard), len(buffer.getvalue()))
    return {
        f"{folder.name}/{info.relative_path}": shard + buffer.getvalue(),
        f"{folder.name}/.metadata": pickle.dumps(metadata),
    }


def test_no_code_runs_from_dcp_metadata_or_items(pool: WorkerPool, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    pool.run(run, str(tmp_path / "saved"), 1, save_at=1)
    marker, proof = tmp_path / "pwned", tmp_path / "payload-works"
    evil_metadata, evil_item, unsafe = tmp_path / "evil-metadata", tmp_path / "evil-item", tmp_path / "unsafe"
    for directory in (evil_metadata, evil_item, unsafe):
        shutil.copytree(tmp_path / "saved" / "ckpt", directory)
    forge(evil_metadata, {"model.dcp/.metadata": pickle.dumps(Payload(str(marker)))})
    forge(evil_item, plant_bytes_payload(evil_item / "optimizer.dcp", marker))
    forge(unsafe, plant_bytes_payload(unsafe / "optimizer.dcp", proof))
    with pytest.warns(UserWarning, match="single process"):  # DCP's own reader and planner run it
        dcp.load({"param_groups": [{"lr": 0.0}]}, checkpoint_id=unsafe / "optimizer.dcp")
    assert proof.exists(), "the planted item must run when DCP loads it unrestricted"

    not_metadata = tmp_path / "not-metadata"
    shutil.copytree(tmp_path / "saved" / "ckpt", not_metadata)
    forge(not_metadata, {"model.dcp/.metadata": pickle.dumps({"storage_data": {}})})
    for directory, pattern in [
        (evil_metadata, r"model\.dcp/\.metadata was refused: UnpicklingError: builtins\.exec is not allowed"),
        (not_metadata, r"model\.dcp/\.metadata was refused: it holds a dict, not DCP metadata"),
        (
            evil_item,
            r"optimizer\.dcp could not be loaded into AdamW \(nothing was changed\): ValueError: the item "
            r"param_groups\.0\.lr in __\d_0\.distcp was refused: UnpicklingError",
        ),
    ]:
        model = plain_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError, match=pattern):
            ak.load_state(directory, strict=False, model=model, optimizer=opt)
        assert not marker.exists(), f"code from {directory.name} ran"
        assert not opt.state, "the optimizer was changed"
        assert_equal(model.state_dict(), before)  # the model's shards load in place: only after every check


# --- misuse -----------------------------------------------------------------------------------


def plant_stray_file(root: str) -> Callable[[str], None]:
    def hook(label: str) -> None:
        if label == "before-file:.metadata.tmp":  # rank 0, at the end of dcp.save (on its thread: no race)
            for folder in Path(root).glob(".accelkit-tmp-*/model.dcp"):
                (folder / "stray.bin").write_bytes(b"?")

    return hook


def misuse(root: str) -> tuple[list[str], bool]:
    model, opt = sharded_model()
    messages = []
    try:
        ak.save_state(f"{root}/alone", optimizer=opt)
    except ValueError as exc:
        messages.append(str(exc))
    plain = plain_model(seed=3)
    ak.save_state(f"{root}/plain", model=plain, optimizer=torch.optim.AdamW(plain.parameters(), lr=0.05))
    ak.load_state(f"{root}/plain", model=model)  # a module's state_dict() loads into the sharded module
    loaded = all(torch.equal(model.state_dict()[k].full_tensor(), v) for k, v in plain.state_dict().items())
    try:
        ak.load_state(f"{root}/plain", model=model, optimizer=opt)
    except CheckpointError as exc:
        messages.append(str(exc))
    _storage.crash_hook = plant_stray_file(root)
    try:
        ak.save_state(f"{root}/stray", model=model)
    except CheckpointError as exc:
        messages.append(str(exc))
    finally:
        _storage.crash_hook = None
    return messages, loaded


def test_misuse_says_what_and_how_to_fix(pool: WorkerPool, tmp_path: Path) -> None:
    messages, loaded = pool.run(misuse, str(tmp_path))[0]
    assert len(messages) == 3 and loaded
    assert "optimizer=PreparedOptimizer updates sharded (DTensor) parameters, but no module was passed" in messages[0]
    assert "pass the model it optimizes too, e.g. model=model, optimizer=optimizer" in messages[0]
    assert "optimizer.pt was saved unsharded but optimizer here holds sharded (DTensor) state" in messages[1]
    assert "full_state=True" in messages[1] and "then shard them" in messages[1]
    assert "nothing was committed" in messages[2] and "stray.bin was written without a checksum" in messages[2]
    assert "full_state=True" in messages[2]
    assert not (tmp_path / "stray").exists()


def save_without_numpy(root: str) -> str:
    model, opt = sharded_model()
    numpy = sys.modules.get("numpy")
    sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` fails, as where it is not installed
    try:
        ak.save_state(f"{root}/ckpt", model=model, optimizer=opt)
    except CheckpointError as exc:
        return str(exc)
    finally:
        del sys.modules["numpy"]
        if numpy is not None:
            sys.modules["numpy"] = numpy
    return "no error"


def test_a_sharded_save_without_numpy_fails_on_every_rank_before_dcp_begins(pool: WorkerPool, tmp_path: Path) -> None:
    # DCP's object collectives call Tensor.numpy(): without numpy, rank 0 failed after its gather, rank 1 waited on.
    for message in pool.run(save_without_numpy, str(tmp_path), task_timeout=60):
        assert "nothing was committed" in message and "need numpy (Tensor.numpy())" in message
        assert "pip install numpy" in message
    assert not (tmp_path / "ckpt").exists()


def test_plain_checkpoints_never_import_dcp(tmp_path: Path) -> None:
    code = (
        "import sys, torch, accelkit as ak\n"
        f"ak.save_state({str(tmp_path / 'a')!r}, model=torch.nn.Linear(2, 1), step=1)\n"
        f"assert ak.load_state({str(tmp_path / 'a')!r}, model=torch.nn.Linear(2, 1)) == {{'step': 1}}\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
    )
    env = {**os.environ, "ACCELKIT_CPU": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- DCP's own reading ----------------------------------------------------------------------------


def test_no_module_of_accelkit_parses_archives_or_dcp_files_itself() -> None:
    """Sharded loads go through dcp.load with a FileSystemReader and a load planner of ours (DCP's extension points):
    nothing of accelkit reads zip headers or DCP's storage layout."""
    import accelkit

    root = Path(accelkit.__file__).parent
    for path in [*(root / "_checkpoint").rglob("*.py"), root / "_safe_io.py"]:
        text = path.read_text()
        for word in ("zipfile", "struct.unpack", "PK\\x03\\x04", "UntypedStorage.from_file", "storage_offsets"):
            assert word not in text, f"{path.relative_to(root.parent)} uses {word}"
