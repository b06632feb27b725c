"""Values in checkpoints: tensors among them, and ak.read_checkpoint before the model exists."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from processes import subprocess_env
from test_checkpoint import small_model

import accelkit as ak
from accelkit._checkpoint import CheckpointError
from accelkit.testing import WorkerPool


def values() -> dict[str, object]:
    generator = torch.Generator().manual_seed(3)
    return {
        "best_val_loss": torch.tensor(1.0 / 3.0, dtype=torch.float64),
        "history": [torch.randn(3, generator=generator), (torch.tensor(7), "note", None)],
        "ema": {"decay": 0.999, "shadow": torch.randn(2, 2, generator=generator).to(torch.bfloat16)},
        "model_args": {"n_layer": 2, "n_embd": 8},
        "step": 5,
    }


def assert_same(found: object, expected: object) -> None:
    """Equal, bit for bit, with the same container and tensor types (tuples stay tuples)."""
    assert type(found) is type(expected), (found, expected)
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor) and found.dtype == expected.dtype and torch.equal(found, expected)
    elif isinstance(expected, dict):
        assert isinstance(found, dict) and sorted(found) == sorted(expected)
        for key in expected:
            assert_same(found[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert isinstance(found, (list, tuple)) and len(found) == len(expected)
        for a, b in zip(found, expected, strict=True):
            assert_same(a, b)
    else:
        assert found == expected


def test_tensor_values_round_trip_bit_exact(tmp_path: Path) -> None:
    saved = values()
    ak.save_state(tmp_path / "a", model=small_model(1.0), **saved)
    assert (tmp_path / "a" / "tensor-values.pt").exists()
    loaded = ak.load_state(tmp_path / "a", model=small_model(0.0))
    assert_same(loaded, saved)
    assert loaded["history"][0] is not saved["history"][0]


def test_read_checkpoint_has_no_side_effect(tmp_path: Path) -> None:
    ak.save_state(tmp_path / "a", model=small_model(1.0), optimizer=torch.optim.SGD(small_model(1.0).parameters()))
    ak.save_state(tmp_path / "b", keep_last=None, model=small_model(2.0), **values())
    ak.reset_state()
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about what is not restored, or anything else
        info = ak.read_checkpoint(tmp_path / "b")
    assert torch.equal(torch.get_rng_state(), rng) and not ak.is_initialized(), "no RNG restored, no state created"
    assert info["model_args"] == {"n_layer": 2, "n_embd": 8} and info.step == 5 and info.world_size == 1
    assert_same(dict(info), values())
    assert info.objects == ["model"] and info.sharded == [] and info.full == []
    assert info.path == tmp_path / "b" and info.versions["torch"] == torch.__version__ and info.created_ns > 0
    with pytest.raises(KeyError, match=r"holds no value 'lr'; it holds \['best_val_loss', 'ema',"):
        info["lr"]
    assert dict(ak.read_checkpoint(tmp_path / "a")) == {}
    with pytest.raises(AttributeError, match=r"CheckpointInfo is read-only .* cannot set 'step'"):
        info.step = 6  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(info))  # sent to other processes as any record
    assert again.step == 5 and again.path == info.path
    assert_same(dict(again), values())
    plain = ak.read_checkpoint(tmp_path / "a")
    assert pickle.loads(pickle.dumps(plain)) == plain != info
    assert repr(info).startswith("CheckpointInfo(path=") and "model_args" not in repr(info), "values: by key only"


def test_read_checkpoint_checks_what_it_reads(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        ak.read_checkpoint(tmp_path)
    ak.save_state(tmp_path / "a", model=small_model(1.0), **values())
    path = tmp_path / "a" / "tensor-values.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    for read in (ak.read_checkpoint, lambda d: ak.load_state(d, model=small_model(0.0))):
        with pytest.raises(
            CheckpointError, match=r"tensor-values\.pt has changed bytes in piece 1 of 1 .* the checkpoint is damaged"
        ):
            read(tmp_path / "a")


def test_values_that_cannot_be_saved_say_why(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"best\[1\]=set \{1, 2\} cannot be saved beside tensors; values hold tensors"):
        ak.save_state(tmp_path / "a", best=[torch.ones(1), {1, 2}])
    with pytest.raises(TypeError, match=r"ema\['seen'\]=set .*cannot be saved beside tensors"):
        ak.save_state(tmp_path / "a", ema={"x": torch.ones(1), "seen": {1, 2}})
    with pytest.raises(TypeError, match=r"ema has the key 1; keys of saved values are strings"):
        ak.save_state(tmp_path / "a", ema={1: torch.ones(1)})
    assert not (tmp_path / "a").exists()


def save_values(directory: str) -> None:
    ak.save_state(directory, model=ak.prepare(small_model(1.0)), **values())


def test_values_in_a_two_process_checkpoint(pool: WorkerPool, tmp_path: Path) -> None:
    pool.run(save_values, str(tmp_path / "a"))
    assert ak.read_checkpoint(tmp_path / "a").world_size == 2
    code = (
        "import accelkit as ak\n"
        f"info = ak.read_checkpoint({str(tmp_path / 'a')!r})\n"
        "print(info['model_args']['n_layer'], ak.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert done.returncode == 0 and done.stdout.split() == ["2", "False"], done.stderr
