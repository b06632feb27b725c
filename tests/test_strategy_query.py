"""ak.strategy(): Accelerate's distributed_type, as the strategy this job trains with."""

from __future__ import annotations

import pytest

import accelkit as ak
from accelkit.testing import WorkerPool


def strategies() -> tuple[str, str]:
    default = ak.strategy()
    ak.init(strategy="fsdp")
    return default, ak.strategy()


@pytest.mark.distributed
def test_several_processes_report_ddp_or_fsdp(pool: WorkerPool) -> None:
    assert pool.run(strategies) == [("ddp", "fsdp")] * 2


def test_one_process_is_single_even_when_fsdp_is_asked_for() -> None:
    assert ak.strategy() == "single"
    ak.init(strategy="fsdp")
    assert ak.strategy() == "single"
