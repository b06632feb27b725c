"""Checkpoints of a model on a device mesh: saved on dp_shard=2 x tp=2, resumed exactly, loaded on other meshes.

The state is DTensors on the 2-D mesh; DCP saves each rank's shards and reshards them on load:
onto dp_shard=4, onto dp_replicate=2 x dp_shard=2, onto one process. ``full_state=True`` and
``ak.save_model`` write plain tensors. One pool of 4 workers for the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mesh_models import PLAN, full, loss_of, make_net, tokens
from torch_versions import needs_fsdp2_mean_on_cpu
from weights import load_weights

import accelkit as ak
from accelkit.testing import WorkerPool

pytestmark = [pytest.mark.distributed, needs_fsdp2_mean_on_cpu]

SAVED_ON = {"dp_shard": 2, "tp": 2}


def prepared(sizes: dict[str, int]) -> tuple[Any, Any, Any]:
    ak.init(fsdp_wrap=("Block",), **sizes)  # type: ignore[arg-type]
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(tokens(), batch_size=2, shuffle=True)
    return ak.prepare(model, opt, data, tp_plan=PLAN)


def state_of(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, whole (every rank must call it)."""
    out = {}
    for name, param in ak.unwrap(model).named_parameters():
        out[name] = full(param)
        for key, value in sorted(opt.state[param].items()):
            out[f"{name}.{key}"] = full(value)
    return out


def train(root: str, stop: int, save_at: int = 0, resume: bool = False, **save: Any) -> dict[str, torch.Tensor]:
    ak.set_seed(5)
    model, opt, loader = prepared(SAVED_ON)
    step = ak.load_state(f"{root}/ckpt", model=model, optimizer=opt)["step"] if resume else 0
    for x, y in loader:  # a resumed loader starts where the saved one was
        if step == stop:
            break
        ak.backward(loss_of(model, x, y))
        opt.step()
        opt.zero_grad()
        step += 1
        if step == save_at:
            ak.save_state(f"{root}/ckpt", model=model, optimizer=opt, step=step, **save)
            if save.get("full_state"):
                ak.save_model(model, f"{root}/export")
    return state_of(model, opt)


def load_on(root: str, sizes: dict[str, int]) -> dict[str, Any]:
    model, opt, _ = prepared(sizes)  # the loader too: its position is in the checkpoint
    values = ak.load_state(f"{root}/ckpt", model=model, optimizer=opt)
    return {"values": values, "state": state_of(model, opt), "mesh": str(ak.mesh())}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def saved(pool4: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint saved after 2 steps on dp_shard=2 x tp=2, and the state it holds."""
    root = tmp_path_factory.mktemp("mesh")
    state = pool4.run(train, str(root), 2, save_at=2)[0]
    return root, state


def test_resume_on_the_same_mesh_is_bit_exact(pool4: WorkerPool, saved: tuple[Path, Any], tmp_path: Path) -> None:
    root, _ = saved
    reference = pool4.run(train, str(tmp_path), 4)
    resumed = pool4.run(train, str(root), 4, resume=True)
    for rank in range(4):
        assert_equal(resumed[rank], reference[rank])
    assert "blocks.0.attn.q.weight.exp_avg" in reference[0]
    files = sorted(p.name for p in (root / "ckpt" / "model.dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]


@pytest.mark.parametrize("sizes", [{"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2}], ids=str)
def test_a_mesh_checkpoint_loads_onto_another_mesh(
    pool4: WorkerPool, saved: tuple[Path, Any], sizes: dict[str, int]
) -> None:
    root, state = saved
    for run in pool4.run(load_on, str(root), sizes):
        assert run["values"] == {"step": 2}
        assert_equal(run["state"], state)
    names = ", ".join(f"{k}={v}" for k, v in sizes.items())
    assert f"({names})" in run["mesh"]


def test_a_mesh_checkpoint_loads_on_one_process(saved: tuple[Path, Any]) -> None:
    root, state = saved
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    assert ak.load_state(root / "ckpt", strict=False, model=model, optimizer=opt) == {"step": 2}
    assert_equal(state_of(model, opt), state)


def test_full_state_and_save_model_write_plain_tensors(pool4: WorkerPool, tmp_path: Path) -> None:
    state = pool4.run(train, str(tmp_path), 1, save_at=1, full_state=True)[0]
    assert not (tmp_path / "ckpt" / "model.dcp").exists(), "consolidated, not sharded"
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    assert ak.load_state(tmp_path / "ckpt", strict=False, model=model, optimizer=opt) == {"step": 1}
    assert_equal(state_of(model, opt), state)
    exported = next(p for p in (tmp_path / "export").iterdir() if p.suffix in (".safetensors", ".bin"))
    weights = load_weights(exported)
    assert all(type(t) is torch.Tensor for t in weights.values())
    assert_equal(weights, {k: v for k, v in state.items() if k in dict(model.named_parameters())})
