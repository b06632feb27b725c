"""ak.get_logger: rank filtering, ordering, levels, caller location, warning_once."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

import accelkit as ak
from accelkit.testing import WorkerPool


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[tuple[Any, Records]]:
    handler = Records()
    base = logging.getLogger("accelkit.tests")
    base.addHandler(handler)
    yield ak.get_logger("accelkit.tests", log_level="DEBUG"), handler
    base.removeHandler(handler)
    base.setLevel(logging.NOTSET)


def log_to_file(path: str, in_order: bool, main_process_only: bool, levels: tuple[str, str]) -> None:
    logger = logging.getLogger(f"accelkit.tests.pool.{path}")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    try:
        adapter = ak.get_logger(logger.name, log_level=levels[ak.rank()])
        if ak.rank() == 0:
            time.sleep(0.3)  # were the turns not enforced, rank 1 would log first
        adapter.info("rank %d", ak.rank(), in_order=in_order, main_process_only=main_process_only)
        ak.wait_for_everyone()
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_main_process_only_by_default(pool: WorkerPool, tmp_path: Any) -> None:
    path = str(tmp_path / "log.txt")
    pool.run(log_to_file, path, False, True, ("INFO", "INFO"))
    assert open(path).read() == "rank 0\n"


def test_every_rank_logs_when_asked(pool: WorkerPool, tmp_path: Any) -> None:
    path = str(tmp_path / "log.txt")
    pool.run(log_to_file, path, False, False, ("INFO", "INFO"))
    assert sorted(open(path).read().splitlines()) == ["rank 0", "rank 1"]


def test_in_order_logs_rank_zero_first(pool: WorkerPool, tmp_path: Any) -> None:
    path = str(tmp_path / "log.txt")
    pool.run(log_to_file, path, True, True, ("INFO", "INFO"))
    assert open(path).read() == "rank 0\nrank 1\n"


def test_in_order_with_different_levels_does_not_deadlock(pool: WorkerPool, tmp_path: Any) -> None:
    path = str(tmp_path / "log.txt")
    pool.run(log_to_file, path, True, True, ("ERROR", "INFO"), task_timeout=30)
    assert open(path).read() == "rank 1\n"


def test_records_point_at_the_caller(captured: tuple[Any, Records]) -> None:
    logger, handler = captured
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    logger.info("hello %s", "world")
    logger.log(logging.WARNING, "direct", in_order=True)
    logger.warning_once("once")
    assert [r.getMessage() for r in handler.records] == ["hello world", "direct", "once"]
    assert [r.lineno for r in handler.records] == [line, line + 1, line + 2]
    assert {r.filename for r in handler.records} == {"test_logging.py"}
    assert {r.funcName for r in handler.records} == {"test_records_point_at_the_caller"}


def test_warning_once(captured: tuple[Any, Records]) -> None:
    logger, handler = captured
    for _ in range(3):
        logger.warning_once("deprecated %s", "x")
    logger.warning_once("deprecated %s", "y")
    assert [r.getMessage() for r in handler.records] == ["deprecated x", "deprecated y"]


def test_level_from_environment(monkeypatch: pytest.MonkeyPatch, captured: tuple[Any, Records]) -> None:
    _, handler = captured
    monkeypatch.setenv("ACCELKIT_LOG_LEVEL", "ERROR")
    logger = ak.get_logger("accelkit.tests")
    logger.warning("hidden")
    logger.error("shown")
    assert [r.getMessage() for r in handler.records] == ["shown"]
    assert ak.get_logger("accelkit.tests", log_level="DEBUG").isEnabledFor(logging.DEBUG)


def test_bad_level_is_named() -> None:
    with pytest.raises(ValueError, match="log_level='LOUD'"):
        ak.get_logger("accelkit.tests", log_level="LOUD")


def test_disabled_levels_create_no_state(captured: tuple[Any, Records]) -> None:
    logger, _ = captured
    logging.getLogger("accelkit.tests").setLevel(logging.ERROR)
    logger.info("nothing")
    assert not ak.is_initialized()
