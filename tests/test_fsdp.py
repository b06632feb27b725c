"""strategy="fsdp": FSDP2 sharding through ak.prepare, on 2 real gloo ranks, against independent references.

The sharded workers share one module-scoped pool whose policy is ``fsdp_wrap=("Block",)`` and
``fsdp_min_params=100``, so every model here is cut into several shard units.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import _pools
from torch import nn
from torch_versions import needs_fsdp2_mean_on_cpu

import accelkit as ak
from accelkit.errors import ConfigurationError, StateError
from accelkit.testing import WorkerPool, run_distributed

pytestmark = pytest.mark.distributed
TOL = 1e-5  # fp32 sums in a different order (sharded reduce-scatter vs one process): agree to 1e-5


@pytest.fixture(scope="module")
def fsdp_pool() -> Iterator[WorkerPool]:
    with WorkerPool(2, strategy="fsdp", fsdp_wrap=("Block",), fsdp_min_params=100) as workers:
        _pools.append(workers)
        yield workers
    _pools.remove(workers)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)  # 72 parameters at width 8: a unit by class, not by size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8),  # 40 parameters: stays in the root unit
        nn.Tanh(),
        nn.Sequential(Block(8), Block(8)),  # both blocks are units; nothing left for the container
        nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 1)),  # 90 + 11: a unit only as a whole
    )


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with their own hyper-parameters, which sharding must keep."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.02}], lr=0.05, momentum=0.9)


def regression_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1)


def full_params(model: nn.Module) -> list[float]:
    """Every parameter, whole: DTensor shards are all-gathered (every rank must call it)."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in ak.unwrap(model).parameters()]
    return torch.cat([p.detach().flatten() for p in whole]).tolist()


def train(batch_size: int, steps: int, prepare_apart: bool = False) -> dict[str, Any]:
    """Trains 2 epochs with accelkit; with ``prepare_apart`` the optimizer is prepared in a later call."""
    ak.set_seed(7)
    model = make_model()
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=batch_size)
    opt = make_optimizer(model)  # over the unsharded parameters
    if prepare_apart:
        model, loader = ak.prepare(model, loader)
        opt = ak.prepare(opt)  # follows them into their shards
    else:
        model, opt, loader = ak.prepare(model, opt, loader)
    unsynced_grads = []
    for _ in range(2):
        for x, y in loader:
            with ak.accumulate(model, steps=steps):
                ak.backward(nn.functional.mse_loss(model(x).squeeze(1), y))
                if not ak.sync_gradients():
                    unsynced_grads.append(any(p.grad is not None for p in model.parameters()))
                opt.step()
                opt.zero_grad()
    return {
        "params": full_params(model),
        "lrs": [g["lr"] for g in opt.param_groups],
        "unsynced_grads": unsynced_grads,
        "unwrap_is_model": ak.unwrap(model) is model,
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
    }


def train_plain_pytorch(batch_size: int) -> list[float]:
    """The independent reference: one process, no accelkit, the global batch."""
    torch.manual_seed(7)
    model = make_model()
    opt = make_optimizer(model)
    for _ in range(2):
        for x, y in torch.utils.data.DataLoader(regression_data(), batch_size=batch_size):
            nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@pytest.mark.smoke
@needs_fsdp2_mean_on_cpu
def test_fsdp_trains_to_the_ddp_and_the_one_process_parameters(pool: WorkerPool, fsdp_pool: WorkerPool) -> None:
    expected = train_plain_pytorch(16)
    ddp = pool.run(train, 8, 1)
    fsdp = fsdp_pool.run(train, 8, 1)
    for run in (*ddp, *fsdp):
        assert run["params"] == pytest.approx(expected, abs=TOL)
        assert run["lrs"] == [0.05, 0.02]
    assert [run["param_types"] for run in fsdp] == [["DTensor"]] * 2  # really sharded
    assert all(run["unwrap_is_model"] for run in fsdp)  # fully_shard changes the class in place
    assert fsdp[0]["params"] == fsdp[1]["params"]


