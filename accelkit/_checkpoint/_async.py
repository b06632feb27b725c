"""``ak.save_state(blocking=False)``: stage the state in host memory, write and commit it in the background.

The call collects the state and agrees on the directory as a blocking save does, then copies
every tensor into host memory (pinned when it comes from a GPU) with DCP's ``DefaultStager``,
which keeps those buffers between saves: from the second save on, staging is a copy into memory
already there (from torch 2.13 on; before, the stager drops them after each stage, and each save
takes a new one; torch before 2.9 has no ``DefaultStager``, and each save copies the state by hand,
into new host memory, not pinned: :class:`_HostCopy`). A background thread then runs the rest of
the save (``_save.write``): each rank writes and fsyncs its files, the ranks agree over a gloo
group of their own (never the training loop's collectives), the main process commits, the ranks
agree again, and then prune. Sharded objects go through ``dcp.save`` on that thread and group, as
DCP's own ``async_save`` does. A save that fails after the temporary directory was made has it
removed by the main process, once the ranks' outcomes came back (no rank writes into it any more);
the previous checkpoints stay as they were.

At most one save is in flight per process: the next ``save_state`` (and ``load_state``) waits
for it. Its failure is agreed on by every rank and raised, once, by the next ``save_state``,
``load_state``, ``ak.wait_for_checkpoint()`` or ``ak.end_training()``: raised there, it is the
program's to handle (caught, it changes nothing else). The thread is not a daemon: a script that
ends right after ``save_state`` still commits its checkpoint (Python joins the thread before its
exit handlers run).

A failure no call raised is never lost. ``ak.reset_state()`` waits for the save and warns at once
(a notebook or a sweep sees it there), but a warning is no handling: the failure stays on record
for the process (a test that expects one raises it with ``ak.wait_for_checkpoint()``). At
interpreter exit (``python script.py``; each worker of ``accelkit launch`` and ``@ak.distributed``,
whose launcher then names the failed ranks and the error) a handler registered with the first
background save prints it to stderr, naming the call, the error and the fix (call
``ak.wait_for_checkpoint()`` before the end), records it for accelkit's launcher, ends the running
experiment trackers (marked failed), flushes ``sys.stdout``, ``sys.stderr`` and ``logging``, and
ends the process with ``os._exit(1)`` (Python ignores an exit handler's exit code; a script's own
``sys.exit(code)`` becomes 1). ``os._exit`` skips what the interpreter would still have done: the
exit handlers registered before that first background save (they run last to first, so after this
one: the user's own, ``multiprocessing``'s, which ends daemonic children, ``weakref.finalize``'s,
which removes ``tempfile.TemporaryDirectory`` folders), other finalizers (``__del__``), the flushing
of open files other than stdout and stderr, and accelkit's teardown of the process group (not
needed then: the interpreter's finalization, which it guards against, does not run either). A
successful save, or a failure a call raised, leaves the exit as it was.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any

import torch

from .. import _state, _tree
from ..errors import CheckpointError
from . import _save
from ._agree import Agreement, exchange_on

__all__ = ["Saving", "finish", "start"]

# Before 2.13, DCP's DefaultStager closes itself after each stage (its buffers dropped, its copier
# emptied: a second stage fails), so each save stages with a new one there.
_STAGER_KEEPS_BUFFERS = torch.__version__ >= "2.13"
_HAS_DEFAULT_STAGER = torch.__version__ >= "2.9"  # torch.distributed.checkpoint.staging.DefaultStager
_AT_EXIT = "end with exit code 1 on a background save failure no call raised"  # its record: _unreported()


class Saving:
    """This process's save in flight, its outcome, and the staging buffers the next save reuses."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.stager = self._new_stager()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.call = ""
        self.pid = os.getpid()  # a forked child inherits this object, not the save

    def start(self, job: _save.Job, agree: Agreement, group: Any, staging: BaseException | None) -> None:
        def run() -> None:
            try:
                if staging is not None or agree.exchange is not None:  # a rank that could not stage stops them all
                    with _save.discarding(job, agree) as staged:
                        staged.each(
                            f"nothing was written; {job.staging.what} was removed",
                            lambda: _raise(staging),
                        )
                _save.write(job, agree, group)
            except BaseException as exc:  # kept for the next call on this rank (every rank has one)
                self.error = exc

        _unreported()  # from the first background save on, interpreter exit checks that no failure was lost
        self.call, self.error = job.call, None
        self.thread = threading.Thread(target=run, name="accelkit-save-state")
        self.thread.start()

    def _new_stager(self) -> Any:
        if not _HAS_DEFAULT_STAGER:
            return _HostCopy()
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
        """Wait for the save in flight (``reset_state``); an error nothing raised is warned about, and kept for exit."""
        error = self.join()
        self.stager.close()
        if error is not None and self.pid == os.getpid():
            _unreported().append((self.pid, self.call, error))  # a warning handles nothing: the exit still fails
            if threading.main_thread().is_alive():  # else the interpreter is exiting: _end_if_unreported says it
                warnings.warn(
                    f"{self.call} (blocking=False) failed, and no later call reported it: {error}\nThe process "
                    f"still ends with exit code 1; to handle such a failure, call ak.wait_for_checkpoint() (it "
                    f"raises it) before ak.reset_state()",
                    stacklevel=4,  # the caller of ak.reset_state()
                )


