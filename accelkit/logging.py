"""``ak.get_logger``: a standard logger that knows about ranks."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from . import _env, _state
from ._process import wait_for_everyone

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Every logging method takes ``main_process_only=True`` and ``in_order=False``.

    ``in_order=True`` makes every rank log, one after the other, rank 0 first. The ranks
    meet at a barrier after each turn whatever their log level, so ranks configured with
    different levels cannot deadlock; every rank must make the call.

    ``stacklevel`` counts as in Accelerate's adapter: 2 (the default) is the line that called
    the logging method, 3 that line's caller (for a helper that logs on its caller's behalf).

    Args:
        logger: the ``logging.Logger`` to wrap.
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._warned: set[tuple[object, ...]] = set()

    def log(  # type: ignore[override]
        self,
        level: int,
        msg: object,
        *args: object,
        main_process_only: bool = True,
        in_order: bool = False,
        stacklevel: int = 2,
        **kwargs: Any,
    ) -> None:
        # +1: _emit's frame stands between this one and the logger (Accelerate's adapter has only this one).
        stacklevel += 1
        if in_order:
            st = _state.get()
            for turn in range(st.world_size):
                if turn == st.rank and self.isEnabledFor(level):
                    self._emit(level, msg, args, stacklevel, kwargs)
                wait_for_everyone()
            return
        if not self.isEnabledFor(level):
            return
        if main_process_only and not _state.get().is_main_process:
            return
        self._emit(level, msg, args, stacklevel, kwargs)

    def warning_once(self, msg: object, *args: object, stacklevel: int = 2, **kwargs: Any) -> None:
        """Log a warning the first time these arguments are seen by this logger."""
        key = (msg, args, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
        if key in self._warned:
            return
        self._warned.add(key)
        self.log(logging.WARNING, msg, *args, stacklevel=stacklevel + 1, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def _emit(self, level: int, msg: object, args: tuple[object, ...], stacklevel: int, kwargs: dict[str, Any]) -> None:
        msg, kwargs = self.process(msg, kwargs)  # type: ignore[assignment]
        self.logger.log(level, msg, *args, stacklevel=stacklevel, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger whose messages, by default, come from the main process only.

    Args:
        name: the logger's name, usually ``__name__``.
        log_level: the logger's level (``"INFO"``, ``logging.DEBUG``); ``None``: ``ACCELKIT_LOG_LEVEL``
            when set, else unchanged.

    Example:
        >>> import accelkit as ak
        >>> logger = ak.get_logger(__name__, log_level="INFO")
        >>> logger.info("on rank 0 only")
        >>> logger.info("on every rank, in turn", in_order=True)
    """
    # A script's `get_logger(__name__)` in a spawned worker, where the script was imported as __mp_main__.
    logger = logging.getLogger("__main__" if name == "__mp_main__" else name)
    level = log_level if log_level is not None else _env.read_str(_env.LOG_LEVEL)
    if level is not None:
        if isinstance(level, str):
            if not isinstance(logging.getLevelName(level.upper()), int):
                raise ValueError(
                    f"accelkit.get_logger(log_level={level!r}): expected one of "
                    f"DEBUG, INFO, WARNING, ERROR, CRITICAL (or a number)"
                )
            level = level.upper()
        logger.setLevel(level)
    return MultiProcessAdapter(logger)
