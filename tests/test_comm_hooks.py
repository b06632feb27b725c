"""DDP communication hooks (comm_hook= of ak.prepare / ak.init) on 2 gloo ranks, against gradients computed by hand."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import accelkit as ak
from accelkit._config import load_config
from accelkit._options import env_overrides
from accelkit.testing import WorkerPool

POWER_SGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 16, generator=g)
    teacher = torch.Generator().manual_seed(7)  # the same target function on every rank
    return x, x @ torch.randn(16, 1, generator=teacher)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in ak.unwrap(model).parameters()]  # type: ignore[union-attr]


def hooked_grads(hook: str, via: str) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The prepared model's gradients under ``hook``, and every rank's own gradients, from a plain copy."""
    x, y = batch(ak.rank())
    local = make_model()
    F.mse_loss(local(x), y).backward()
    if via == "init":
        ak.init(comm_hook=hook)  # type: ignore[typeddict-item]
        model = ak.prepare(make_model())
    else:
        model = ak.prepare(make_model(), comm_hook=hook)
    ak.backward(F.mse_loss(model(x), y))
    return grads(model), ak.gather_object(grads(local))


@pytest.mark.distributed
@pytest.mark.parametrize(("hook", "dtype", "via"), [("fp16", torch.float16, "prepare"), ("fp16", torch.float16, "init"),
                                                    ("bf16", torch.bfloat16, "prepare")])  # fmt: skip
def test_compression_hooks_give_the_rounded_mean_computed_by_hand(
    pool: WorkerPool, hook: str, dtype: torch.dtype, via: str
) -> None:
    for synced, (mine0, mine1) in pool.run(hooked_grads, hook, via):
        for got, g0, g1 in zip(synced, mine0, mine1, strict=True):
            # torch's hook: each rank casts and divides by the world size in `dtype`; the sum is in `dtype`.
            expected = (g0.to(dtype).div_(2) + g1.to(dtype).div_(2)).float()
            assert torch.equal(got, expected)
            assert not torch.equal(got, (g0 + g1) / 2), "the full-precision mean: no hook ran"


