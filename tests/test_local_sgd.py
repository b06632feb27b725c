"""ak.local_sgd on 2 gloo ranks, bit for bit against a hand-written DDP no_sync + all_reduce loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accelkit as ak
from accelkit.testing import WorkerPool


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data: the models drift apart
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def with_accelkit(steps: int, n: int, accumulation: int) -> tuple[list[torch.Tensor], torch.Tensor, tuple[int, int]]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = ak.prepare(model, opt)
    seen = []
    with ak.local_sgd(model, steps=steps) as sync:
        for x, y in batches(ak.rank(), n):
            with ak.accumulate(model, steps=accumulation):
                ak.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
                sync.step()
            seen.append(flat(ak.unwrap(model)))
    return seen, flat(ak.unwrap(model)), (sync.num_steps, sync.num_averages)


def by_hand(steps: int, n: int, accumulation: int) -> tuple[list[torch.Tensor], torch.Tensor, tuple[int, int]]:
    """Local SGD as one writes it without accelkit: DDP's no_sync, an all-reduce per parameter every K steps."""
    ak.state()  # the pool's process group
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    world = dist.get_world_size()

    averages = 0

    def average() -> None:
        nonlocal averages
        averages += 1
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= world

    seen, taken, pending = [], 0, 0
    with ddp.no_sync():
        for i, (x, y) in enumerate(batches(dist.get_rank(), n)):
            loss = F.mse_loss(ddp(x), y)
            (loss / accumulation if accumulation > 1 else loss).backward()
            if (i + 1) % accumulation == 0:
                opt.step()
                opt.zero_grad()
                taken, pending = taken + 1, pending + 1
                if pending == steps:
                    average()
                    pending = 0
            seen.append(flat(model))
        if pending:
            average()
    return seen, flat(model), (taken, averages)


@pytest.mark.distributed
@pytest.mark.parametrize(("steps", "n", "accumulation"), [(3, 8, 1), (2, 8, 2)])
def test_local_sgd_matches_the_hand_written_loop_bit_for_bit(
    pool: WorkerPool, steps: int, n: int, accumulation: int
) -> None:
    ours = pool.run(with_accelkit, steps, n, accumulation)
    reference = pool.run(by_hand, steps, n, accumulation)
    for (seen, final, taken), (ref_seen, ref_final, ref_taken) in zip(ours, reference, strict=True):
        assert taken == ref_taken  # steps and averages
        assert taken[0] == n // accumulation  # micro-steps are not counted
        assert all(torch.equal(a, b) for a, b in zip(seen, ref_seen, strict=True))
        assert torch.equal(final, ref_final)
    (seen0, final0, _), (seen1, final1, _) = ours
    assert torch.equal(final0, final1), "the final average makes the ranks agree"
    first = accumulation - 1  # the batch of the first optimizer step
    assert not torch.equal(seen0[first], seen1[first]), "between averages the gradients are not synchronised"
    boundary = steps * accumulation - 1  # the batch whose step averages
    assert torch.equal(seen0[boundary], seen1[boundary])


def raises_in_the_body() -> bool:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ak.prepare(model, opt)
    try:
        with ak.local_sgd(model, steps=4) as sync:
            x, y = batches(ak.rank(), 1)[0]
            ak.backward(F.mse_loss(model(x), y))
            opt.step()
            sync.step()
            raise KeyError("stop")
    except KeyError:
        pass
    params = ak.gather_object(flat(ak.unwrap(model)))
    opt.zero_grad()
    ak.backward(F.mse_loss(model(x), y))  # the gradients synchronise again after the block
    grads = ak.gather_object(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return not torch.equal(*params) and torch.allclose(*grads)


@pytest.mark.distributed
def test_an_error_in_the_body_skips_the_final_average_and_restores_sync(pool: WorkerPool) -> None:
    assert pool.run(raises_in_the_body) == [True, True]


def unprepared_model() -> str:
    try:
        with ak.local_sgd(make_model(), steps=2):
            pass
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_a_model_that_is_not_ddp_is_refused(pool: WorkerPool) -> None:
    for message in pool.run(unprepared_model):
        assert "not a model that ak.prepare wrapped in DistributedDataParallel" in message
        assert "model = ak.prepare(model)" in message


def test_one_process_counts_steps_and_averages_nothing() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ak.prepare(model, opt)
    with ak.local_sgd(model, steps=2) as sync:
        assert not sync.enabled
        for x, y in batches(0, 3):
            ak.backward(F.mse_loss(model(x), y))
            opt.step()
            sync.step()
    assert (sync.num_steps, sync.num_averages) == (3, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"steps": 0}, ValueError, "local_sgd(steps=0): expected an integer >= 1"),
        ({"steps": 2.0}, ValueError, "local_sgd(steps=2.0)"),
        ({"steps": True}, ValueError, "local_sgd(steps=True)"),
        ({"steps": 2, "enabled": "yes"}, TypeError, "local_sgd(enabled='yes'): expected True or False"),
    ],
)
def test_bad_arguments_are_explained(kwargs: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info, ak.local_sgd(make_model(), **kwargs):  # type: ignore[arg-type]
        pass
    assert words in str(info.value)


def test_the_model_comes_first() -> None:
    with pytest.raises(TypeError, match=r"takes the prepared model first, got SGD"):
        with ak.local_sgd(torch.optim.SGD(make_model().parameters(), lr=0.1), steps=2):  # type: ignore[arg-type]
            pass
