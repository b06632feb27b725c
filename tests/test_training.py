"""prepare, backward, precision, accumulation, clipping: on one process and on 2 gloo ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import accelkit as ak
from accelkit.testing import WorkerPool


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def grads_per_micro_step(steps: int) -> list[tuple[bool, list[float]]]:
    """Each rank feeds different data; returns (sync flag, flat grads) after each micro-step."""
    model = ak.prepare(make_model())
    torch.manual_seed(100 + ak.rank())
    seen = []
    for _ in range(steps):
        with ak.accumulate(model, steps=steps):
            ak.backward(model(torch.randn(3, 4)).pow(2).mean())
            grads = torch.cat([p.grad.flatten() for p in ak.unwrap(model).parameters()])
            seen.append((ak.sync_gradients(), grads.tolist()))
    return seen


def test_gradients_sync_only_on_the_boundary(pool: WorkerPool) -> None:
    zero, one = pool.run(grads_per_micro_step, 3)
    assert [s for s, _ in zero] == [False, False, True]
    for (_, g0), (_, g1) in zip(zero[:2], one[:2], strict=True):
        assert g0 != g1, "micro-steps must not all-reduce"
    assert zero[2][1] == pytest.approx(one[2][1], abs=1e-6), "the boundary step all-reduces"


def no_sync_kept_and_entered_again() -> list[Any]:
    """Rank r's gradient of sum(w . x) is x = r + 1 per backward; an all-reduce averages the ranks'."""
    model = nn.Linear(3, 1, bias=False)
    model = ak.prepare(model)
    x = torch.full((1, 3), float(ak.rank() + 1), device=ak.device())
    region = ak.no_sync(model)
    seen = []
    with region:
        with region:  # nested: the inner exit must not turn the all-reduce back on
            ak.backward(model(x).sum())
        with ak.accumulate(model, steps=2):  # a micro-step's own region, inside (it halves the loss)
            ak.backward(model(x).sum())
        ak.backward(model(x).sum())
        seen.append(model.module.weight.grad[0, 0].item())
    ak.backward(model(x).sum())  # outside: all-reduced
    seen.append(model.module.weight.grad[0, 0].item())
    with pytest.raises(KeyError), region:  # entered again after it ended; left by an exception
        raise KeyError("in the body")
    model.zero_grad()
    ak.backward(model(x).sum())
    seen.append(model.module.weight.grad[0, 0].item())
    return seen


def test_a_no_sync_region_can_be_kept_nested_and_entered_again(pool: WorkerPool) -> None:
    zero, one = pool.run(no_sync_kept_and_entered_again)
    assert zero[0] == 2.5 and one[0] == 5.0  # 1 + 1/2 + 1 times x: each rank's own
    assert zero[1:] == one[1:] == [(3.5 + 7.0) / 2, 1.5]  # all-reduced again once every region ended


def ddp_options(find_unused: bool) -> bool:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = ak.prepare(WithUnused(), find_unused_parameters=find_unused)
    ak.backward(model(torch.ones(1, 2)).sum())
    return isinstance(model, nn.parallel.DistributedDataParallel) and model.find_unused_parameters


def test_ddp_options_pass_through(pool: WorkerPool) -> None:
    assert pool.run(ddp_options, True) == [True, True]


def test_prepare_returns_objects_in_order() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    p_model, p_opt, p_sched = ak.prepare(model, opt, sched)
    assert p_model is model  # one process: no wrapper
    assert isinstance(p_opt, torch.optim.Optimizer) and p_opt.optimizer is opt
    assert p_sched.scheduler is sched
    assert ak.prepare(model) is model  # one object in, that object out
    assert ak.prepare(p_opt) is p_opt and ak.prepare(p_sched) is p_sched  # twice is harmless


def test_prepare_rejects_what_it_cannot_prepare() -> None:
    with pytest.raises(TypeError, match=r"cannot prepare builtins\.dict"):
        ak.prepare({"lr": 0.1})
    with pytest.raises(TypeError, match="unexpected option 'find_unused'"):
        ak.prepare(make_model(), find_unused=True)
    with pytest.raises(TypeError, match="at least one object"):
        ak.prepare()


def test_optimizer_and_scheduler_skip_micro_steps() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = ak.prepare(model, opt, sched)
    before = [p.detach().clone() for p in model.parameters()]
    lrs = []
    for _ in range(4):
        with ak.accumulate(model, steps=2):
            ak.backward(model(torch.ones(2, 4, device=ak.device())).sum())
            changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append((ak.sync_gradients(), changed, sched.get_last_lr()[0]))
        before = [p.detach().clone() for p in model.parameters()]
    assert [(s, lr) for s, _, lr in lrs] == [(False, 1.0), (True, 0.5), (False, 0.5), (True, 0.25)]


def test_backward_divides_by_the_accumulation_steps() -> None:
    w = nn.Parameter(torch.ones(1))
    with ak.accumulate(steps=4):
        ak.backward(w * 8)
    assert w.grad.item() == 2.0
    ak.backward(w * 8)  # outside accumulate: no division
    assert w.grad.item() == 10.0


@pytest.mark.parametrize("on_micro_steps", [True, False])
def test_a_strategy_that_runs_its_own_step_is_asked_on_every_step(
    monkeypatch: pytest.MonkeyPatch, on_micro_steps: bool
) -> None:
    """A strategy that steps on micro-steps (DeepSpeed's engine) is asked to on each; zero_grad on boundaries only."""
    from accelkit import _state
    from accelkit._strategies.single import SingleProcess

    calls: list[tuple[str, bool]] = []

    class OwnStep(SingleProcess):
        steps_on_micro_steps = on_micro_steps

        def backward(self, loss: torch.Tensor, *, divide_by: int, boundary: bool, **kwargs: Any) -> None:
            calls.append((f"backward / {divide_by}", boundary))
            super().backward(loss, divide_by=divide_by, boundary=boundary, **kwargs)

        def optimizer_step(self, optimizer: Any, closure: Any, *, boundary: bool) -> Any:
            calls.append(("step", boundary))
            return super().optimizer_step(optimizer, closure, boundary=boundary)

        def zero_grad(self, optimizer: Any, set_to_none: bool) -> None:
            calls.append(("zero_grad", ak.sync_gradients()))
            super().zero_grad(optimizer, set_to_none)

    model = make_model()
    model, opt = ak.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    st = ak.state()
    own = OwnStep(st.options, st.device)
    monkeypatch.setattr(_state.training, "strategy", own)  # as training.use(own) holds it
    monkeypatch.setattr(_state.training, "torch_step", False)
    for _ in range(2):
        with ak.accumulate(model, steps=2):
            ak.backward(model(torch.ones(2, 4, device=ak.device())).sum())
            opt.step()
            opt.zero_grad()
    micro = [("backward / 2", False)] + ([("step", False)] if on_micro_steps else [])
    assert calls == [*micro, ("backward / 2", True), ("step", True), ("zero_grad", True)]


def test_only_strategies_without_their_own_step_let_the_step_path_call_torch() -> None:
    from accelkit._strategies.ddp import DDP
    from accelkit._strategies.deepspeed import DeepSpeed
    from accelkit._strategies.fsdp import FSDP
    from accelkit._strategies.single import SingleProcess

    class OwnZeroGrad(SingleProcess):
        def zero_grad(self, optimizer: Any, set_to_none: bool) -> None:
            pass

    class SaysSo(OwnZeroGrad):
        torch_step = True

    found = {kind.__name__: kind.torch_step for kind in (SingleProcess, DDP, FSDP, DeepSpeed, OwnZeroGrad, SaysSo)}
    expected = {"SingleProcess": True, "DDP": True, "FSDP": True, "DeepSpeed": False}
    assert found == {**expected, "OwnZeroGrad": False, "SaysSo": True}


def test_the_step_path_calls_torch_directly_only_without_a_grad_scaler() -> None:
    """The flag the step path reads follows the strategy, and the fp16 scaler that ak.prepare makes."""
    from accelkit import _state

    ak.init(cpu=True)
    ak.prepare(make_model())
    assert _state.training.torch_step
    ak.reset_state()
    assert not _state.training.torch_step  # no strategy yet
    ak.init(precision="fp16", cpu=True)
    model = make_model()
    assert _state.training.torch_step  # no optimizer prepared: no scaler yet
    ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not _state.training.torch_step  # the scaler's step from now on


def fp16_setup() -> tuple[nn.Module, Any, Any]:
    ak.init(precision="fp16", cpu=True)  # these tests read the CPU grad scaler's figures
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    nn.init.ones_(model[0].weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    return ak.prepare(model, opt, sched)


def test_fp16_on_cpu_scales_the_loss_and_steps_unscaled() -> None:
    model, opt, sched = fp16_setup()
    ak.backward(model(torch.ones(1, 2)).sum() / 4)
    scale = 2.0**16  # GradScaler's initial scale
    assert model[0].weight.grad.tolist() == [[scale / 4, scale / 4]]
    opt.step()
    sched.step()
    assert not opt.step_was_skipped
    assert model[0].weight.tolist() == [[0.875, 0.875]]  # 1 - lr * 1/4: the gradient was unscaled
    assert sched.get_last_lr() == [pytest.approx(0.05)]


def test_fp16_scaling_goes_on_after_an_option_changes() -> None:
    # A new option gives the process a new strategy object: the grad scaler it made at prepare stays.
    model, opt, _ = fp16_setup()
    ak.init(gradient_accumulation_steps=2)
    with ak.accumulate(model, steps=1):
        ak.backward(model(torch.ones(1, 2)).sum() / 4)
    assert model[0].weight.grad.tolist() == [[2.0**14, 2.0**14]]  # scaled by 2**16
    opt.step()
    assert model[0].weight.tolist() == [[0.875, 0.875]]  # and unscaled by the optimizer step


def test_fp16_overflow_skips_the_step_and_the_scheduler() -> None:
    model, opt, sched = fp16_setup()
    ak.backward(model(torch.full((1, 2), math.inf)).sum())
    opt.step()
    sched.step()
    assert opt.step_was_skipped
    assert model[0].weight.tolist() == [[1.0, 1.0]]
    assert sched.get_last_lr() == [0.5]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("private", [True, False], ids=["device-side", "public get_scale"])
def test_a_skipped_fp16_step_is_told_alike_by_both_ways(
    monkeypatch: pytest.MonkeyPatch, private: bool, fused: bool
) -> None:
    # Within the checked torch range the scaler's device-side flags tell a skipped step without a sync;
    # outside it, the public get_scale() before and after the step: both must tell the same.
    from accelkit import _torch_private

    monkeypatch.setattr(_torch_private, "SCALER", private)
    ak.init(precision="fp16", cpu=True)
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, fused=fused)
    model, opt = ak.prepare(model, opt)
    for x, skipped in ((math.inf, True), (1.0, False)):
        ak.backward(model(torch.full((1, 2), x)).sum())
        opt.step()
        opt.zero_grad()
        assert bool(opt.step_was_skipped) is skipped, (x, private, fused)


def test_fp16_forward_runs_in_half_and_returns_fp32() -> None:
    model, _, _ = fp16_setup()
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.ones(1, 2))
    assert seen == [torch.float16] and out.dtype == torch.float32


