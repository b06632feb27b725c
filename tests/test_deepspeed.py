"""strategy="deepspeed": the missing-package error, the "auto" config filling, and real ZeRO runs.

The ZeRO runs need DeepSpeed (``pip install deepspeed``; they are skipped without it): stages
1 to 3 on 2 gloo CPU ranks through DeepSpeed's CPU accelerator, against a plain one-process
reference, and ZeRO-2 on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accelkit as ak
from accelkit._strategies.deepspeed import DEFAULT_CONFIG, fill_auto, read_deepspeed_config, set_defaults
from accelkit.errors import ConfigurationError

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
AUTO: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3},
}


def fill(config: dict[str, Any], precision: str = "bf16", micro: int | None = 8) -> dict[str, Any]:
    return fill_auto(config, micro_batch_size=micro, gradient_accumulation_steps=4, precision=precision, world_size=2)


@pytest.mark.skipif(HAS_DEEPSPEED, reason="DeepSpeed is installed here")
def test_without_deepspeed_the_error_says_what_to_install() -> None:
    ak.init(strategy="deepspeed")
    model = nn.Linear(2, 1)
    with pytest.raises(ImportError, match=r'pip install "accelkit\[deepspeed\]"'):
        ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_auto_values_come_from_the_loader_and_the_options() -> None:
    filled = fill(AUTO)
    assert filled == {
        "train_micro_batch_size_per_gpu": 8,
        "train_batch_size": 8 * 4 * 2,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 3},
    }
    assert AUTO["bf16"] == {"enabled": "auto"}  # the input is not modified
    assert (
        fill({"train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto"}, micro=None)["train_batch_size"]
        == 2 * 4 * 2
    )
    assert fill(AUTO, precision="no")["fp16"] == {"enabled": False}


def test_what_cannot_be_filled_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigurationError, match="no DataLoader with a batch_size"):
        fill(AUTO, micro=None)
    with pytest.raises(ConfigurationError, match=r"'auto' at optimizer\.params\.lr, gradient_clipping"):
        fill({"optimizer": {"params": {"lr": "auto"}}, "gradient_clipping": "auto"})
    with pytest.raises(ConfigurationError, match="enables fp16, but accelkit's precision is 'bf16'"):
        fill({"fp16": {"enabled": True}})


def test_the_config_is_a_file_json_text_or_the_default(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(AUTO))
    assert read_deepspeed_config(str(path)) == AUTO == read_deepspeed_config(json.dumps(AUTO))
    assert read_deepspeed_config(None) == DEFAULT_CONFIG and read_deepspeed_config(None) is not DEFAULT_CONFIG
    with pytest.raises(ConfigurationError, match=r"deepspeed_config='missing\.json' is neither JSON text nor"):
        read_deepspeed_config("missing.json")
    with pytest.raises(ConfigurationError, match=r"is not valid JSON"):
        read_deepspeed_config("{not json")
    with pytest.raises(ConfigurationError, match="must hold a JSON object, not list"):
        read_deepspeed_config("[1]")


def test_accelkit_defaults_fill_only_what_the_config_leaves_out() -> None:
    params = [nn.Parameter(torch.zeros(1))]
    assert set_defaults({}, torch.optim.SGD(params, lr=0.1)) == {
        "gradient_clipping": 0.0,  # DeepSpeed's own default (1.0) would clip unasked
        "zero_allow_untested_optimizer": True,  # element-wise: ZeRO's partitioning cannot change it
    }
    given = {"gradient_clipping": 1.0, "zero_allow_untested_optimizer": False}
    assert set_defaults(given, torch.optim.Adam(params)) == given
    assert set_defaults({}, torch.optim.LBFGS(params)) == {"gradient_clipping": 0.0}  # not element-wise
    assert set_defaults({}, None) == {"gradient_clipping": 0.0}


def regression_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # not one ZeRO calls tested
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_with_zero(steps: int) -> dict[str, Any]:
    """2 epochs of 4 global batches of 16 (8 a rank), in windows of ``steps`` micro-steps."""
    import deepspeed

    model = original = make_model()
    opt, sched = make_optimizer(model)
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=8)
    model, opt, loader, sched = ak.prepare(model, opt, loader, sched)
    assert ak.unwrap(model) is original
    for _ in range(2):
        for x, y in loader:
            with ak.accumulate(model, steps=steps):
                ak.backward(nn.functional.mse_loss(model(x).squeeze(1), y))
                opt.step()
                sched.step()
                opt.zero_grad()
    params = list(model.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # whole again under ZeRO-3; a no-op below it
        flat = torch.cat([p.detach().flatten() for p in params]).tolist()
    return {"params": flat, "engine": type(model).__name__, "optimizer": type(opt.optimizer).__name__}


def train_plain_pytorch(steps: int) -> list[float]:
    """The independent reference: one process, no accelkit, the global batch of 16."""
    model = make_model()
    opt, sched = make_optimizer(model)
    for _ in range(2):
        batches = list(torch.utils.data.DataLoader(regression_data(), batch_size=16))
        for i, (x, y) in enumerate(batches):
            (nn.functional.mse_loss(model(x).squeeze(1), y) / steps).backward()
            if (i + 1) % steps == 0 or i == len(batches) - 1:  # a loader's last batch ends a window
                opt.step()
                sched.step()
                opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@pytest.mark.distributed
# Not importorskip: importing DeepSpeed here would set variables (PYTORCH_NVML_BASED_CUDA_CHECK) in this process.
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed: pip install deepspeed")
@pytest.mark.parametrize(
    ("stage", "steps", "optimizer"),
    [(1, 1, "DeepSpeedZeroOptimizer"), (2, 3, "DeepSpeedZeroOptimizer"), (3, 3, "DeepSpeedZeroOptimizer_Stage3")],
)
def test_zero_on_cpu_trains_to_the_one_process_parameters(
    stage: int, steps: int, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelkit.testing import run_distributed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # even where there is a GPU: the workers are gloo CPU ranks
    # The config's accumulation steps (1, from the options) differ from ak.accumulate's on purpose:
    # accelkit's windows decide, including the short one that a loader's last batch ends (4 = 3 + 1).
    config = {**DEFAULT_CONFIG, "zero_optimization": {"stage": stage}}
    runs = run_distributed(
        train_with_zero, (steps,), num_processes=2, strategy="deepspeed", deepspeed_config=config, task_timeout=300
    )
    expected = train_plain_pytorch(steps)
    for run in runs:
        assert (run["engine"], run["optimizer"]) == ("DeepSpeedEngine", optimizer)
        assert run["params"] == pytest.approx(expected, abs=1e-5)


def zero_step() -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = ak.prepare(model, opt, loader)
    losses = []
    for x, y in loader:
        with ak.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            ak.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses[-1] - losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_DEEPSPEED and torch.cuda.is_available()), reason="needs DeepSpeed and a CUDA device")
def test_zero_stage_2_trains_through_accelkit() -> None:
    from accelkit.testing import run_distributed

    deltas = run_distributed(zero_step, num_processes=1, device="cuda", strategy="deepspeed")  # the default: ZeRO-2
    assert deltas[0] < 0  # the loss went down


def train_bf16() -> dict[str, Any]:
    model = make_model()
    opt, _ = make_optimizer(model)
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=8)
    model, opt, loader = ak.prepare(model, opt, loader)
    losses, dtypes = [], set()
    for _ in range(3):
        for x, y in loader:  # fp32 batches, bf16 weights inside the engine
            out = model(x)
            dtypes.add(str(out.dtype))
            loss = nn.functional.mse_loss(out.squeeze(1), y)
            ak.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"first": losses[0], "last": losses[-1], "dtypes": sorted(dtypes)}


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed: pip install deepspeed")
def test_zero_bf16_takes_fp32_batches_like_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelkit.testing import run_distributed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    config = {**DEFAULT_CONFIG, "zero_optimization": {"stage": 2}}
    runs = run_distributed(
        train_bf16, num_processes=2, strategy="deepspeed", deepspeed_config=config, precision="bf16", task_timeout=300
    )
    for run in runs:
        assert run["dtypes"] == ["torch.float32"], "outputs leave the forward in fp32, as under DDP"
        assert run["last"] < run["first"]


def test_an_optimizer_without_its_model_is_an_error() -> None:
    ak.init(strategy="deepspeed")
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigurationError, match=r"prepare them in the same call, ak.prepare\(model, optimizer"):
        ak.prepare(torch.optim.SGD(model.parameters(), lr=0.1))


def one_trained_engine() -> str:
    model = make_model()
    ak.prepare(model, make_optimizer(model)[0])
    other = make_model()
    with pytest.raises(ConfigurationError, match="trains one model per job") as info:
        ak.prepare(other, make_optimizer(other)[0])
    return str(info.value)


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed: pip install deepspeed")
def test_a_second_trained_model_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # ak.backward(loss) cannot tell which engine a loss belongs to: one engine is trained.
    from accelkit.testing import run_distributed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    config = {**DEFAULT_CONFIG, "train_micro_batch_size_per_gpu": 8}
    (message,) = run_distributed(
        one_trained_engine, num_processes=1, strategy="deepspeed", deepspeed_config=config, task_timeout=300
    )
    assert 'strategy="fsdp"' in message
