"""Full-state checkpoints of sharded models (full_state=True), ak.full_state_dict and save_pretrained under FSDP."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_sharded import assert_equal, full_state, plain_model, shard_by_hand, sharded_model, train_step
from torch import nn
from torch.utils.data import DataLoader

import accelkit as ak
from accelkit._checkpoint import CheckpointError
from accelkit.testing import WorkerPool

# --- FSDP (2 processes) -> one process -> FSDP ------------------------------------------------


def save_full(root: str) -> dict[str, torch.Tensor]:
    model, opt = sharded_model()
    for step in range(2):
        train_step(model, opt, step)
    ak.save_state(f"{root}/full", full_state=True, model=model, optimizer=opt, step=2)
    return full_state(model, opt)


def plain_run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = plain_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def load_full(root: str) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = sharded_model(seed=5)
    step = ak.load_state(f"{root}/single", strict=False, model=model, optimizer=opt)["step"]
    return step, full_state(model, opt)


def test_a_full_state_of_fsdp_loads_on_one_process_and_back(pool: WorkerPool, tmp_path: Path) -> None:
    saved = pool.run(save_full, str(tmp_path))[0]
    ckpt = tmp_path / "full"
    assert sorted(os.listdir(ckpt)) == ["manifest.json", "model.pt", "optimizer.pt", "rank-0.json", "rank-1.json"]
    body = json.loads((ckpt / "manifest.json").read_text())["body"]
    assert body["full"] == ["model", "optimizer"] and body["sharded"] == []
    names = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"].keys()
    assert sorted(names) == ["0.bias", "0.weight", "2.bias", "2.weight"], "keyed by parameter names"

    model, opt = plain_run(seed=7)  # one process, no sharding
    assert ak.load_state(ckpt, strict=False, model=model, optimizer=opt) == {"step": 2}
    assert_equal(full_state(model, opt), saved)

    train_step(model, opt, 2)  # and back: saved here, loaded sharded on two processes
    ak.save_state(tmp_path / "single", full_state=True, model=model, optimizer=opt, step=3)
    here = full_state(model, opt)
    for step, state in pool.run(load_full, str(tmp_path)):
        assert step == 3
        assert_equal(state, here)


def load_full_by_default(root: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Load the one-process checkpoint ``ROOT/single`` on two processes without ``strict``: the warnings, the state."""
    model, opt = sharded_model(seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ak.load_state(f"{root}/single", model=model, optimizer=opt)["step"] == 1
    return [str(w.message) for w in caught], full_state(model, opt)


def test_a_full_state_of_fsdp_loads_for_evaluation_on_another_world_size(pool: WorkerPool, tmp_path: Path) -> None:
    """The default loads every object of another world size and skips the per-rank state, said once."""
    saved = pool.run(save_full, str(tmp_path))[0]
    ckpt = tmp_path / "full"
    loader = ak.prepare(DataLoader(range(8), batch_size=2))  # this job's loader keeps its own position
    next(iter(loader))
    position = loader.state_dict()

    model, opt = plain_run(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"saved by 2 processes, this job has 1, and strict=True asks for"):
        ak.load_state(ckpt, strict=True, model=model)  # a resume that needs the per-rank state: refused
    assert_equal(model.state_dict(), before)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ak.load_state(ckpt, model=model) == {"step": 2}  # evaluation: the model alone
    messages = [str(w.message) for w in caught]
    skipped = [m for m in messages if "per-rank state" in m]
    assert len(skipped) == 1 and caught[messages.index(skipped[0])].filename == __file__, messages
    assert "saved by 2 processes, this job has 1" in skipped[0]
    assert "rank-0.json to rank-1.json: RNG states, grad scaler, dataloader positions" in skipped[0]
    assert any("also holds optimizer, which this call does not restore" in m for m in messages), messages
    assert_equal(model.state_dict(), {k: saved[k] for k in before})
    assert torch.equal(torch.get_rng_state(), rng) and loader.state_dict() == position, "per-rank state skipped"

    model, opt = plain_run(seed=8)  # the optimizer too, and the same call on two processes: one warning, rank 0's
    with pytest.warns(UserWarning, match="per-rank state"):
        assert ak.load_state(ckpt, model=model, optimizer=opt) == {"step": 2}
    assert_equal(full_state(model, opt), saved)
    train_step(model, opt, 2)
    ak.save_state(tmp_path / "single", full_state=True, model=model, optimizer=opt, step=1)
    here = full_state(model, opt)
    (warned, state_0), (quiet, state_1) = pool.run(load_full_by_default, str(tmp_path))
    assert [m for m in warned if "per-rank state" in m] and "saved by 1 processes, this job has 2" in warned[0]
    assert "(rank-0.json: RNG states" in warned[0] and quiet == [], "said once, on the main process"
    assert_equal(state_0, here)
    assert_equal(state_1, here)

    with pytest.warns(UserWarning, match=r"strict=False\): rank 0 skipped .*rank-0\.json"):  # as before
        ak.load_state(ckpt, strict=False, model=model, optimizer=opt)
    del loader


def test_full_state_in_one_process_needs_the_model_beside_the_optimizer(tmp_path: Path) -> None:
    model, opt = plain_run(seed=0)
    with pytest.raises(ValueError, match=r"optimizer=AdamW updates .* no module was passed.*model=model, optimizer"):
        ak.save_state(tmp_path / "a", full_state=True, optimizer=opt)
    with pytest.raises(TypeError, match=r"full_state='yes'; expected True or False"):
        ak.save_state(tmp_path / "a", full_state="yes", model=model)  # type: ignore[arg-type]
    ak.save_state(tmp_path / "a", full_state=True, model=model, optimizer=opt)
    fresh, fresh_opt = plain_run(seed=1)
    with pytest.raises(ValueError, match="pass the model it optimizes too"):
        ak.load_state(tmp_path / "a", optimizer=fresh_opt)
    ak.load_state(tmp_path / "a", model=fresh, optimizer=fresh_opt)
    assert_equal(fresh.state_dict(), model.state_dict())


# --- ak.full_state_dict and save_pretrained ---------------------------------------------------


class TinyLM(nn.Module):
    """A transformers-style model: tied input and output embeddings, and a save_pretrained like theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.block(self.embed(ids))))

    def save_pretrained(self, out: str, is_main_process: bool = True, state_dict: dict[str, Any] | None = None) -> None:
        """As transformers does: tied weights written once (found by their shared storage), safetensors."""
        from safetensors.torch import save_file

        state = self.state_dict() if state_dict is None else state_dict
        storages: dict[Any, str] = {}
        for name in list(state):
            key = (state[name].untyped_storage().data_ptr(), state[name].storage_offset())
            if key in storages:
                del state[name]  # tied to storages[key]
            else:
                storages[key] = name
        if is_main_process:
            os.makedirs(out, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"))


def tiny_lm_run(out: str) -> tuple[dict[str, torch.Tensor], str]:
    """FSDP, a few steps, then save_pretrained both ways: (the full weights by hand, the error without state_dict)."""
    torch.manual_seed(0)
    model = TinyLM()
    shard_by_hand(model.block, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.arange(8).reshape(2, 4) + ak.rank()
    for _ in range(2):
        ak.backward(model(ids).logsumexp(-1).mean())
        opt.step()
        opt.zero_grad()
    try:
        ak.unwrap(model).save_pretrained(f"{out}-bare", is_main_process=ak.is_main_process())
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    state = ak.full_state_dict(model)
    if ak.is_main_process():
        assert state["embed.weight"] is state["lm_head.weight"], "tied weights stay one tensor"
    else:
        assert state == {}
    ak.unwrap(model).save_pretrained(out, is_main_process=ak.is_main_process(), state_dict=state)
    by_hand = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return by_hand, error


def test_save_pretrained_of_an_fsdp_model_with_full_state_dict(pool: WorkerPool, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    (by_hand, error), _ = pool.run(tiny_lm_run, str(tmp_path / "out"))
    assert error != "no error", "unwrap(model).save_pretrained alone fails under FSDP (the reason for full_state_dict)"
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(weights) == ["block.bias", "block.weight", "embed.weight"], "the tied lm_head is written once"
    fresh = TinyLM()
    fresh.load_state_dict(weights, strict=False)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert_equal(dict(fresh.named_parameters()), {k: v for k, v in by_hand.items() if k != "lm_head.weight"})


def test_full_state_dict_without_sharding_is_the_unwrapped_state_dict() -> None:
    model = ak.prepare(TinyLM())
    state = ak.full_state_dict(model)
    assert list(state) == list(ak.unwrap(model).state_dict())
    with torch.no_grad():
        state["embed.weight"][0, 0] = 123.0
    assert state["lm_head.weight"][0, 0] == 123.0, "tied weights share their storage, as in state_dict()"
    with pytest.raises(TypeError, match=r"full_state_dict\(model=dict\): expected a torch.nn.Module"):
        ak.full_state_dict({})  # type: ignore[arg-type]


# --- ak.save_model of a sharded model with tied weights ---------------------------------------


def export_tiny_lm(out: str) -> dict[str, torch.Tensor]:
    """FSDP, one step, then ak.save_model; the full weights by hand (every rank)."""
    torch.manual_seed(0)
    model = TinyLM()
    shard_by_hand(model.block, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ak.backward(model(torch.arange(8).reshape(2, 4) + ak.rank()).logsumexp(-1).mean())
    opt.step()
    assert ak.save_model(model, out).name == "model.safetensors"
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def test_save_model_of_an_fsdp_model_with_tied_weights(pool: WorkerPool, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model, save_model

    by_hand, _ = pool.run(export_tiny_lm, str(tmp_path / "fsdp"))
    path = tmp_path / "fsdp" / "model.safetensors"
    weights = load_file(path)
    assert sorted(weights) == ["block.bias", "block.weight", "embed.weight"], "the tied lm_head is written once"
    assert_equal(weights, {k: v for k, v in by_hand.items() if k != "lm_head.weight"})
    fresh = TinyLM()
    load_model(fresh, path)  # as transformers loads it: the tie made again
    assert fresh.lm_head.weight is fresh.embed.weight
    assert_equal(dict(fresh.named_parameters(remove_duplicate=False)), by_hand)

    plain = TinyLM()  # the file an unsharded model writes (save_model of DDP or one process): the same
    plain.load_state_dict({k: v for k, v in by_hand.items() if k != "lm_head.weight"}, strict=False)
    save_model(plain, str(tmp_path / "plain.safetensors"))
    with safe_open(path, "pt") as ours, safe_open(tmp_path / "plain.safetensors", "pt") as theirs:
        assert ours.metadata() == theirs.metadata() == {"lm_head.weight": "embed.weight"}
    assert_equal(load_file(tmp_path / "plain.safetensors"), weights)
