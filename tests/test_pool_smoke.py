import accelkit as ak


def _facts() -> tuple[int, int]:
    return ak.rank(), ak.world_size()


def test_pool_runs(pool):
    assert pool.run(_facts) == [(0, 2), (1, 2)]
    assert pool.run(_facts) == [(0, 2), (1, 2)]