def test_clip_grad_norm_unscales_once_per_step() -> None:
    model, opt, _ = fp16_setup()
    ak.backward(model(torch.ones(1, 2)).sum() / 4)  # true gradient [1/4, 1/4]
    norm = ak.clip_grad_norm_(model.parameters(), max_norm=0.25)
    assert norm.item() == pytest.approx(math.sqrt(2) / 4)
    again = ak.clip_grad_norm_(model.parameters(), max_norm=0.25)
    assert again.item() == pytest.approx(0.25, rel=1e-3)  # not unscaled a second time
    opt.step()
    assert model[0].weight.tolist()[0] == pytest.approx([1 - 0.5 * 0.25 / math.sqrt(2)] * 2, rel=1e-3)


def test_clip_grad_value() -> None:
    w = nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([-3.0, 0.5, 3.0])
    ak.clip_grad_value_(w, 1.0)
    assert w.grad.tolist() == [-1.0, 0.5, 1.0]


def test_bf16_region_and_nesting() -> None:
    a = torch.ones(2, 2, device=ak.device())
    with ak.precision("bf16"):
        assert (a @ a).dtype == torch.bfloat16
        with ak.precision("no"):
            assert (a @ a).dtype == torch.float32
    assert (a @ a).dtype == torch.float32


def test_default_precision_comes_from_the_state() -> None:
    ak.init(precision="bf16")
    with ak.precision():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_unknown_precision_lists_the_valid_modes() -> None:
    with pytest.raises(ValueError, match=r"'fp64'.*valid modes: no, fp16, bf16; did you mean 'fp16'\?$"):
        with ak.precision("fp64"):
            pass
    with pytest.raises(ValueError, match=r"fp8.*compute capability"):
        with ak.precision("fp8"):
            pass