class _HostCopy:
    """Staging before torch 2.9 (no ``DefaultStager``): a deep copy of the state, its tensors in host memory.

    DCP's older public ``BlockingAsyncStager`` cannot stand in: it keeps tensors already on the CPU
    as they are (no copy, so training would change what is being written), and its cached mode pins
    memory, which needs CUDA. Here ``copy.deepcopy`` copies everything (tensors that share a storage
    still share one), except plain tensors on an accelerator, which its memo maps to host copies
    made beforehand (a deep copy would put them on the device again). A DTensor or a tensor inside
    another object is deep-copied where it is.
    """

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        memo: dict[int, Any] = {}

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter) and id(t) not in memo:
                memo[id(t)] = t.detach().to("cpu", copy=True)
            return t

        _tree.apply_to_tensors(to_host, state)  # the tensors in its dicts, lists and tuples
        staged: dict[str, Any] = copy.deepcopy(state, memo)
        return staged

    def close(self) -> None:
        pass


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


# --- at interpreter exit ------------------------------------------------------------------------


def _unreported() -> list[tuple[int, str, BaseException]]:
    """This process's failures no call raised (pid, call, error), kept across ``reset_state``.

    The first call registers :func:`_end_if_unreported` to run at exit; the list is that hook's record.
    """
    _state.this_process.once(_AT_EXIT, _register_at_exit)
    failures: list[tuple[int, str, BaseException]] = _state.hooks[_AT_EXIT]
    return failures


def _register_at_exit() -> list[tuple[int, str, BaseException]]:
    atexit.register(_end_if_unreported)
    return []


def _end_if_unreported() -> None:
    """At exit (Python has joined the save thread by then): exit code 1 if a failure was never raised."""
    saving = _state.training.saving
    if isinstance(saving, Saving) and saving.pid == os.getpid():
        error = saving.join()
        if error is not None:
            _unreported().append((saving.pid, saving.call, error))
    failures = [(call, error) for pid, call, error in _unreported() if pid == os.getpid()]
    if failures:
        _exit_failed(failures)


def _exit_failed(failures: list[tuple[str, BaseException]]) -> None:
    """Say what failed on stderr, for the launcher and the trackers, then end the process with exit code 1."""
    try:
        fix = (
            "The process ends with exit code 1. To handle such a failure, call ak.wait_for_checkpoint() (or "
            "ak.end_training()) before the script ends: it raises it (a CheckpointError) where the script can catch it."
        )
        for call, error in failures:
            said = f"accelkit: {call} (blocking=False) failed in the background, and no later call raised it"
            sys.stderr.write(f"{said}:\n{error}\n")
        sys.stderr.write(f"{fix}\n")
        sys.stderr.flush()
        _record_for_launcher(failures[-1][1], f"{said}.\n{fix}\n")  # the launcher shows the error, then this
        for name, exc in _state.this_process.end_tracking(failed=True):  # their data kept, the run marked failed
            sys.stderr.write(f"accelkit: could not close the {name} tracker at exit: {exc!r}\n")
    finally:
        try:
            import logging

            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
            logging.shutdown()  # its own exit handler is skipped: registered before this one
        finally:
            os._exit(1)


def _record_for_launcher(error: BaseException, text: str) -> None:
    """Under ``accelkit launch`` or ``@ak.distributed``: the launcher names this rank's failure (root cause first)."""
    from .._rundir import record_failure

    record_failure(error, text)
