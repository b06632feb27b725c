"""``ak.save_state(blocking=False)``: stage the state in host memory, write and commit it in the background.

The call collects the state and agrees on the directory as a blocking save does, then copies
every tensor into host memory (pinned when it comes from a GPU) with DCP's ``DefaultStager``,
which keeps those buffers between saves: from the second save on, staging is a copy into memory
already there (from torch 2.13 on; before, the stager drops them after each stage, and each save
takes a new one). A background thread then runs the rest of the save (``_save.write``): each rank
writes and fsyncs its files, the ranks agree over a gloo group of their own (never the training
loop's collectives), the main process commits, the ranks agree again, and then prune. Sharded
objects go through ``dcp.save`` on that thread and group, as DCP's own ``async_save`` does.

At most one save is in flight per process: the next ``save_state`` (and ``load_state``) waits
for it. Its failure is agreed on by every rank and raised, once, by the next ``save_state``,
``load_state``, ``ak.wait_for_checkpoint()`` or ``ak.end_training()``. ``ak.reset_state()``
and interpreter exit wait for it too (the thread is not a daemon: a script that ends right
after ``save_state`` still commits its checkpoint).
"""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from typing import Any

import torch

from .. import _state
from ..errors import CheckpointError
from . import _save
from ._agree import Agreement, exchange_on

__all__ = ["Saving", "finish", "start"]

# Before 2.13, DCP's DefaultStager closes itself after each stage (its buffers dropped, its copier
# emptied: a second stage fails), so each save stages with a new one there.
_STAGER_KEEPS_BUFFERS = torch.__version__ >= "2.13"


class Saving:
    """This process's save in flight, its outcome, and the staging buffers the next save reuses."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.stager = self._new_stager()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.call = ""

    def start(self, job: _save.Job, agree: Agreement, group: Any, staging: BaseException | None) -> None:
        def run() -> None:
            try:
                if staging is not None or agree.exchange is not None:  # a rank that could not stage stops them all
                    agree.each(
                        f"nothing was written; {job.tmp.name} is removed by the next save", lambda: _raise(staging)
                    )
                _save.write(job, agree, group)
            except BaseException as exc:  # kept for the next call on this rank (every rank has one)
                self.error = exc

        self.call, self.error = job.call, None
        self.thread = threading.Thread(target=run, name="accelkit-save-state")
        self.thread.start()

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(self.pin_memory, False, False, False))  # pinned, not shared, here, blocking

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with its tensors copied into host memory (the buffers of the last save, where they fit)."""
        staged: dict[str, Any] = self.stager.stage(state)  # a dict: blocking
        if not _STAGER_KEEPS_BUFFERS:  # torch closed the stager after staging: the next save needs a new one
            self.stager = self._new_stager()
        return staged

    def join(self) -> BaseException | None:
        """Wait for the save in flight, if any; its error, which is then forgotten."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        return error

    def close(self) -> None:
        """Wait for the save in flight; an error nothing reported becomes a warning (``reset_state``)."""
        error = self.join()
        self.stager.close()
        if error is not None:
            warnings.warn(f"{self.call} (blocking=False) failed, and no later call reported it: {error}", stacklevel=2)


def finish(call: str) -> None:
    """Wait for this process's save in flight; raise its failure (the same on every rank), naming ``call``."""
    saving = _state.training.saving
    error = saving.join() if isinstance(saving, Saving) else None
    if error is not None:
        raise CheckpointError(f"{call}: the earlier save in the background failed: {error}") from error


def start(job: _save.Job) -> None:
    """Stage ``job``'s state in host memory and write it in the background; every rank must call it."""
    st = _state.get()
    saving = _state.training.saving
    if not isinstance(saving, Saving):
        saving = _state.training.saving = Saving(pin_memory=st.device.type == "cuda")
    contents, staging = job.contents, None
    try:
        staged = saving.stage({"plain": contents.plain, "sharded": contents.sharded})
        job = job._replace(contents=contents._replace(plain=staged["plain"], sharded=staged["sharded"]))
    except Exception as exc:  # out of host memory: the ranks still agree, in the background, that nothing is saved
        staging = exc
    group = _group() if st.distributed else None
    saving.start(job, Agreement(job.call, exchange_on(group) if group is not None else None), group, staging)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _group() -> Any:
    """The gloo group background saves agree over, made once per process group (a collective)."""
    group = _state.group.checkpoint_group
    if group is None:
        import torch.distributed as dist

        timeout = timedelta(seconds=_state.get().options.timeout)
        group = _state.group.checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
    return group
