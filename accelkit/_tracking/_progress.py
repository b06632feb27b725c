"""``ak.progress``: a tqdm bar on the local main process, the plain loop elsewhere.

One bar per node, not one per rank. In a notebook (a process that no launcher started) the bar
is tqdm's widget (``tqdm.auto``); in launched workers, whose output is streamed as lines, it is
tqdm's text bar. tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar, cast

from .. import _state

__all__ = ["ProgressBar", "progress"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ProgressBar(Protocol[T_co]):
    """What ``ak.progress`` returns: iterate it; the bar's usual methods work on every rank."""

    def __iter__(self) -> Iterator[T_co]: ...
    def set_postfix(self, *args: Any, **kwargs: Any) -> Any: ...
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> Any: ...
    def set_description(self, *args: Any, **kwargs: Any) -> Any: ...
    def update(self, n: float = 1) -> Any: ...
    def close(self) -> Any: ...


class QuietBar(Generic[T]):
    """The loop without a bar: iterates the iterable itself (no cost per item); the bar's methods do nothing."""

    def __init__(self, iterable: Iterable[T]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[T]:
        return iter(self.iterable)

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> QuietBar[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        return None

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        return None

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update(self, n: float = 1) -> None:
        return None

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None


def progress(iterable: Iterable[T], **tqdm_kwargs: Any) -> ProgressBar[T]:
    """``tqdm(iterable, **tqdm_kwargs)`` on the local main process; elsewhere the loop without a bar.

    ``total`` comes from ``len(iterable)`` when it has one. Without tqdm installed every rank gets
    the loop without a bar, and one warning saying ``pip install tqdm``.

    Args:
        iterable: what to loop over.
        **tqdm_kwargs: tqdm's options (``desc``, ``total``, ``disable``, ...).

    Example:
        >>> import accelkit as ak
        >>> sum(ak.progress(range(4), desc="demo", disable=True))
        6
    """
    st = _state.get()
    if not st.is_local_main_process:
        return QuietBar(iterable)
    try:
        if st.launcher == "none":
            from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]
        else:  # a launched worker: its output reaches the terminal or the notebook as text
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        warnings.warn("ak.progress draws no bar: tqdm is not installed; pip install tqdm", stacklevel=2)
        return QuietBar(iterable)
    if "total" not in tqdm_kwargs:
        try:
            tqdm_kwargs["total"] = len(iterable)  # type: ignore[arg-type]
        except TypeError:  # no len(): tqdm counts without a total
            pass
    return cast("ProgressBar[T]", tqdm(iterable, **tqdm_kwargs))
