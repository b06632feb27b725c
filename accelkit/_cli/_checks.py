"""The checks of ``accelkit test``, run in every worker of a short real distributed run.

Each check exercises one part of accelkit against a closed-form answer and says what it
verified. After every check the ranks exchange their verdicts, so each rank knows which
ranks failed; the run stops at the first failed check (later ones would only add noise).

``fault_rank`` is for testing accelkit itself: that rank contributes a wrong value to the
all-reduce, so that the failure path runs for real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CHECK_NAMES", "CheckResult", "run_checks"]

CHECK_NAMES = ("processes", "reduce", "gather", "broadcast", "barrier", "training", "precision", "debug mode")

_STEPS = 3


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: what it verified, and each failed rank's reason."""

    name: str
    detail: str
    failures: dict[int, str] = field(default_factory=dict)
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures


class CheckFailed(AssertionError):
    """A check found a wrong value (its message says which and what was expected)."""


class _Skipped(Exception):
    """A check that does not apply to this configuration (its message says why)."""


def run_checks(expected_world_size: int, fault_rank: int | None = None) -> list[CheckResult]:
    """Run every check on this rank, in order; every rank must call it. Stops at the first failure.

    Example:
        >>> import accelkit as ak
        >>> from accelkit._cli._checks import run_checks
        >>> [r.name for r in ak.launch(run_checks, (2,), num_processes=2, cpu=True)]  # doctest: +SKIP
        ['processes', 'reduce', 'gather', 'broadcast', 'barrier', 'training', 'precision', 'debug mode']
    """
    import accelkit as ak

    checks: list[Callable[[], str]] = [
        lambda: _processes(expected_world_size),
        lambda: _reduce(fault_rank),
        _gather,
        _broadcast,
        _barrier,
        _training,
        _precision,
        _debug_mode,
    ]
    results = []
    for name, check in zip(CHECK_NAMES, checks, strict=True):
        error, skipped = None, False
        try:
            detail = check()
        except _Skipped as exc:
            detail, skipped = str(exc), True
        except CheckFailed as exc:
            detail, error = "", str(exc)
        except Exception as exc:  # reported with the rank below; every rank must reach the exchange
            detail, error = "", f"{type(exc).__name__}: {exc}"
        verdicts = ak.gather_object(error)
        failures = {rank: e for rank, e in enumerate(verdicts) if e is not None}
        results.append(CheckResult(name, detail, failures, skipped))
        if failures:
            break
    return results


def _processes(expected: int) -> str:
    import accelkit as ak

    st = ak.state()
    ranks = ak.gather_object((st.rank, st.local_rank))
    if st.world_size != expected or [r for r, _ in ranks] != list(range(expected)):
        raise CheckFailed(f"expected {expected} processes with ranks 0..{expected - 1}, found ranks {ranks}")
    return f"world size {st.world_size}, ranks {[r for r, _ in ranks]}, device {st.device}, backend {st.backend}"


def _reduce(fault_rank: int | None) -> str:
    import accelkit as ak

    n, rank = ak.world_size(), ak.rank()
    expected = float(rank + 1)
    mine = torch.tensor([expected + (100.0 if rank == fault_rank else 0.0)], device=ak.device())
    total, mean = ak.reduce(mine, op="sum"), ak.reduce(mine, op="mean")
    want = n * (n + 1) / 2
    if total.item() != want or abs(mean.item() - want / n) > 1e-6:
        # Every rank sees the same wrong total: find out together which contributions were off.
        sent = ak.gather_object(mine.item())
        culprits = ", ".join(f"rank {r} contributed {v:g}, expected {r + 1}" for r, v in enumerate(sent) if v != r + 1)
        raise CheckFailed(f"sum over ranks of rank + 1 was {total.item():g}, expected {want:g} ({culprits})")
    if mine.item() != expected:
        raise CheckFailed(f"ak.reduce modified its input: {mine.item():g} instead of {expected:g}")
    return f"sum of rank + 1 over {n} rank{'s' if n > 1 else ''} is {want:g}, mean {want / n:g}, on every rank"


