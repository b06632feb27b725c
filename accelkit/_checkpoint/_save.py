"""One ``ak.save_state``, step by step: begin on the calling thread, then write, agree, commit, prune.

:func:`begin` agrees on the place and opens the save's files there (the main process; one exchange on
the training thread). :func:`write` does the rest, on the calling thread for a blocking save, on a
background thread (``_async``) for ``blocking=False``: each rank writes its files (fsynced locally,
uploaded on an object store), the ranks agree that all succeeded, the main process writes the manifest,
the commit (``_storage``), the ranks agree again, and only then is anything pruned.
"""

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .. import _group, _state
from . import _files, _integrity, _layout, _manifest, _rank_state, _sharded
from ._agree import Agreement
from ._objects import Contents
from ._storage import Staging, Storage, crash_point

__all__ = ["Job", "begin", "discarding", "write"]


class Job(NamedTuple):
    """Everything a save needs once ``save_state`` has returned (the contents may be staged copies)."""

    call: str
    storage: Storage  # the checkpoint's place
    staging: Staging  # its files until the commit
    rank: int
    world_size: int
    contents: Contents
    rank_state: bytes  # this rank's RNG states, scaler and loader positions, as captured at the call
    facts: dict[str, str]
    keep_last: int | None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def target(self) -> Path | str:
        """What ``save_state`` returns: the checkpoint's path, or its URL."""
        return self.storage.location()


def begin(call: str, storage: Storage, keep_last: int | None, contents: Contents) -> Job:
    """Agree on the place and open the save's files there; every rank must call it."""
    st = _state.get()
    agree, nothing = Agreement.here(call), "nothing was written"
    opened: list[Staging] = []

    def start() -> tuple[str, str]:  # one exchange: the main process opens the save, every rank says where it saves
        token = uuid.uuid4().hex[:12]  # rank 0's names the save's files
        storage.check_access()  # every rank writes files of its own there
        if st.is_main_process:
            opened.append(storage.begin(token))
        return token, str(storage)

    try:
        parts = agree.gather(nothing, start)
    except BaseException:
        for staging in opened:  # opened empty just now
            with contextlib.suppress(OSError):
                staging.discard()
        raise
    token, main_target = parts[0]
    elsewhere = [(rank, where) for rank, (_, where) in enumerate(parts) if where != main_target]
    if elsewhere:  # every rank has every rank's path: every rank raises the same error
        for staging in opened:
            staging.discard()  # opened empty just now
        raise agree.failure(
            nothing,
            [
                (
                    rank,
                    f"CheckpointError: rank {rank} saves to {where!r} but rank 0 to {main_target!r}; a checkpoint is "
                    f"one directory: pass the same path on every rank (decide it on the main process and share it "
                    f"with ak.broadcast_object(path), or derive it from the step)",
                )
                for rank, where in elsewhere
            ],
        )
    staging = opened[0] if opened else storage.staging(token)
    rank_state = json.dumps(_rank_state.capture()).encode()
    facts = _group.job_facts(st.options, st.world_size)
    return Job(call, storage, staging, st.rank, st.world_size, contents, rank_state, facts, keep_last)


def write(job: Job, agree: Agreement, group: Any = None) -> Path | str:
    """Write, agree, commit and prune; every rank must call it. ``group``: DCP's (None: the default)."""
    undo = f"nothing was committed; the previous checkpoints are untouched and {job.staging.what} was removed"
    contents, staging = job.contents, job.staging

    def files_of_this_rank() -> dict[str, _integrity.FileRecord]:
        files = {}
        for name, sd in contents.sharded.items():  # first: dcp.save fails on every rank or on none, in step
            files.update(_sharded.save(staging, _layout.sharded_folder(name), sd, job.world_size > 1, group))
        if job.main:
            for name, sd in contents.plain.items():
                files[_layout.object_file(name)] = _files.write_torch(staging, _layout.object_file(name), sd)
            if contents.tensors:
                files[_layout.VALUES] = _files.write_torch(staging, _layout.VALUES, contents.tensors)
        rank_file = _layout.rank_file(job.rank)
        files[rank_file] = _files.write_bytes(staging, rank_file, job.rank_state)
        if not job.main:
            staging.wait()  # this rank's files are durable before it says so
        return files

    def commit() -> None:
        if job.main:
            for name in contents.sharded:
                _sharded.check_listed(staging, _layout.sharded_folder(name), files)
            manifest = _manifest.build(
                files,
                contents.objects,
                contents.values,
                job.world_size,
                sorted(contents.sharded),
                job.facts,
                full=contents.full,
                tensor_values=sorted(contents.tensors),
                folder=staging.folder,
            )
            staging.commit(manifest)  # waits for this rank's files too

    with discarding(job, agree) as writing, staging:  # on failure, the files being finished end before the discard
        parts = writing.gather(undo, files_of_this_rank)
        files = {name: rec for part in parts for name, rec in part.items()}
        writing.each(undo, commit)
    if job.keep_last is not None:
        keep = job.keep_last
        agree.each(
            f"{job.storage} was committed but pruning failed",
            lambda: prune(job.storage, keep) if job.main else None,
        )
    return job.target


def prune(target: Storage, keep_last: int) -> None:
    """Remove the oldest committed checkpoints beside ``target`` beyond ``keep_last`` (``target`` among those kept)."""
    found = [other for _, other in _manifest.committed(target.parent()) if not other.same(target)]
    for other in found[: max(0, len(found) - (keep_last - 1))]:
        crash_point(f"prune:{other.name}")
        other.remove()


@contextlib.contextmanager
def discarding(job: Job, agree: Agreement) -> Iterator[Agreement]:
    """``agree``, for the steps that write the save's files: if one fails, the main process removes them.

    Only once an agreement came back (every rank's step had ended: none writes any more); when the
    exchange itself failed (a rank gone) or this rank stopped before it, they are left for the next save.
    """
    came_back = agree.exchange is None  # one process: its own step has ended

    def exchange(outcome: Any) -> list[Any]:
        nonlocal came_back
        outcomes = agree.exchange(outcome) if agree.exchange is not None else [outcome]
        came_back = True
        return outcomes

    try:
        yield agree if agree.exchange is None else agree._replace(exchange=exchange)
    except BaseException as error:
        if job.main and came_back:
            try:
                job.staging.discard()
            except OSError as exc:  # the message said they were removed: say what is left
                note = getattr(error, "add_note", None)  # Python 3.11+
                if note is not None:
                    note(f"{job.staging.where} could not be removed ({exc}); the next save removes it")
        raise