def test_fp8_is_refused_when_asked_for_saying_what_it_needs() -> None:
    needs = "fp8 needs an NVIDIA GPU of compute capability 8.9 or newer, torchao, and a model converted to fp8"
    with pytest.raises(ak.ConfigurationError, match=r"\(precision='fp8'\): expected one of 'no', 'fp16', 'bf16';") as e:
        ak.init(precision="fp8")
    assert needs in str(e.value)


def test_accumulate_rejects_bad_steps() -> None:
    with pytest.raises(ValueError, match="steps=0"):
        with ak.accumulate(steps=0):
            pass


def unwrapped_is_original() -> bool:
    model = make_model()
    return ak.unwrap(ak.prepare(model)) is model


def test_unwrap_strips_ddp(pool: WorkerPool) -> None:
    assert pool.run(unwrapped_is_original) == [True, True]


def published_in_passes(steps: int) -> list[str]:
    """What this rank's heartbeat publishes during the prepared DDP's forward, during ak.backward's
    all-reduce (a micro-step's, then a boundary's), and after them; the model's hooks."""
    from accelkit import _group, _state

    heartbeat = _state.group.heartbeat

    def published() -> str:
        heartbeat.beat()  # as the heartbeat thread does, every second
        position = _group.read_positions(heartbeat.store, heartbeat.prefix, ak.world_size())[ak.rank()]
        return f"{position.doing}{' (blocked)' if position.blocked else ''}"

    seen = []
    inner = make_model()
    inner.register_forward_hook(lambda module, args, out: seen.append(published()))
    model = ak.prepare(inner)
    hooks = len(model._forward_hooks) + len(model._forward_pre_hooks)
    inner[0].weight.register_hook(lambda grad: seen.append(published()))
    for _ in range(steps):
        with ak.accumulate(model, steps=steps):
            ak.backward(model(torch.randn(2, 4, device=ak.device())).sum())
    return [*seen, published(), str(hooks)]


