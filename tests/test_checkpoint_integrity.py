"""Damage of any kind to a real checkpoint is refused, naming the file, before anything is loaded; and loads
that race saves into the same directory load one whole checkpoint or say it was replaced.

Each property test damages a copy of a checkpoint saved once per module (plain, sharded by two processes,
saved in the background) and loads the copy into fresh objects: the load must raise ``CheckpointError``
naming the damaged file, and the objects (and the RNG) must be as they were.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from integrity_race_script import filled_with, make
from processes import subprocess_env
from test_checkpoint_sharded import full_state
from torch import nn

import accelkit as ak
from accelkit._checkpoint import _integrity
from accelkit.testing import WorkerPool

# --- what the messages say --------------------------------------------------------------------

MANIFEST = "manifest.json"
CHANGED = "piece"  # a file whose bytes changed: "... has changed bytes in piece 2 of 5 (bytes 4096 to 8191) ..."
SPAN = re.compile(r"\(bytes (\d+) to (\d+)\)")  # the piece's byte range, when the message gives it
RESIZED = "bytes but the manifest says"  # a file cut short or grown
OTHER = "verifies"  # "/x/step-1 verifies: load it instead ..." or "no other checkpoint in /x verifies ..."
NONE_OTHER = "no other checkpoint in"
GONE = re.compile(r"(replaced|removed) while it was (being )?loaded")  # a save or keep_last got there first
# keep_last pruned what latest_checkpoint named before the load began:
PRUNED = "does not exist (never saved, or removed: keep_last prunes"
SMALL_PIECE = 4096  # the plain checkpoints are hashed in pieces of this size: their files have several

# One hypothesis setting for the property tests: each example copies a small checkpoint and loads it. The
# autouse ``hygiene`` fixture is function-scoped; it wraps the whole test, which is what it is for.
DAMAGE = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- the objects and their state --------------------------------------------------------------


def net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))  # 18 KB of weights: many 512-byte sectors


def train_step(model: nn.Module, opt: Any, seed: int, backward: Callable[[torch.Tensor], None]) -> None:
    data = torch.Generator().manual_seed(seed)
    backward(F.mse_loss(model(torch.randn(8, 64, generator=data)), torch.randn(8, 8, generator=data)))
    opt.step()
    opt.zero_grad()


def plain_objects(seed: int) -> dict[str, Any]:
    """A model, its Adam after a step (so it has state) and a scheduler that stepped."""
    model = net(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_step(model, opt, seed, lambda loss: loss.backward())
    sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def unsharded_objects(seed: int) -> dict[str, Any]:
    """The plain counterpart of the sharded run: the same model and AdamW, with a state of its own."""
    model = net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    train_step(model, opt, seed, lambda loss: loss.backward())
    return {"model": model, "optimizer": opt}


def copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(v) for v in value)
    return copy.deepcopy(value)


def record(objects: dict[str, Any]) -> dict[str, Any]:
    """Every object's ``state_dict()``, copied, and the RNG (which a load restores too)."""
    return {**{name: copied(obj.state_dict()) for name, obj in objects.items()}, "rng": torch.get_rng_state()}


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` hold the same values, tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(repr, a)) == sorted(map(repr, b)), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, type(a)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def save_sharded(directory: str) -> dict[str, torch.Tensor]:
    """On each worker: ``fully_shard`` the model (by hand, onto ``ak.device()``), train a step, save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = net(0)
    mesh = init_device_mesh(ak.device().type, (ak.world_size(),))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    opt = ak.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
    train_step(model, opt, 100 + ak.rank(), ak.backward)
    ak.save_state(directory, model=model, optimizer=opt, step=1)
    return full_state(model, opt)


# --- the checkpoints, saved once --------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    path: Path
    fresh: Callable[[], dict[str, Any]]  # objects of the same kinds, each with a state of its own
    strict: bool = True  # False for a checkpoint of 2 processes loaded in this one


class Checkpoints(dict[str, tuple[Saved, Any]]):
    """Checkpoints by kind, each with the state it holds; short in hypothesis' reports."""

    def __repr__(self) -> str:
        return f"Checkpoints({', '.join(str(saved.path) for saved, _ in self.values())})"


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Two checkpoints of the same objects (steps 1 and 2, hashed in small pieces) and one saved in the background,
    with the state each holds."""
    root = tmp_path_factory.mktemp("plain")
    out = Checkpoints()
    objects = plain_objects(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_integrity, "PIECE", SMALL_PIECE, raising=False)
        for step in (1, 2):
            if step == 2:
                train_step(objects["model"], objects["optimizer"], 7, lambda loss: loss.backward())
                objects["scheduler"].step()
            mean = torch.full((4,), float(step))  # a value holding a tensor: tensor-values.pt
            ak.save_state(root / "pair" / f"step-{step}", **objects, step=step, mean=mean)
            out[f"step-{step}"] = (Saved(root / "pair" / f"step-{step}", lambda: plain_objects(5)), record(objects))
    objects = plain_objects(3)
    ak.save_state(root / "background" / "step-1", blocking=False, **objects, step=1)
    out["background"] = (Saved(root / "background" / "step-1", lambda: plain_objects(5)), record(objects))
    ak.wait_for_checkpoint()
    ak.reset_state()
    return out


@pytest.fixture(scope="module")
def sharded(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """A checkpoint of a ``fully_shard``-ed model and its optimizer, saved by 2 processes; rank 0's full state."""
    directory = tmp_path_factory.mktemp("sharded") / "step-1"
    state = pool.run(save_sharded, str(directory))[0]
    return Checkpoints(sharded=(Saved(directory, lambda: unsharded_objects(5), strict=False), state))


def files_of(directory: Path) -> list[str]:
    """Every file of the checkpoint in ``directory``, relative to it (``model.dcp/.metadata`` included)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


# --- damage -----------------------------------------------------------------------------------

Draw = Callable[[st.SearchStrategy[Any]], Any]
# The bit of an 8-byte word (little-endian) to flip: often a sign bit (63; 31, that of a 4-byte word) or an
# exponent bit (float64: 52-62; float32: 23-30 and 55-62), else any.
WORD_BITS = st.one_of(st.sampled_from([63, 31, 62, 30, 55, 52, 23]), st.integers(0, 63))


def flipped(data: bytes, bits: list[int]) -> bytes:
    """``data`` with each bit of ``bits`` (a bit index in the file: byte * 8 + bit) flipped."""
    out = bytearray(data)
    for bit in bits:
        out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def two_distinct(draw: Draw, n: int) -> tuple[int, int]:
    i = draw(st.integers(0, n - 1))
    j = draw(st.integers(0, n - 2))
    return i, j + (j >= i)


def swapped(data: bytes, i: int, j: int) -> bytes:
    """``data`` with its 8-byte words ``i`` and ``j`` swapped."""
    out = bytearray(data)
    out[8 * i : 8 * i + 8], out[8 * j : 8 * j + 8] = data[8 * j : 8 * j + 8], data[8 * i : 8 * i + 8]
    return bytes(out)


def flip_a_bit(draw: Draw, data: bytes) -> bytes:
    return flipped(data, [draw(st.integers(0, 8 * len(data) - 1))])


def flip_a_bit_of_two_words(draw: Draw, data: bytes) -> bytes:
    """The same bit of two different 8-byte words: changes that cancel in a sum of the words."""
    i, j = two_distinct(draw, len(data) // 8)
    bit = draw(WORD_BITS)
    return flipped(data, [64 * i + bit, 64 * j + bit])


def swap_words_in_a_sector(draw: Draw, data: bytes) -> bytes:
    sector = draw(st.integers(0, len(data) // 512 - 1))
    i, j = two_distinct(draw, 64)
    return swapped(data, 64 * sector + i, 64 * sector + j)


def swap_words_across_sectors(draw: Draw, data: bytes) -> bytes:
    s, t = two_distinct(draw, len(data) // 512)
    return swapped(data, 64 * s + draw(st.integers(0, 63)), 64 * t + draw(st.integers(0, 63)))


def copy_a_sector(draw: Draw, data: bytes) -> bytes:
    s, t = two_distinct(draw, len(data) // 512)
    return data[: 512 * t] + data[512 * s : 512 * s + 512] + data[512 * t + 512 :]


def zero_a_range(draw: Draw, data: bytes) -> bytes:
    start = draw(st.integers(0, len(data) - 1))
    length = draw(st.integers(1, min(len(data) - start, 2048)))
    return data[:start] + bytes(length) + data[start + length :]


def truncate(draw: Draw, data: bytes) -> bytes:
    return data[: draw(st.integers(0, len(data) - 1))]


def grow(draw: Draw, data: bytes) -> bytes:
    tail = st.sampled_from([b"\n", b" ", b"\r\n", b"\t", b"\0", bytes(512)])
    return data + draw(st.one_of(tail, st.binary(min_size=1, max_size=600)))


# Each damage and the smallest file it applies to.
DAMAGES: dict[Callable[[Draw, bytes], bytes], int] = {
    flip_a_bit: 1,
    flip_a_bit_of_two_words: 16,
    swap_words_in_a_sector: 512,
    swap_words_across_sectors: 1024,
    copy_a_sector: 1024,
    zero_a_range: 1,
    truncate: 1,
    grow: 0,
}


def assert_refused(saved: Saved, copy: Path, name: str, old: bytes, new: bytes) -> str:
    """Loading ``copy`` (its ``name`` now ``new`` instead of ``old``) raises CheckpointError naming the file;
    fresh objects are not changed. The message."""
    objects = saved.fresh()
    before = record(objects)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strict=False says what it skips on the way to the damage
        with pytest.raises(ak.CheckpointError) as caught:
            ak.load_state(copy, strict=saved.strict, **objects)
    message = str(caught.value)
    assert str(copy / name) in message, message
    assert OTHER in message, message
    if name != MANIFEST:
        if len(new) != len(old):
            assert RESIZED in message, message
        else:
            assert CHANGED in message, message
            first = next(i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
            span = SPAN.search(message)
            if span:  # the piece named holds the first changed byte
                assert int(span[1]) <= first <= int(span[2]), (first, message)
    assert_same(record(objects), before, "the fresh objects (nothing may be applied)")
    return message


def damage_and_load(saved: Saved, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / saved.path.name
        shutil.copytree(saved.path, copy)
        name = data.draw(st.sampled_from(files_of(copy)), label="file")
        old = (copy / name).read_bytes()
        applicable = [damage for damage, smallest in DAMAGES.items() if len(old) >= smallest]
        damage = data.draw(st.sampled_from(applicable), label="damage")
        new = damage(data.draw, old)
        assume(new != old)
        (copy / name).write_bytes(new)
        assert_refused(saved, copy, name, old, new)


# --- the intact copies load (so that the tests above can fail) --------------------------------


@pytest.mark.parametrize("kind", ["step-1", "step-2", "background"])
def test_an_intact_copy_of_a_plain_checkpoint_loads_what_was_saved(plain: Checkpoints, kind: str) -> None:
    saved, state = plain[kind]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / saved.path.name
        shutil.copytree(saved.path, copy)
        objects = saved.fresh()
        with pytest.raises(AssertionError):  # the fresh objects differ from the saved ones
            assert_same(record(objects), state)
        values = ak.load_state(copy, **objects)
    assert_same(record(objects), state)
    if kind == "background":
        assert values == {"step": 1}
        return
    step = int(kind[-1])
    assert values.keys() == {"step", "mean"} and values["step"] == step
    assert torch.equal(values["mean"], torch.full((4,), float(step)))
    files = json.loads((saved.path / MANIFEST).read_text())["body"]["files"]
    assert "tensor-values.pt" in files
    assert max(len(v) for v in files["model.pt"].values() if isinstance(v, list)) > 1, "hashed in several pieces"


@pytest.mark.distributed
@pytest.mark.parametrize("eager", [64, 1], ids=["files opened with the manifest", "shards opened when read"])
def test_an_intact_copy_of_a_sharded_checkpoint_loads_on_one_process(
    sharded: Checkpoints, eager: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond _EAGER listed files (a job of many ranks), DCP's shard files are opened when first read."""
    from accelkit._checkpoint import _snapshot

    monkeypatch.setattr(_snapshot, "_EAGER", eager)
    saved, state = sharded["sharded"]
    assert sorted(files_of(saved.path)) == sorted(
        [MANIFEST, "rank-0.json", "rank-1.json"]
        + [f"{n}.dcp/{f}" for n in ("model", "optimizer") for f in (".metadata", "__0_0.distcp", "__1_0.distcp")]
    )
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / saved.path.name
        shutil.copytree(saved.path, copy)
        objects = saved.fresh()
        assert not torch.equal(objects["model"][0].weight, state["0.weight"])
        with pytest.warns(UserWarning, match="strict=False"):
            assert ak.load_state(copy, strict=False, **objects) == {"step": 1}
    loaded = full_state(objects["model"], objects["optimizer"])
    assert sorted(loaded) == sorted(state)
    for key in state:
        assert_same(loaded[key], state[key], key)


# --- damage of every kind ---------------------------------------------------------------------


@DAMAGE
@given(data=st.data())
def test_damage_to_a_plain_checkpoint_is_refused_and_nothing_loads(plain: Checkpoints, data: st.DataObject) -> None:
    damage_and_load(plain["step-1"][0], data)


@settings(DAMAGE, max_examples=40)
@given(data=st.data())
def test_damage_to_a_checkpoint_saved_in_the_background_is_refused(plain: Checkpoints, data: st.DataObject) -> None:
    damage_and_load(plain["background"][0], data)


@pytest.mark.distributed
@DAMAGE
@given(data=st.data())
def test_damage_to_a_sharded_checkpoint_is_refused_on_one_process(sharded: Checkpoints, data: st.DataObject) -> None:
    damage_and_load(sharded["sharded"][0], data)


@settings(DAMAGE, max_examples=30)
@given(kind=st.sampled_from(["step-1", "background"]), tail=st.one_of(
    st.sampled_from([b"\n", b" ", b"\r\n", b"\t", b"\n\n", b"\0", b"{}"]), st.binary(min_size=1, max_size=64)
))  # fmt: skip
def test_bytes_appended_to_the_manifest_are_refused(plain: Checkpoints, kind: str, tail: bytes) -> None:
    saved = plain[kind][0]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / saved.path.name
        shutil.copytree(saved.path, copy)
        old = (copy / MANIFEST).read_bytes()
        (copy / MANIFEST).write_bytes(old + tail)
        assert_refused(saved, copy, MANIFEST, old, old + tail)


@settings(DAMAGE, max_examples=40)
@given(data=st.data())
def test_a_file_of_another_checkpoint_of_the_same_objects_is_refused(plain: Checkpoints, data: st.DataObject) -> None:
    into, source = data.draw(st.permutations(["step-1", "step-2"]), label="into, from")
    saved, other = plain[into][0], plain[source][0]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / saved.path.name
        shutil.copytree(saved.path, copy)
        name = data.draw(st.sampled_from(files_of(copy)), label="file")
        old, new = (copy / name).read_bytes(), (other.path / name).read_bytes()
        assume(new != old)
        (copy / name).write_bytes(new)
        if name != MANIFEST:
            assert_refused(saved, copy, name, old, new)
            return
        # The other checkpoint's manifest is whole: it is the files it no longer describes that are named.
        objects = saved.fresh()
        before = record(objects)
        with pytest.raises(ak.CheckpointError) as caught:
            ak.load_state(copy, **objects)
        message = str(caught.value)
        assert any(str(copy / n) in message for n in files_of(copy) if n != MANIFEST), message
        assert OTHER in message and (CHANGED in message or RESIZED in message), message
        assert_same(record(objects), before)


# --- what to load instead ---------------------------------------------------------------------


def test_a_damaged_checkpoint_names_an_older_one_beside_it_that_verifies(plain: Checkpoints) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for kind in ("step-1", "step-2"):
            shutil.copytree(plain[kind][0].path, root / kind)
        path = root / "step-2" / "model.pt"
        old = path.read_bytes()
        new = flipped(old, [8 * (len(old) // 2) + 3])
        path.write_bytes(new)
        assert ak.latest_checkpoint(root) == root / "step-2", "its size is right: only its checksums tell"
        message = assert_refused(plain["step-2"][0], root / "step-2", "model.pt", old, new)
        assert f"{root / 'step-1'} {OTHER}" in message, message
        assert NONE_OTHER not in message, message
        objects = plain_objects(5)  # the one it names loads
        ak.load_state(root / "step-1", **objects)
        assert_same(record(objects), plain["step-1"][1])


def test_when_every_checkpoint_beside_it_is_damaged_the_message_says_none_verifies(plain: Checkpoints) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        damaged = {}
        for kind, word in (("step-1", 100), ("step-2", 3000)):
            shutil.copytree(plain[kind][0].path, root / kind)
            path = root / kind / "optimizer.pt"
            old = path.read_bytes()
            damaged[kind] = old, flipped(old, [64 * word + 63])
            path.write_bytes(damaged[kind][1])
        message = assert_refused(plain["step-2"][0], root / "step-2", "optimizer.pt", *damaged["step-2"])
        assert f"{NONE_OTHER} {root}" in message, message
        assert f"{root / 'step-1'} {OTHER}" not in message, message


# --- the reproducer ---------------------------------------------------------------------------


def test_two_sign_bits_flipped_4900_words_apart_are_found(tmp_path: Path) -> None:
    """The damage that a sum of 8-byte words missed: bit 63 flipped in two words, one set and one clear."""
    torch.manual_seed(0)
    model = nn.Linear(512, 512)
    ak.save_state(tmp_path / "d", model=model)
    path = tmp_path / "d" / "model.pt"
    data = path.read_bytes()
    weight = bytes(model.weight.detach().contiguous().view(torch.uint8).flatten().tolist())
    at = data.find(weight)
    assert at >= 0 and at % 8 == 0, "the weights are stored whole, aligned"
    words = [at // 8 + 100, at // 8 + 100 + 4900]
    signs = [data[8 * w + 7] >> 7 for w in words]
    if signs[0] == signs[1]:  # one sign set and one clear: the flips cancel in a sum
        words[1] += next(k for k in range(1, 1000) if data[8 * (words[1] + k) + 7] >> 7 != signs[0])
    damaged = flipped(data, [64 * w + 63 for w in words])
    path.write_bytes(damaged)
    m2 = nn.Linear(512, 512)
    before = record({"model": m2})
    with pytest.raises(ak.CheckpointError) as caught:
        ak.load_state(tmp_path / "d", model=m2)
    assert str(path) in str(caught.value) and CHANGED in str(caught.value), caught.value
    assert_same(record({"model": m2}), before)


# --- loads against saves into the same directory ----------------------------------------------

SCRIPT = Path(__file__).with_name("integrity_race_script.py")


def race(
    root: str, log: Path, mode: str, target: Callable[[], Path | str | None], seconds: float = 3.0
) -> Counter[str]:
    """Load what ``target()`` names over and over for ``seconds`` while a child process saves under ``root`` (a
    path or a URL), its output in ``log``; the outcomes.

    Every load loads one save whole (all values that save's number) or raises CheckpointError leaving the
    objects as they were; anything else fails the test, saying how many loads went before.
    """
    with open(log, "wb") as out:
        child = subprocess.Popen(
            [sys.executable, str(SCRIPT), root, mode, "120"], env=subprocess_env(), stdout=out, stderr=out
        )
    outcomes: Counter[str] = Counter()
    try:
        deadline = time.monotonic() + 60
        while ak.latest_checkpoint(root) is None:
            assert child.poll() is None, f"the saver exited: {log.read_text()}"
            assert time.monotonic() < deadline, "the saver wrote no checkpoint in 60 s"
            time.sleep(0.05)
        model, opt = make()
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(-1.0)
                for tensor in opt.state[param].values():
                    tensor.fill_(-1.0)
        last, steps = -1.0, set()
        end = time.monotonic() + seconds
        for n in range(500):
            if time.monotonic() > end:
                break
            path = target()
            if path is None:
                outcomes["no checkpoint found"] += 1
                continue
            try:
                values = ak.load_state(path, model=model, optimizer=opt)
            except ak.CheckpointError as exc:
                message = str(exc)
                outcomes["refused: " + ("replaced or removed" if GONE.search(message) else message[:80])] += 1
                found = filled_with(model, opt)
                assert all(v == [last] for v in found.values()), f"load {n} failed but changed the objects: {found}"
                assert str(path) in message, message
                assert "damaged" not in message, f"load {n}: a checkpoint being replaced is not damaged: {message}"
                assert GONE.search(message) or (mode == "prune" and PRUNED in message), f"load {n}: {message}"
                continue
            except Exception as exc:
                pytest.fail(f"load {n} of {path} raised {type(exc).__name__}: {exc} (before it: {dict(outcomes)})")
            found = filled_with(model, opt)
            step = float(values["step"])
            mixed = {k: v for k, v in found.items() if v != [step]}
            assert not mixed, f"load {n} returned step {step:g} but loaded {mixed} (before it: {dict(outcomes)})"
            outcomes["loaded"] += 1
            last = step
            steps.add(step)
        outcomes["distinct steps loaded"] = len(steps)
    finally:
        child.kill()
        child.wait()
    return outcomes


@pytest.mark.slow
def test_loads_while_saves_replace_the_checkpoint_load_one_whole_save(tmp_path: Path) -> None:
    outcomes = race(str(tmp_path), tmp_path / "saver.log", "same", lambda: tmp_path / "ckpt")
    print(dict(outcomes))
    assert outcomes["loaded"] >= 3, outcomes
    assert outcomes["distinct steps loaded"] >= 2, f"no save replaced the checkpoint during the loads: {outcomes}"


@pytest.mark.slow
def test_loads_of_the_latest_while_keep_last_prunes_it_load_one_whole_save(tmp_path: Path) -> None:
    outcomes = race(str(tmp_path), tmp_path / "saver.log", "prune", lambda: ak.latest_checkpoint(tmp_path))
    print(dict(outcomes))
    assert outcomes["loaded"] >= 3, outcomes
    assert outcomes["distinct steps loaded"] >= 2, f"no save pruned the checkpoint during the loads: {outcomes}"


def ranks_read(which: str) -> str:
    """Every rank's outcome of one load-state exchange where each rank read ``which`` checkpoint."""
    from accelkit._checkpoint._agree import Agreement

    read = f"saved at {ak.rank() if which == 'different' else 0} ns"
    try:
        return Agreement.here("accelkit.load_state('ckpt')").each_same("nothing was changed", lambda: read, str)
    except ak.CheckpointError as exc:
        return str(exc)


@pytest.mark.distributed
def test_ranks_that_read_different_checkpoints_all_refuse_to_apply_them(pool: WorkerPool) -> None:
    """A save may replace the directory between two ranks' reads: no rank applies what the others did not read."""
    assert pool.run(ranks_read, "same") == ["saved at 0 ns"] * 2
    for message in pool.run(ranks_read, "different"):
        assert "the ranks read different checkpoints (it was replaced while they read it)" in message
        assert "rank 0: saved at 0 ns" in message and "rank 1: saved at 1 ns" in message
