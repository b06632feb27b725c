"""The ranks' agreement after each step of a checkpoint: all succeeded, or every rank raises the same error.

A step runs on every rank; then the ranks exchange success or failure (a small message, never
the result), so that one rank's error never leaves the others waiting or goes on to a commit.
A blocking save agrees through accelkit's collectives; a background save (``blocking=False``)
through a gloo group of its own, so that it never interleaves with the training loop's collectives.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from .. import _collectives, _state
from ..errors import CheckpointError

__all__ = ["Agreement", "describe"]

T = TypeVar("T")
Exchange = Callable[[Any], list[Any]]  # every rank's object, in rank order (an all-gather)


def exchange_on(group: Any) -> Exchange:
    """An all-gather of small objects over ``group`` (a process group the caller's thread alone uses)."""
    return functools.partial(_collectives.exchange_objects, group=group)


class Agreement(NamedTuple):
    """Runs checkpoint steps on every rank of ``call`` and shares their outcome (``exchange`` None: one process)."""

    call: str
    exchange: Exchange | None

    @classmethod
    def here(cls, call: str) -> "Agreement":
        """Agreement through accelkit's collectives, on the calling (training) thread."""
        return cls(call, _collectives.gather_object if _state.get().distributed else None)

    def each(self, consequence: str, step: Callable[[], T]) -> T:
        """Run ``step`` on every rank; its result here, or the same CheckpointError on every rank."""
        return self._run(consequence, step, share=False)[0]

    def each_same(self, consequence: str, step: Callable[[], T], key: Callable[[T], str]) -> T:
        """:meth:`each`, and every rank's ``key`` of its result is the same (else the same CheckpointError everywhere).

        The keys travel (small strings); the results stay where they are.
        """
        value: Any = None

        def keyed() -> str:
            nonlocal value
            value = step()
            return key(value)

        keys = self._run(consequence, keyed, share=True)
        if len(set(keys)) > 1:
            raise self.failure(
                f"{consequence}; the ranks read different checkpoints (it was replaced while they read it): load it "
                f"again once the saves are done",
                [(rank, k) for rank, k in enumerate(keys)],
            )
        return value  # type: ignore[no-any-return]

    def gather(self, consequence: str, step: Callable[[], T]) -> list[T]:
        """:meth:`each`, returning every rank's result (keep results small: they travel)."""
        return self._run(consequence, step, share=True)

    def _run(self, consequence: str, step: Callable[[], T], share: bool) -> list[T]:
        error: Exception | None = None
        value: Any = None
        try:
            value = step()
            outcome: tuple[bool, Any] = (True, value if share else None)
        except Exception as exc:
            error, outcome = exc, (False, describe(exc))
        outcomes = self.exchange(outcome) if self.exchange is not None else [outcome]
        failed = [(rank, text) for rank, (ok, text) in enumerate(outcomes) if not ok]
        if failed:
            if isinstance(error, CheckpointError) and self.exchange is None:
                raise error
            raise self.failure(consequence, failed) from error
        return [v for _, v in outcomes] if share else [value]

    def failure(self, consequence: str, failed: list[tuple[int, str]]) -> CheckpointError:
        """The error every rank raises when the ranks ``failed`` (rank, what went wrong) did."""
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in failed)
        return CheckpointError(f"{self.call} failed, {consequence}:\n{lines}")


def describe(exc: BaseException) -> str:
    """One line for ``exc`` in a per-rank table; a full disk says so, with the fix."""
    if isinstance(exc, OSError) and exc.errno in (28, 122):  # ENOSPC, EDQUOT
        where = exc.filename or "the checkpoint directory"
        return f"no space left on device writing {where} ({exc.strerror}); free some space or save elsewhere"
    return f"{type(exc).__name__}: {exc}"