def test_fsdp_accumulation_matches_the_larger_batch_without_syncing_micro_steps(fsdp_pool: WorkerPool) -> None:
    expected = train_plain_pytorch(32)
    for run in fsdp_pool.run(train, 8, 2, True):  # and the optimizer prepared after its model
        assert run["params"] == pytest.approx(expected, abs=TOL)
        # Gradients stay unreduced (no sharded .grad) on every micro-step: 2 epochs x 2 micro-steps.
        assert run["unsynced_grads"] == [False] * 4


def clip_on_shards(max_norm: float) -> tuple[list[str], float, float, list[float]]:
    """Each rank feeds its own half of one batch; clip with both norm types, return norms and full grads."""
    model = ak.prepare(make_model())
    x, y = regression_data().tensors
    mine = slice(8 * ak.rank(), 8 * (ak.rank() + 1))
    ak.backward(nn.functional.mse_loss(model(x[mine]).squeeze(1), y[mine]))
    inf_norm = ak.clip_grad_norm_(model.parameters(), max_norm=1e9, norm_type=math.inf)  # nothing clipped
    two_norm = ak.clip_grad_norm_(model.parameters(), max_norm=max_norm)
    grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    return [type(inf_norm).__name__, type(two_norm).__name__], inf_norm.item(), two_norm.item(), grads.tolist()


def test_clip_grad_norm_is_the_norm_of_the_full_gradient(fsdp_pool: WorkerPool) -> None:
    model = make_model()
    x, y = regression_data().tensors
    nn.functional.mse_loss(model(x[:16]).squeeze(1), y[:16]).backward()
    grads = [p.grad for p in model.parameters()]
    expected_inf = torch.nn.utils.get_total_norm(grads, math.inf).item()
    expected_two = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).item()
    expected_grads = torch.cat([p.grad.flatten() for p in model.parameters()]).tolist()
    assert expected_two > 0.5  # so the clipping below is real
    for types, inf_norm, two_norm, clipped in fsdp_pool.run(clip_on_shards, 0.5):
        assert types == ["Tensor", "Tensor"]  # plain tensors, not DTensors
        assert inf_norm == pytest.approx(expected_inf, rel=TOL)
        assert two_norm == pytest.approx(expected_two, rel=TOL)
        assert clipped == pytest.approx(expected_grads, abs=TOL)


def shard_units_and_inference() -> tuple[list[str], list[float]]:
    from torch.distributed.fsdp import FSDPModule

    model = ak.prepare(make_model())  # alone, without an optimizer: inference
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    with torch.no_grad():
        out = model(regression_data().tensors[0][:4])
    return units, out.flatten().tolist()


def test_the_wrap_policy_picks_classes_and_sizes_bottom_up(fsdp_pool: WorkerPool) -> None:
    with torch.no_grad():
        expected = make_model()(regression_data().tensors[0][:4]).flatten().tolist()
    for units, out in fsdp_pool.run(shard_units_and_inference):
        # Blocks by class name; the head as a whole by size (101 >= 100, its Linears alone are not).
        assert units == ["", "2.0", "2.1", "3"]
        assert out == pytest.approx(expected, abs=TOL)


def misconfigured() -> list[str]:
    messages = []
    try:
        ak.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))  # no Block in it
    except ConfigurationError as exc:
        messages.append(str(exc))
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # the optimizer has state for the unsharded parameters now
    model = ak.prepare(model)
    try:
        ak.prepare(opt)
    except StateError as exc:
        messages.append(str(exc))
    return messages


def test_policy_and_order_mistakes_are_clear_errors(fsdp_pool: WorkerPool) -> None:
    for wrap_error, state_error in fsdp_pool.run(misconfigured):
        assert "fsdp_wrap names 'Block'" in wrap_error and "Linear, Sequential" in wrap_error
        assert "Adam already has state" in state_error and "before the first step" in state_error


def test_bad_policy_options_name_the_value() -> None:
    with pytest.raises(ConfigurationError, match=r"fsdp_min_params=-1\): expected an integer >= 0"):
        ak.init(strategy="fsdp", fsdp_min_params=-1)
    with pytest.raises(ConfigurationError, match=r"fsdp_wrap=\[3\]\): expected module classes or class names"):
        ak.init(strategy="fsdp", fsdp_wrap=[3])
    with pytest.raises(ConfigurationError, match=r"strategy='zero'\): expected one of 'ddp', 'fsdp', 'deepspeed'"):
        ak.init(strategy="zero")