def test_ddp_passes_publish_that_they_may_wait_without_hooks_or_step_costs(pool: WorkerPool) -> None:
    # A rank left waiting for this one tells where it is (_group.meet): its heartbeat finds the pass on
    # its stack. No module hooks (torch's fast call path), nothing marked on the step path. The module's
    # own forward may wait for anything (I/O): never proof; a boundary's backward all-reduces: proof.
    forward = "a forward pass (it may wait for the other processes)"
    syncing = "a backward pass that all-reduces gradients (it waits for every process) (blocked)"
    for seen in pool.run(published_in_passes, 2):
        assert seen == [forward, "", forward, syncing, "", "0"], seen


def published_in_unsynced_backwards() -> list[bool]:
    """Whether ak.backward on a boundary reads as blocked: plain, in ak.no_sync, in the DDP model's own no_sync()."""
    from accelkit import _group, _state

    heartbeat = _state.group.heartbeat
    blocked = []
    inner = make_model()
    inner[0].weight.register_hook(lambda grad: blocked.append(_in_pass()))

    def _in_pass() -> bool:
        heartbeat.beat()
        return _group.read_positions(heartbeat.store, heartbeat.prefix, ak.world_size())[ak.rank()].blocked

    model = ak.prepare(inner)
    x = torch.randn(2, 4, device=ak.device())
    ak.backward(model(x).sum())
    with ak.no_sync(model):
        ak.backward(model(x).sum())
    with model.no_sync():  # DDP's own
        ak.backward(model(x).sum())
    return blocked


def test_a_backward_that_does_not_all_reduce_is_not_proof_of_a_wait(pool: WorkerPool) -> None:
    assert pool.run(published_in_unsynced_backwards) == [[True, False, False]] * 2


