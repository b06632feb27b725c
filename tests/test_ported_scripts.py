"""What ports of Accelerate's examples, nanoGPT and run_clm_no_trainer tripped on, on one process and on 2 gloo ranks.

Prepared objects forward what they do not define; the state pickles; reusable precision objects;
warnings where gradients would quietly differ from Accelerate's or from the intended mean.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import accelkit as ak
from accelkit.testing import WorkerPool


class ScheduleFreeLike(torch.optim.SGD):
    """A schedule-free optimizer's shape: train() / eval() switch what the parameters hold."""

    mode = "train"

    def train(self) -> None:
        self.mode = "train"

    def eval(self) -> None:
        self.mode = "eval"


class WithConfig(nn.Module):
    """A transformers-style model: a config attribute and a method of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"hidden": 4}
        self.body = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def generate(self, x: torch.Tensor) -> str:
        return f"generated {tuple(x.shape)}"


class TokenizingLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A DataLoader subclass with an attribute and a method of its own."""

    tokenizer = "tok"

    def describe(self) -> str:
        return f"{type(self).__name__} over {len(self.dataset)} samples"  # type: ignore[arg-type]


# --- prepared objects forward what they do not define ------------------------------------------


def prepared_forwarding(precision: str) -> dict[str, Any]:
    ak.init(precision=precision)
    model = WithConfig()
    opt = ScheduleFreeLike(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    sched.note = "mine"  # type: ignore[attr-defined]
    loader = TokenizingLoader(torch.utils.data.TensorDataset(torch.ones(16, 4)), batch_size=2)
    loader.extra = 42  # type: ignore[attr-defined]
    model, opt, sched, loader = ak.prepare(model, opt, sched, loader)
    real_steps = []
    opt.register_step_post_hook(lambda o, args, kwargs: real_steps.append(type(o).__name__))
    opt.eval()
    evaluated = opt.mode
    opt.train()
    for (x,) in loader:
        with ak.accumulate(model, steps=2):
            ak.backward(model(x).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
    return {
        "model": (model._get_name(), model.config, model.generate(torch.ones(3, 4))),  # its printed name
        "optimizer": (evaluated, opt.mode, isinstance(opt, torch.optim.Optimizer), isinstance(opt, ScheduleFreeLike)),
        "hooks": real_steps,
        "scheduler": (sched.note, sched.last_epoch),
        "loader": (loader.tokenizer, loader.extra, loader.describe(), len(loader), loader.batch_size),
    }


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_prepared_objects_forward_what_they_do_not_define(pool: WorkerPool, precision: str) -> None:
    zero, one = pool.run(prepared_forwarding, precision)
    assert zero == one
    wrapper = "MixedPrecisionModule" if precision == "bf16" else "PreparedDDP"
    assert zero["model"] == (wrapper, {"hidden": 4}, "generated (3, 4)")
    assert zero["optimizer"] == ("eval", "train", True, False)  # the wrapped optimizer's train()/eval()
    assert zero["hooks"] == ["ScheduleFreeLike"] * 2  # a hook on the prepared optimizer: real steps only
    assert zero["scheduler"] == ("mine", 2)
    # The loader's own attributes and methods; the batch size and length are the prepared (per-rank) ones.
    assert zero["loader"] == ("tok", 42, "TokenizingLoader over 16 samples", 4, 2)


def test_a_prepared_optimizer_copies_and_pickles_with_what_it_wraps() -> None:
    model = nn.Linear(2, 1)
    opt = ak.prepare(ScheduleFreeLike(model.parameters(), lr=0.1))
    copied = copy.deepcopy(opt)
    assert type(copied).__name__ == "PreparedOptimizer" and isinstance(copied.optimizer, ScheduleFreeLike)
    assert copied.param_groups[0]["lr"] == 0.1 and copied.optimizer is not opt.optimizer
    assert pickle.loads(pickle.dumps(opt)).mode == "train"
    assert not getattr(type(opt).step, "hooked", False), "Optimizer.__setstate__ must not patch the wrapper's step"
    with pytest.raises(AttributeError, match="'ScheduleFreeLike' object has no attribute 'nope'"):
        opt.nope  # noqa: B018


# --- the state pickles (Accelerate's test_pickle_accelerator) -----------------------------------


def pickled_state() -> tuple[bool, str, str]:
    model = nn.Linear(2, 1)
    ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(range(8), batch_size=2))
    st = ak.state()
    again = pickle.loads(pickle.dumps(st))
    assert again.strategy is not None and copy.deepcopy(st) == st
    return again == st, repr(again), again.strategy.name


def test_the_state_pickles_and_unpickles_equal_after_prepare(pool: WorkerPool) -> None:
    for rank, (equal, text, strategy) in enumerate(pool.run(pickled_state)):
        assert equal and f"rank={rank}" in text and strategy == "ddp"


def test_prepared_objects_follow_a_new_state_after_reset() -> None:
    # The step path keeps the strategy with the training state: a reset and a new init replace both.
    model = nn.Linear(2, 1)
    opt = ak.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    ak.reset_state()
    ak.init(gradient_accumulation_steps=2)
    before = model.weight.detach().clone()
    for expect_change in (False, True):
        with ak.accumulate(model):
            ak.backward(model(torch.ones(1, 2)).sum())
            opt.step()
            opt.zero_grad()
        assert (not torch.equal(before, model.weight)) is expect_change
    assert pickle.loads(pickle.dumps(ak.state())) == ak.state()


# --- reusable precision objects (nanoGPT's ctx) -------------------------------------------------


def test_a_precision_object_is_reusable_and_reentrant() -> None:
    a = torch.ones(2, 2)
    ctx = ak.precision("bf16")
    for _ in range(2):
        with ctx:
            assert (a @ a).dtype == torch.bfloat16
            with ctx:  # re-entered inside itself
                assert (a @ a).dtype == torch.bfloat16
                with ak.precision("no"):
                    assert (a @ a).dtype == torch.float32
            assert (a @ a).dtype == torch.bfloat16
        assert (a @ a).dtype == torch.float32
    default = ak.precision()  # the configured precision, read at each entry
    ak.init(precision="bf16")
    with default:
        assert (a @ a).dtype == torch.bfloat16

    @ctx
    def matmul() -> torch.dtype:
        return (a @ a).dtype

    assert matmul() == matmul() == torch.bfloat16
    with pytest.raises(ValueError, match=r"'fp64'.*valid modes: no, fp16, bf16; did you mean 'fp16'\?$"):
        ak.precision("fp64")  # checked when made, not when first entered


# --- no quiet 2x: ak.backward outside ak.accumulate ---------------------------------------------


def test_backward_outside_accumulate_with_accumulation_steps_warns_once() -> None:
    ak.init(gradient_accumulation_steps=2)
    w = nn.Parameter(torch.ones(1))
    with pytest.warns(UserWarning, match=r"gradient_accumulation_steps=2.*not divided.*ak\.accumulate") as seen:
        ak.backward(w * 8)
        ak.backward(w * 8)
    assert len(seen) == 1 and seen[0].filename == __file__
    assert w.grad is not None and w.grad.item() == 16.0  # not divided, as documented
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ak.accumulate():  # inside: divided by the configured steps, no warning
            ak.backward(w * 8)
    assert w.grad.item() == 20.0


def test_backward_outside_accumulate_with_one_step_is_silent() -> None:
    w = nn.Parameter(torch.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ak.backward(w * 8)
        with ak.accumulate(steps=4):
            ak.backward(w * 8)
    assert w.grad is not None and w.grad.item() == 10.0


# --- several backward calls in one region with steps left at 1 (nanoGPT's micro-step loop) ------


def micro_steps(per_region: bool, count: bool = True) -> tuple[list[str], list[float]]:
    """4 micro-batches per optimizer step: in one region (the trap), one region each without the count (the other
    trap), or one region each with it (the fix)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, opt = ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(10 + ak.rank())
    batches = [torch.randn(2, 3) for _ in range(4)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # two optimizer steps
            if per_region:
                for x in batches:
                    with ak.accumulate(model, steps=4) if count else ak.accumulate(model):
                        ak.backward(model(x).pow(2).mean())
            else:
                with ak.accumulate(model):
                    for x in batches:
                        ak.backward(model(x).pow(2).mean())
            ak.clip_grad_norm_(model.parameters(), 1e9)  # after the loop: the gradients are complete
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in seen], torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def reference_micro_steps() -> list[float]:
    """By hand: the mean over both ranks' 4 micro-batches, two SGD steps."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []
    for rank in range(2):
        torch.manual_seed(10 + rank)
        batches += [torch.randn(2, 3) for _ in range(4)]
    for _ in range(2):
        sum(model(x).pow(2).mean() for x in batches).backward()  # type: ignore[union-attr]
        for p in model.parameters():
            p.grad /= len(batches)  # type: ignore[operator]
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def test_several_backwards_in_one_region_warn_once_and_regions_per_micro_step_are_exact(pool: WorkerPool) -> None:
    for messages, _ in pool.run(micro_steps, False):
        assert len(messages) == 1, messages
        assert "saw 4 ak.backward calls in one region, with steps=1" in messages[0]
        assert "ak.accumulate(model, steps=4)" in messages[0]
    expected = reference_micro_steps()
    for messages, params in pool.run(micro_steps, True):
        assert messages == [] and params == pytest.approx(expected, abs=1e-6)


def test_micro_steps_in_regions_without_their_count_warn_once_at_the_step(pool: WorkerPool) -> None:
    """`for _ in range(4): with ak.accumulate(model): ...` then one step: 4 whole steps' gradients, each synced."""
    for messages, _ in pool.run(micro_steps, True, False):
        assert len(messages) == 1, messages
        assert messages[0].startswith("4 ak.accumulate(model) regions with steps left at 1 ran ak.backward before")
        assert "`with ak.accumulate(model, steps=4):`" in messages[0]


def test_one_region_per_optimizer_step_is_silent() -> None:
    model = nn.Linear(3, 1)
    model, opt = ak.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with ak.accumulate(model):
                ak.backward(model(torch.ones(2, 3)).sum())
            opt.step()
            opt.zero_grad()


def schedules_at_the_end(steps: int) -> list[str]:
    """Three prepared schedules over ``steps`` optimizer steps: two sized Accelerate's way (x num_processes), one
    from the run's own steps; the warnings ``ak.end_training`` gives on this rank."""
    model = nn.Linear(3, 1)
    world = ak.world_size()
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(3)]
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(optimizers[0], lambda k: max(0.0, 1 - k / (steps * world))),
        torch.optim.lr_scheduler.OneCycleLR(optimizers[1], max_lr=0.1, total_steps=steps * world),
        torch.optim.lr_scheduler.LambdaLR(optimizers[2], lambda k: max(0.0, 1 - k / steps)),  # the right length
    ]
    model, *prepared = ak.prepare(model, *optimizers, *schedulers)
    for _ in range(steps):
        ak.backward(model(torch.ones(2, 3)).sum())
        for opt in prepared[:3]:
            opt.step()
            opt.zero_grad()
        for sched in prepared[3:]:
            sched.step()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ak.end_training()
    return [str(w.message) for w in seen if "optimizer steps but the run took" in str(w.message)]