def _gather() -> str:
    import accelkit as ak

    n, rank = ak.world_size(), ak.rank()
    gathered = ak.gather(torch.full((1, 2), float(rank), device=ak.device()))
    rows = gathered[:, 0].tolist()
    if list(gathered.shape) != [n, 2] or rows != [float(r) for r in range(n)]:
        raise CheckFailed(f"expected rows in rank order {list(range(n))}, got {rows} (shape {list(gathered.shape)})")
    return f"rows arrive in rank order {[int(r) for r in rows]}"


def _broadcast() -> str:
    import accelkit as ak

    source = torch.arange(4.0, device=ak.device()) * 7
    mine = source.clone() if ak.rank() == 0 else torch.zeros(4, device=ak.device())
    got = ak.broadcast(mine)
    if not torch.equal(got, source):
        raise CheckFailed(f"expected rank 0's {source.tolist()}, got {got.tolist()}")
    return f"rank 0's {source.tolist()} reached every rank"


def _barrier() -> str:
    import accelkit as ak

    ak.wait_for_everyone()
    return "every rank passed it"


def _training() -> str:
    import accelkit as ak

    rank = ak.rank()
    torch.manual_seed(1234 + rank)  # different initial weights: DDP must make them equal
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ak.prepare(model, optimizer)
    before = torch.cat([p.detach().flatten().float().cpu() for p in ak.unwrap(model).parameters()])
    generator = torch.Generator().manual_seed(rank)  # each rank trains on its own data
    for _ in range(_STEPS):
        x = torch.randn(8, 4, generator=generator).to(ak.device())
        loss = model(x).float().pow(2).mean()
        ak.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    after = torch.cat([p.detach().flatten().float().cpu() for p in ak.unwrap(model).parameters()])
    everyone = ak.gather_object(after)
    differ = [r for r, params in enumerate(everyone) if not torch.equal(params, everyone[0])]
    if differ:
        spread = max((params - everyone[0]).abs().max().item() for params in everyone)
        raise CheckFailed(f"parameters differ from rank 0's on ranks {differ} (by up to {spread:.3g})")
    if torch.equal(after, before):
        raise CheckFailed(f"parameters did not change in {_STEPS} optimizer steps")
    wrapper = type(model).__name__
    return f"{_STEPS} SGD steps of a Linear(4, 2) ({wrapper}): parameters identical on every rank"


def _precision() -> str:
    import accelkit as ak
    from accelkit._strategies.single import PRECISION_DTYPES

    mode = ak.state().options.precision
    want = torch.float32 if mode == "no" else PRECISION_DTYPES.get(mode)
    if want is None:
        raise _Skipped(f"precision {mode!r} has no autocast dtype to check")
    a = torch.ones(2, 2, device=ak.device())
    with ak.precision():
        dtype = (a @ a).dtype
    if dtype != want:
        raise CheckFailed(f"precision {mode!r}: a matmul under ak.precision() gave {dtype}, expected {want}")
    return f"ak.precision() with {mode!r} computes matmuls in {dtype}"


def _debug_mode() -> str:
    import accelkit as ak

    if not ak.state().options.debug:
        raise _Skipped("debug mode is off (turn it on with `debug: true` in the config file, or ACCELKIT_DEBUG=1)")
    if ak.world_size() < 2:
        raise _Skipped("a mismatch needs 2 or more processes")
    try:  # each rank passes a different shape on purpose
        ak.reduce(torch.zeros(ak.rank() + 1, device=ak.device()), op="sum")
    except ak.DistributedOperationError:
        ak.wait_for_everyone()  # and the group is still usable afterwards
        return "a reduce of mismatched shapes raised DistributedOperationError on every rank"
    raise CheckFailed("a reduce of mismatched shapes did not raise DistributedOperationError")
