"""The agreement that ends each attempt of ``find_executable_batch_size`` with several processes.

See :mod:`accelkit._memory` for the protocol: ranks report through the job's key-value
store (not the possibly broken process group), and re-form the group after a rank ran out
of memory.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from . import _env, _state
from ._group import destroy

_GRACE = 60.0  # seconds beyond the collective timeout that ranks wait for each other after an attempt
_KEYS = ("size", "failures", "arrived", "done")


class Verdict(NamedTuple):
    """What every rank reported after one attempt: (rank, kind, summary) of each failure."""

    failures: list[tuple[int, str, str]]

    def ranks(self, kind: str) -> list[int]:
        return sorted(r for r, k, _ in self.failures if k == kind)

    def describe(self, kind: str) -> str:
        return "; ".join(f"rank {r}: {s}" for r, k, s in sorted(self.failures) if k == kind)


class Team:
    """This process's side of the agreements of a multi-process run (see the module's notes)."""

    def __init__(self, st: _state.ProcessState, store: Any) -> None:
        self.st, self.store = st, store  # the raw store: it outlives the groups built on it
        self.prefix = _state.group.prefix  # the keys of this group's agreements (see _state.GroupState)
        self.wait = timedelta(seconds=st.options.timeout + _GRACE)
        self.number = -1

    @classmethod
    def join(cls) -> Team | None:
        """The team with several processes; None with one (no process group is created)."""
        many = _state.is_initialized() or dist.is_initialized() or _env.detect_launch().world_size > 1
        st = _state.get() if many else None
        if st is None or not st.distributed:
            return None
        store = _state.group.job_store  # the group accelkit formed: the store it formed it on
        if store is None:  # a group the user formed: torch knows its store
            from . import _torch_private

            store = _torch_private.default_store()
            while isinstance(store, dist.PrefixStore):  # type: ignore[attr-defined]
                store = store.underlying_store
        return cls(st, store)

    def report(self, batch_size: int, kind: str, failure: BaseException | None) -> None:
        """Post this rank's outcome (``kind`` "" when it succeeded); the last to arrive releases all."""
        # Every rank counts its agreements in the same order, so that their store keys match.
        group = _state.group
        self.number, group.agreements = group.agreements, group.agreements + 1
        key = self._key(self.number)
        seen = self.store.compare_set(f"{key}/size", "", str(batch_size)).decode()
        if seen != str(batch_size):
            self._post(key, "size", f"batch_size={batch_size}, but another rank has {seen}")
        if failure is not None:
            self._post(key, kind, summary(failure))
        if self.store.add(f"{key}/arrived", 1) == self.st.world_size:
            self.store.set(f"{key}/done", "1")
            if group.previous_agreement:  # every rank has read the previous agreement's keys by now
                for name in _KEYS:
                    self.store.delete_key(f"{group.previous_agreement}/{name}")
        group.previous_agreement = key

    def agree(self, batch_size: int, kind: str, failure: Exception | None) -> Verdict:
        """Report, then wait until every rank has; what they reported."""
        self.report(batch_size, kind, failure)
        key = self._key(self.number)
        try:
            self.store.wait([f"{key}/done"], self.wait)
        except RuntimeError as exc:
            raise RuntimeError(
                f"accelkit.find_executable_batch_size: rank {self.st.rank} waited {self.wait.total_seconds():g} s "
                f"for the other processes to finish their attempt with batch_size={batch_size}; one of them is "
                f"stuck or gone (every rank must call the decorated function)"
            ) from exc
        if not self.store.check([f"{key}/failures"]):
            return Verdict([])
        lines = self.store.get(f"{key}/failures").decode().splitlines()
        return Verdict([(int(r), k, s) for r, k, s in (line.split("\t", 2) for line in lines)])

    def report_error(self, batch_size: int, error: Exception) -> None:
        """Tell the other ranks not to wait: this one raises ``error``, which must come out unchanged."""
        with contextlib.suppress(Exception):
            self.report(batch_size, "error", error)

    def recover(self, verdict: Verdict, call: str, failure: Exception | None) -> None:
        """After a failed attempt: raise, or re-form the group for a retry when a rank ran out of memory."""
        if verdict.ranks("error"):
            raise RuntimeError(
                f"{call} raised on another process ({verdict.describe('error')}); find_executable_batch_size "
                f"stops on every rank (that rank raised the error itself)"
            ) from failure
        if verdict.ranks("size"):
            raise ValueError(
                f"accelkit.find_executable_batch_size: the processes called {call.split('(')[0]} with different "
                f"batch sizes ({verdict.describe('size')}); give every rank the same starting_batch_size"
            ) from failure
        break_group()  # on the ranks that succeeded too, so that nothing keeps the old group alive
        _state.reform_group(self.store, f"{self.prefix}/regroup{self.number}")
        if not verdict.ranks("oom"):  # a collective failed, and not because a rank ran out of memory
            if failure is not None:
                raise failure
            raise RuntimeError(f"{call} failed on {verdict.describe('comm')}")

    def _key(self, number: int) -> str:
        return f"{self.prefix}/batch-size/{number}"

    def _post(self, key: str, kind: str, summary: str) -> None:
        self.store.append(f"{key}/failures", f"{self.st.rank}\t{kind}\t{summary}\n")


def is_lost_peer(exc: BaseException) -> bool:
    """Whether a collective failed because a peer broke the group (or never came)."""
    from ._rundir import lost_peer

    return lost_peer(exc) or any(isinstance(e, dist.DistError) for e in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def drop_frames(exc: BaseException) -> None:
    for e in _chain(exc):
        traceback.clear_frames(e.__traceback__)


def break_group() -> weakref.ref[Any] | None:
    """Destroy this process's group; a weak reference to it, alive if something still holds it."""
    group = destroy()
    return weakref.ref(group) if group is not None else None


def summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