@pytest.mark.distributed
def test_a_schedule_sized_for_num_processes_times_the_steps_warns_at_end_training() -> None:
    """Accelerate's recipe (num_training_steps * num_processes) stretches the schedule: said once, on rank 0."""
    from accelkit.testing import run_distributed

    on_rank_0, on_rank_1 = run_distributed(schedules_at_the_end, (6,), num_processes=2)
    assert len(on_rank_0) == 2 and on_rank_1 == [], (on_rank_0, on_rank_1)
    assert on_rank_0[0].startswith("LambdaLR was sized for 12 optimizer steps but the run took 6 (2x fewer")
    assert on_rank_0[1].startswith("OneCycleLR was sized for 12 optimizer steps but the run took 6")
    assert "num_training_steps = math.ceil(len(loader) / accumulation_steps) * epochs" in on_rank_0[0]
    assert schedules_at_the_end(6) == []  # one process: nothing is stretched


def test_several_losses_per_step_with_steps_1_given_are_silent() -> None:
    a, b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ak.accumulate(steps=1):
            ak.backward(a * 2)
            ak.backward(b * 3)
    assert a.grad is not None and b.grad is not None and (a.grad.item(), b.grad.item()) == (2.0, 3.0)


# --- Accelerate's names on the module -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "spelling"),
    [
        ("unwrap_model", "ak.unwrap(model)"),
        ("process_index", "ak.rank()"),
        ("num_processes", "ak.world_size()"),
        ("autocast", "ak.precision()"),
        ("set_trigger", "ak.set_breakpoint()"),
        ("notebook_launcher", "ak.launch(fn"),
        ("Accelerator", "there is no Accelerator object"),
        ("distributed_type", "ak.strategy()"),
        ("is_schedulefree_available", 'find_spec("schedulefree")'),
    ],
)
def test_accelerate_names_on_the_module_name_accelkit_s_spelling(name: str, spelling: str) -> None:
    with pytest.raises(AttributeError, match=rf"has no attribute '{name}'; for Accelerate's {name}, use ") as err:
        getattr(ak, name)
    assert spelling in str(err.value)
    assert not hasattr(ak, name)


def test_a_misspelt_name_gets_the_close_one_and_import_stays_light() -> None:
    with pytest.raises(AttributeError, match=r"'gahter'; did you mean 'gather'\?"):
        ak.gahter  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match=r"^module 'accelkit' has no attribute '__wrapped__'$"):
        ak.__wrapped__  # noqa: B018
    code = "import sys, accelkit; print(sorted(m for m in sys.modules if m.startswith(('accelkit.', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['accelkit._version']"