def backward_of_an_unprepared_model(prepare_optimizer: bool) -> list[str]:
    import warnings

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepare_optimizer:  # the habit of forgetting the model in `optimizer, loader = ak.prepare(...)`
        optimizer = ak.prepare(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ak.backward(model(torch.randn(2, 4, device=ak.device())).sum())
    return [f"{w.filename}: {w.message}" for w in caught]


@pytest.mark.parametrize("prepare_optimizer", [False, True])
def test_a_loss_of_an_unprepared_model_is_said_once_with_several_processes(
    pool: WorkerPool, prepare_optimizer: bool
) -> None:
    for said in pool.run(backward_of_an_unprepared_model, prepare_optimizer):
        assert len(said) == 1, said  # once
        assert (
            said[0].startswith(__file__) and "no model was prepared, so accelkit synchronises no gradients" in said[0]
        )
        assert "model = ak.prepare(model)" in said[0]
    assert backward_of_an_unprepared_model(False) == []  # one process: nothing to synchronise


def test_a_scheduler_built_on_the_prepared_optimizer_skips_with_it() -> None:
    model, opt, _ = fp16_setup()
    sched = ak.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1))
    ak.backward(model(torch.full((1, 2), math.inf)).sum())
    opt.step()
    sched.step()
    assert opt.step_was_skipped and sched.get_last_lr() == [0.5]
    opt.zero_grad()
    ak.backward(model(torch.ones(1, 2)).sum() / 4)
    opt.step()
    sched.step()
    assert not opt.step_was_skipped and sched.get_last_lr() == [pytest.approx(0.05)]


def regression_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1)


def train_with_accelkit(batch_size: int, steps: int, shuffle: bool, epochs: int = 2) -> tuple[list[float], list[float]]:
    """Returns the final parameters and the learning rate after every real optimizer step."""
    ak.set_seed(7)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # A shuffle with a generator is the same on any number of processes (without one: Accelerate's, which is not).
    generator = torch.Generator().manual_seed(3) if shuffle else None
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=batch_size, shuffle=shuffle, generator=generator)
    model, opt, loader = ak.prepare(model, opt, loader)
    sched = ak.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    lrs = []
    for _ in range(epochs):
        for x, y in loader:
            with ak.accumulate(model, steps=steps):
                ak.backward(nn.functional.mse_loss(model(x).squeeze(1), y))
                opt.step()
                sched.step()
                opt.zero_grad()
                if ak.sync_gradients():
                    lrs.append(sched.get_last_lr()[0])
    params = torch.cat([p.detach().flatten() for p in ak.unwrap(model).parameters()])
    return params.tolist(), lrs


def train_plain_pytorch(batch_size: int, epochs: int = 2) -> tuple[list[float], list[float]]:
    """The independent reference: one process, no accelkit, sequential order."""
    torch.manual_seed(7)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    lrs = []
    for _ in range(epochs):
        for x, y in torch.utils.data.DataLoader(regression_data(), batch_size=batch_size):
            nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(sched.get_last_lr()[0])
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(), lrs


@pytest.mark.parametrize(("steps", "reference_batch"), [(1, 16), (2, 32)])
def test_two_processes_match_one_process_with_the_global_batch(
    pool: WorkerPool, steps: int, reference_batch: int
) -> None:
    expected_params, expected_lrs = train_plain_pytorch(reference_batch)
    for params, lrs in pool.run(train_with_accelkit, 8, steps, False):
        assert params == pytest.approx(expected_params, abs=1e-5)
        assert lrs == pytest.approx(expected_lrs)
    assert len(expected_lrs) == 2 * 64 // reference_batch


@pytest.mark.smoke
def test_shuffled_two_process_run_matches_the_one_process_run(pool: WorkerPool) -> None:
    expected_params, _ = train_with_accelkit(16, 1, True)
    zero, one = pool.run(train_with_accelkit, 8, 1, True)
    assert zero[0] == pytest.approx(expected_params, abs=1e-5)
    assert one[0] == zero[0]


def test_preparing_a_module_again_does_not_stack_autocast() -> None:
    ak.init(precision="bf16")
    model = make_model()
    first = ak.prepare(model)
    again = ak.prepare(model)  # e.g. on each find_executable_batch_size retry
    assert first.forward_module is model and again.forward_module is model  # never a wrapper of a wrapper
    assert ak.prepare(again) is again
    assert "forward" not in vars(model)  # the user's module is never patched
    assert again(torch.ones(1, 4)).dtype == torch.float32


def reinit_in_the_same_workers() -> int:
    ak.reset_state()
    ak.init(cpu=True)
    return int(ak.reduce(torch.tensor([ak.rank() + 1]), op="sum").item())


def test_reset_and_init_again_inside_launched_workers() -> None:
    from accelkit.testing import run_distributed

    assert run_distributed(reinit_in_the_same_workers) == [3, 3]
