"""A large job: the heartbeat and the node records write less often as the world grows, so that the
store's load stays bounded (``bench/scale.py`` measures the load; the README's "At scale" has the figures)."""

from __future__ import annotations

import pytest

from accelkit._group._heartbeat import STORE_WRITES_PER_S, Heartbeat, heartbeat_period
from accelkit._launcher._nodes import NodeBeat, node_beat_period
from accelkit._state import GroupState


@pytest.mark.parametrize("world", [1, 2, 8, 64, 256, 257, 1024, 4096, 65536])
def test_the_heartbeats_of_a_job_write_at_most_256_positions_a_second(world: int) -> None:
    period = heartbeat_period(world, interval=30.0)
    assert world / period <= STORE_WRITES_PER_S == 256
    # Up to 256 ranks a position is at most a second old, as before; beyond, the budget is spent whole.
    assert period == 1.0 if world <= 256 else world / period == 256


def test_the_heartbeat_period_stays_under_half_the_wait_line_interval_in_small_jobs() -> None:
    assert heartbeat_period(8, interval=1.0) == 0.5
    assert heartbeat_period(8, interval=0.0) == 1.0  # no "still waiting" lines
    assert heartbeat_period(1024, interval=1.0) == 4.0  # the store's budget first


def test_a_rank_of_a_1024_rank_job_beats_every_4_seconds() -> None:
    assert Heartbeat(None, "board", 5, 1024, GroupState(), 30.0).period == 4.0
    assert Heartbeat(None, "board", 5, 2, GroupState(), 30.0).period == 1.0


@pytest.mark.parametrize(("nodes", "period"), [(2, 0.5), (32, 0.5), (64, 1.0), (128, 2.0), (1024, 16.0)])
def test_the_node_records_of_a_job_are_at_most_64_writes_a_second(nodes: int, period: float) -> None:
    assert node_beat_period(nodes) == period
    assert nodes / node_beat_period(nodes) <= 64
    assert NodeBeat("127.0.0.1", 29500, "job", 0, nodes, 8, "127.0.0.1").period == period
