"""One ``ak.save_state``, step by step: begin on the calling thread, then write, agree, commit, prune.

:func:`begin` agrees on the directory and creates the temporary one beside it (one exchange on the
training thread). :func:`write` does the rest, on the calling thread for a blocking save, on a
background thread (``_async``) for ``blocking=False``: each rank writes and fsyncs its files, the
ranks agree that all succeeded, the main process writes the manifest and renames the temporary
directory into place (``_commit``), the ranks agree again, and only then is anything pruned.
"""

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .. import _group, _safe_io, _state
from . import _commit, _files, _manifest, _rank_state, _sharded
from ._agree import Agreement
from ._objects import Contents

__all__ = ["VALUES", "Job", "begin", "discarding", "write"]

VALUES = "tensor-values.pt"  # object files are NAME.pt with NAME an identifier: no clash


class Job(NamedTuple):
    """Everything a save needs once ``save_state`` has returned (the contents may be staged copies)."""

    call: str
    target: Path
    tmp: Path
    rank: int
    world_size: int
    contents: Contents
    rank_state: bytes  # this rank's RNG states, scaler and loader positions, as captured at the call
    facts: dict[str, str]
    keep_last: int | None

    @property
    def main(self) -> bool:
        return self.rank == 0


def begin(call: str, directory: str | os.PathLike[str], keep_last: int | None, contents: Contents) -> Job:
    """Agree on the directory and create the temporary one; every rank must call it."""
    st = _state.get()
    target = Path(directory).absolute()
    agree, nothing = Agreement.here(call), "nothing was written"

    def start() -> tuple[str, str]:  # one exchange: the main process creates tmp, every rank says where it saves
        token = uuid.uuid4().hex[:12]  # rank 0's names the temporary directory
        if st.is_main_process:
            _commit.begin(target, target.with_name(f"{_commit.TMP}{target.name}-{token}"))
        return token, str(target)

    parts = agree.gather(nothing, start)
    token, main_target = parts[0]
    tmp = target.with_name(f"{_commit.TMP}{target.name}-{token}")
    elsewhere = [(rank, where) for rank, (_, where) in enumerate(parts) if where != main_target]
    if elsewhere:  # every rank has every rank's path: every rank raises the same error
        if st.is_main_process:
            tmp.rmdir()  # created empty just now
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
    rank_state = json.dumps(_rank_state.capture()).encode()
    facts = _group.job_facts(st.options, st.world_size)
    return Job(call, target, tmp, st.rank, st.world_size, contents, rank_state, facts, keep_last)


def write(job: Job, agree: Agreement, group: Any = None) -> Path:
    """Write, agree, commit and prune; every rank must call it. ``group``: DCP's (None: the default)."""
    undo = (
        f"nothing was committed; the previous checkpoints are untouched and the temporary directory {job.tmp.name} "
        f"was removed"
    )
    contents, tmp = job.contents, job.tmp

    flusher = _safe_io.Flusher()  # fsyncs each file while the next is written; the main process's, with the manifest

    def files_of_this_rank() -> dict[str, _safe_io.FileRecord]:
        files = {}
        for name, sd in contents.sharded.items():  # first: dcp.save fails on every rank or on none, in step
            files.update(_sharded.save(tmp / f"{name}{_sharded.SUFFIX}", sd, job.world_size > 1, group, flusher))
        if job.main:
            for name, sd in contents.plain.items():
                files[f"{name}.pt"] = _files.write_torch(tmp / f"{name}.pt", sd, flusher)
            if contents.tensors:
                files[VALUES] = _files.write_torch(tmp / VALUES, contents.tensors, flusher)
        rank_file = f"rank-{job.rank}.json"
        files[rank_file] = _files.write_bytes(tmp / rank_file, job.rank_state, flusher)
        if not job.main:
            flusher.wait()  # this rank's files are durable before it says so
        return files

    def commit() -> None:
        if job.main:
            for name in contents.sharded:
                _sharded.check_listed(tmp / f"{name}{_sharded.SUFFIX}", files)
            manifest = _manifest.build(
                files,
                contents.objects,
                contents.values,
                job.world_size,
                sorted(contents.sharded),
                job.facts,
                full=contents.full,
                tensor_values=sorted(contents.tensors),
            )
            _commit.commit(tmp, job.target, manifest, flusher)  # waits for this rank's files too

    with discarding(job, agree) as writing, flusher:  # on failure, the fsyncs left end before tmp is removed
        parts = writing.gather(undo, files_of_this_rank)
        files = {name: rec for part in parts for name, rec in part.items()}
        writing.each(undo, commit)
    if job.keep_last is not None:
        keep = job.keep_last
        agree.each(
            f"{job.target} was committed but pruning failed",
            lambda: _commit.prune(job.target, keep) if job.main else None,
        )
    return job.target


@contextlib.contextmanager
def discarding(job: Job, agree: Agreement) -> Iterator[Agreement]:
    """``agree``, for the steps that write into ``job.tmp``: if one fails, the main process removes ``job.tmp``.

    Only once an agreement came back (every rank's step had ended: none writes into it any more); when the
    exchange itself failed (a rank gone) or this rank stopped before it, ``job.tmp`` is left for the next save.
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
                shutil.rmtree(job.tmp)
            except FileNotFoundError:  # renamed into place before the failure
                pass
            except OSError as exc:  # the message said it was removed: say what is left
                note = getattr(error, "add_note", None)  # Python 3.11+
                if note is not None:
                    note(f"{job.tmp} could not be removed ({exc}); the next save removes it")
        raise