def train(steps: int, **hook: Any) -> tuple[float, float, list[torch.Tensor], list[list[torch.Tensor]]]:
    """SGD on a linear teacher; the first and last loss, the last step's gradients and every rank's own."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ak.prepare(model, opt, **hook)
    local = make_model()
    losses = []
    for step in range(steps):
        x, y = batch(ak.rank(), step)
        if step == steps - 1:  # this rank's own gradient, at the parameters the model has now
            local.load_state_dict(ak.unwrap(model).state_dict())
            F.mse_loss(local(x), y).backward()
        loss = F.mse_loss(model(x), y)
        ak.backward(loss)
        if step == steps - 1:
            last = grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(ak.reduce(loss.detach(), op="mean").item())
    return losses[0], losses[-1], last, ak.gather_object(grads(local))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "hook",
    [
        {"comm_hook": "fp16"},
        {"comm_hook": "power_sgd", "comm_hook_options": POWER_SGD},
        {"comm_hook": "power_sgd", "comm_wrapper": "fp16", "comm_hook_options": POWER_SGD},
        {"comm_hook": "power_sgd", "comm_wrapper": "bf16", "comm_hook_options": POWER_SGD},
    ],
)
def test_training_with_a_hook_converges(pool: WorkerPool, hook: dict[str, Any]) -> None:
    (first, last, g0, (mine0, mine1)), (_, _, g1, _) = pool.run(train, 60, **hook)
    assert last < 0.05 * first, (first, last)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True)), "every rank steps with the same gradients"
    exact = [(a + b) / 2 for a, b in zip(mine0, mine1, strict=True)]
    assert not all(torch.equal(a, b) for a, b in zip(g0, exact, strict=True)), "the hook changed the gradients"
    if hook["comm_hook"] == "power_sgd" and "comm_wrapper" not in hook:
        # PowerSGD (after start_powerSGD_iter) hands back a rank-1 approximation of the 32x16 weight's mean gradient.
        assert torch.linalg.matrix_rank(g0[0]).item() == 1 < torch.linalg.matrix_rank(exact[0]).item()


def prepare_as_if_beside_a_gpu(**hook: Any) -> str:
    """``ak.prepare`` where torch sees a GPU (answered True here, on any machine) and the model stays on the CPU."""
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        ak.prepare(torch.nn.Linear(16, 32), **hook)
    except ak.ConfigurationError as err:
        return str(err)
    finally:
        torch.cuda.is_available = available
    return ""


@pytest.mark.distributed
def test_power_sgd_on_the_cpu_of_a_machine_with_a_gpu_is_refused_clearly(pool: WorkerPool) -> None:
    # torch's PowerSGD hook synchronises CUDA on the gradients' device there: it would fail in backward.
    for message in pool.run(prepare_as_if_beside_a_gpu, comm_hook="power_sgd", comm_hook_options=POWER_SGD):
        assert "comm_hook='power_sgd') on the CPU of a machine with GPUs" in message, message
        assert "drop cpu=True" in message and "comm_hook='fp16'" in message, message


def test_batched_power_sgd_is_refused_where_torch_cannot_run_it(pool: WorkerPool) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    model = torch.nn.Linear(16, 32)
    try:  # what torch's batched hook does once it compresses: orthogonalise its one Q matrix
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        with pytest.raises(ak.ConfigurationError, match=r"batched_powerSGD_hook fails .* Use comm_hook='power_sgd'"):
            ak.prepare(model, comm_hook="batched_power_sgd")
    else:  # a torch that can: train with it
        (first, last, g0, _), (_, _, g1, _) = pool.run(train, 60, comm_hook="batched_power_sgd",
                                                       comm_hook_options=POWER_SGD)  # fmt: skip
        assert last < 0.05 * first and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


class Calls:
    def __init__(self) -> None:
        self.count = 0


def counting_hook(state: Calls, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.count += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


def own_hook() -> tuple[int, bool]:
    calls = Calls()
    model = ak.prepare(make_model(), comm_hook=counting_hook, comm_hook_state=calls)
    x, y = batch(ak.rank())
    ak.backward(F.mse_loss(model(x), y))
    synced, all_synced = grads(model), ak.gather_object(grads(model))
    return calls.count, all(torch.equal(a, b) for a, b in zip(synced, all_synced[1 - ak.rank()], strict=True))


@pytest.mark.distributed
def test_your_own_hook_runs_with_its_state(pool: WorkerPool) -> None:
    for count, same in pool.run(own_hook):
        assert count >= 1 and same


def fsdp_with_a_hook() -> str:
    ak.init(strategy="fsdp")
    try:
        ak.prepare(make_model(), comm_hook="fp16")
    except ak.ConfigurationError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_fsdp_refuses_a_hook(pool: WorkerPool) -> None:
    for message in pool.run(fsdp_with_a_hook):
        assert "comm_hook='fp16'" in message and "strategy='fsdp'" in message and "use strategy='ddp'" in message


def test_one_process_has_no_ddp_and_ignores_the_hook() -> None:
    model = make_model()
    assert ak.prepare(model, comm_hook="power_sgd", comm_hook_options=POWER_SGD) is model


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"comm_hook": "fp61"}, "comm_hook='fp61'): expected one of 'no', 'fp16', 'bf16', 'power_sgd', "
         "'batched_power_sgd', or your own hook, a callable hook(state, bucket)"),
        ({"comm_hook": "powersgd"}, "did you mean 'power_sgd'?"),
        ({"comm_hook": 3}, "comm_hook=3): expected one of"),
        ({"comm_hook": "power_sgd", "comm_wrapper": "fp32"}, "comm_wrapper='fp32'): expected one of 'no', 'fp16'"),
        ({"comm_wrapper": "fp16"}, "comm_wrapper='fp16') without a comm_hook"),
        ({"comm_hook": "fp16", "comm_wrapper": "bf16"}, "comm_hook='fp16' compresses already"),
        ({"comm_hook": "fp16", "comm_hook_options": {"matrix_approximation_rank": 2}}, "the options are PowerSGD's"),
        ({"comm_hook": "fp16", "comm_hook_state": object()}, "the state goes with your own hook"),
        ({"comm_hook": counting_hook, "comm_hook_options": {"a": 1}}, "your own hook's state goes in comm_hook_state"),
        ({"comm_hook": "power_sgd", "comm_hook_options": {"rank": 2}}, "unknown option 'rank'; PowerSGD's options: "
         "matrix_approximation_rank, start_powerSGD_iter"),
        ({"comm_hook": "power_sgd", "comm_hook_options": {"warmstart": True}}, "did you mean 'warm_start'?"),
        ({"comm_hook": "power_sgd", "comm_hook_options": {"matrix_approximation_rank": 0}},
         "expected an integer >= 1 for matrix_approximation_rank"),
        ({"comm_hook": "power_sgd", "comm_hook_options": {"use_error_feedback": 1}}, "expected True or False"),
        ({"comm_hook": "power_sgd", "comm_hook_options": {"start_powerSGD_iter": 1}},
         "Expect `start_powerSGD_iter` > 1"),
        ({"comm_hook": "power_sgd", "comm_hook_options": [("warm_start", True)]}, "expected a mapping"),
    ],
)  # fmt: skip
def test_bad_hooks_are_explained(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ak.ConfigurationError) as info:
        ak.prepare(make_model(), **options)
    assert words in str(info.value)


def test_the_state_options_take_names_only() -> None:
    with pytest.raises(ak.ConfigurationError, match=r"your own hook goes to ak.prepare\(comm_hook=fn\)"):
        ak.init(comm_hook=counting_hook)  # type: ignore[typeddict-item]
    with pytest.raises(
        ak.ConfigurationError,
        match=r"comm_hook_options=\"\{'a': 1\}\"\): expected a mapping of PowerSGD options \(JSON text",
    ):
        ak.init(comm_hook_options="{'a': 1}")


def test_the_options_come_from_the_environment_and_the_config_file(tmp_path: Path) -> None:
    env = {"ACCELKIT_COMM_HOOK": "Power_SGD", "ACCELKIT_COMM_HOOK_OPTIONS": '{"matrix_approximation_rank": 2}'}
    assert env_overrides(env) == {"comm_hook": "power_sgd", "comm_hook_options": '{"matrix_approximation_rank": 2}'}
    with pytest.raises(ak.ConfigurationError, match=r"ACCELKIT_COMM_WRAPPER\(comm_wrapper='fp8'\)"):
        env_overrides({"ACCELKIT_COMM_WRAPPER": "fp8"})
    path = tmp_path / "accelkit.yaml"
    path.write_text("comm_hook: power_sgd\ncomm_wrapper: fp16\ncomm_hook_options:\n  start_powerSGD_iter: 10\n")
    state = load_config(path).state
    assert state["comm_hook"] == "power_sgd" and state["comm_wrapper"] == "fp16"
    assert json.loads(str(state["comm_hook_options"])) == {"start_powerSGD_iter": 10}
    path.write_text("comm_hook: fp8\n")
    with pytest.raises(ak.ConfigurationError, match=r"accelkit.yaml:1: comm_hook: expected one of 'no', 'fp16'"):
        load_config(path)


def test_a_configured_hook_is_validated_at_prepare() -> None:
    ak.init(comm_hook="fp16", comm_hook_options={"matrix_approximation_rank": 2})
    with pytest.raises(ak.ConfigurationError, match="the options are PowerSGD's"):
        ak.prepare(make_model())
    assert ak.prepare(make_model(), comm_hook="power_sgd", comm_hook_options=POWER_SGD) is not None