def test_a_wrap_name_close_to_a_class_is_suggested() -> None:
    from accelkit._strategies.fsdp import select_units

    with pytest.raises(ConfigurationError, match="did you mean 'Block'"):
        select_units(make_model(), wrap=("Blok",))


def test_one_process_runs_unsharded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_STRATEGY", "fsdp")
    model = make_model()
    opt = make_optimizer(model)
    prepared, _ = ak.prepare(model, opt)
    assert ak.state().options.strategy == "fsdp"
    assert prepared is model and all(type(p) is nn.Parameter for p in model.parameters())


def fp16_overflow_on_one_rank() -> dict[str, Any]:
    from accelkit import _state

    model = make_model()
    opt = make_optimizer(model)
    model, opt = ak.prepare(model, opt)
    start = full_params(model)
    x = torch.ones(2, 4)
    ak.backward(model(x).mean() * 1e-3)  # small: the scaled fp16 gradients stay finite
    if ak.rank() == 1:  # only this rank's shard overflows: both ranks must skip the step
        next(iter(model.parameters())).grad.to_local().fill_(math.inf)
    opt.step()
    first = (opt.step_was_skipped, full_params(model) == start)
    opt.zero_grad()
    ak.backward(model(x).mean() * 1e-3)
    ak.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    scaler = _state.strategy().scaler  # type: ignore[attr-defined]
    return {
        "scaler": type(scaler).__name__,
        "scale": scaler.get_scale(),
        "first_skipped_and_unchanged": first,
        "second_skipped": opt.step_was_skipped,
        "moved": full_params(model) != start,
        "params": full_params(model),
    }


@pytest.mark.slow
def test_fp16_overflow_on_one_shard_skips_the_step_on_every_rank() -> None:
    # With CPU offload (a plain copy on a CPU device) and unsharded parameters kept after forward.
    options = {"fsdp_cpu_offload": True, "fsdp_reshard_after_forward": False}
    zero, one = run_distributed(fp16_overflow_on_one_rank, strategy="fsdp", precision="fp16", **options)
    for run in (zero, one):
        assert run["scaler"] == "ShardedGradScaler" and run["scale"] == 2.0**15  # halved once, on every rank
        assert run["first_skipped_and_unchanged"] == (True, True)
        assert not run["second_skipped"] and run["moved"]
    assert zero["params"] == one["params"]


# No optimizer here: torch 2.13 itself loads torch._dynamo, and with it FSDP, on the first optimizer built.
IMPORT_PROBE = """
import json, sys, torch
import accelkit as ak
for name in ak.__all__:
    getattr(ak, name)
model = ak.prepare(torch.nn.Linear(2, 1))
x = torch.ones(1, 2, device=ak.device())
with ak.accumulate(model, steps=2):
    ak.backward(model(x).sum())
with ak.no_sync(model):
    ak.backward(model(x).sum())
ak.clip_grad_norm_(model.parameters(), 1.0)
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("torch.distributed.fsdp", "deepspeed")))))
"""


def test_accelkit_does_not_import_fsdp_or_deepspeed_unless_sharding() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELKIT_")} | {"ACCELKIT_CONFIG_FILE": ""}
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_fsdp_on_a_torch_too_old_for_it_is_refused_naming_the_version() -> None:
    from accelkit._strategies.fsdp import refuse_old_torch

    for version, device, need in (("2.5.1", "cuda", "2.6"), ("2.8.0+cu128", "cpu", "2.9"), ("2.4.1", "cpu", "2.9")):
        with pytest.raises(
            ak.ConfigurationError, match=rf"needs PyTorch >= {need}.*this is PyTorch {re.escape(version)}"
        ):
            refuse_old_torch(version, torch.device(device))
    refuse_old_torch("2.6.0", torch.device("cuda"))
    refuse_old_torch("2.9.0", torch.device("cpu"))
