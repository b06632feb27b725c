"""Reading a checkpoint back: verify every file, deserialize what this rank needs, then apply it.

Every file is read through one :class:`~._snapshot.Snapshot` of the checkpoint: the files opened
once, so that the bytes verified are the bytes loaded. Phases one and two (:func:`read`) change
nothing: each rank checks its share of the files against the manifest (size, XXH3-128 of each
piece; the ranks agree on the outcome), and deserializes without running code from them
(``torch.load(weights_only=True)``, JSON, restricted unpickling of DCP's metadata; DCP's plans and
non-tensor items, :func:`readers`). Plain files are mapped, not copied (``_files``). Phase three
(:func:`apply`, the functions of :func:`readers`) changes the live objects, in the order given:
``dcp.load`` reads the verified shards into their tensors.
"""

import json
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from torch import nn

from .. import _frames, _safe_io, _state
from ..errors import CheckpointError
from . import _files, _full, _manifest, _rank_state, _sharded
from ._objects import unwrapped
from ._save import VALUES
from ._snapshot import Snapshot

__all__ = ["Loaded", "Verification", "apply", "read", "survey", "tensor_values"]

T = TypeVar("T")


class Loaded(NamedTuple):
    body: dict[str, Any]  # the manifest
    states: dict[str, Any]  # name -> state read from NAME.pt (a module's mapped from the file, others copied)
    mine: _rank_state.RankState | None  # this rank's RNG/scaler/loader state, None when it does not apply
    values: dict[str, Any]  # the plain values, tensors included
    metadata: dict[str, Any]  # name -> DCP's metadata of a sharded object, read once


def survey(
    path: Path, objects: dict[str, Any], st: _state.ProcessState, strict: bool | None
) -> tuple[Snapshot, list[str]]:
    """The checkpoint, open, its manifest checked against ``objects`` and this job; and the files this rank verifies.

    The caller closes the snapshot.
    """
    try:
        snapshot = Snapshot.take(path)
    except CheckpointError as exc:
        if not (path / _manifest.MANIFEST).is_file() or "while it was being loaded" in str(exc):
            raise  # not a checkpoint at all, or gone: nothing to suggest
        raise CheckpointError(f"{exc}; {_manifest.instead(path)}") from None
    try:
        return snapshot, _expected(path, snapshot.body, objects, st, strict)
    except BaseException:
        snapshot.close()
        raise


def _expected(
    path: Path, body: dict[str, Any], objects: dict[str, Any], st: _state.ProcessState, strict: bool | None
) -> list[str]:
    _warn_versions(path, body, st)
    missing = sorted(set(objects) - set(body.get("objects", [])))
    if missing:
        raise CheckpointError(f"{path} has no {missing}; it holds {body.get('objects')}, pass those names")
    if body.get("world_size") != st.world_size and strict is True:  # asked for: a resume that needs every rank's
        raise CheckpointError(
            f"{path} was saved by {body.get('world_size')} processes, this job has {st.world_size}, and strict=True "
            f"asks for the per-rank RNG and dataloader state, which fits only {body.get('world_size')} processes; "
            f"resume with the same number, or leave strict out (or pass strict=False) to load the objects without it"
        )
    sharded = body["sharded"]
    expected = [f"{name}{_sharded.SUFFIX}/.metadata" if name in sharded else f"{name}.pt" for name in body["objects"]]
    expected += [f"rank-{r}.json" for r in range(body["world_size"])] + ([VALUES] if body["tensor_values"] else [])
    return _share(sorted(set(expected) | set(body["files"])), body["files"], st)


class Verification:
    """This rank's share of a checkpoint's files, checked against the manifest on a thread of its own.

    It runs while the files are read (DCP's planning, mapping plain files); nothing is applied
    before :meth:`check` has passed on every rank. Each file's pieces are checksummed apart, and
    the thread that calls :meth:`check` takes pieces too, so that two cores share what is left.
    The files are the snapshot's: the bytes checked are those that are loaded.
    """

    def __init__(self, snapshot: Snapshot, names: list[str]) -> None:
        self.problem = ""
        self._snapshot, self._names, self._files = snapshot, names, snapshot.body["files"]
        self._problems: dict[int, str] = {}  # by index in names: the first problem of each file
        self._pieces: list[tuple[int, int, int, int]] = []  # (index in names, piece, offset, length)
        self._bad: dict[int, tuple[int, str]] = {}  # index -> (its first piece found wrong, what is wrong)
        self._maps: dict[int, Any] = {}  # index -> the file, mapped
        self._next, self._lock, self._ready, self._done = 0, threading.Lock(), threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="accelkit-verify")
        self._thread.start()

    def _run(self) -> None:
        try:
            for index, name in enumerate(self._names):
                try:
                    problem = "is missing from the manifest" if name not in self._files else self._open(index, name)
                except OSError as exc:
                    problem = f"cannot be read ({exc.strerror})"
                if problem:
                    self._problems[index] = problem
        finally:
            self._ready.set()
        self._work()

    def _open(self, index: int, name: str) -> str | None:
        if self._snapshot.missing(name):
            return "is missing"
        record = self._files[name]
        problem = _safe_io.size_problem(self._snapshot.size(name), record)
        if problem is None and record["size"]:
            self._maps[index] = mmap.mmap(self._snapshot.fd(name), 0, access=mmap.ACCESS_READ)
            self._pieces += [(index, k, at, n) for k, (at, n) in enumerate(_safe_io.pieces(record))]
        return problem

    def _work(self) -> None:
        """Checksum pieces until none is left (on the verifying thread and the one waiting for it)."""
        while True:
            with self._lock:
                task, self._next = self._next, self._next + 1
            if task >= len(self._pieces):
                return
            index, piece, at, length = self._pieces[task]
            whole = memoryview(self._maps[index])
            try:
                with whole[at : at + length] as view:
                    problem = _safe_io.piece_problem(self._files[self._names[index]], piece, view)
            finally:
                whole.release()
            if problem is not None:
                with self._lock:  # the first piece of the file that is wrong
                    if self._bad.get(index, (piece + 1,))[0] > piece:
                        self._bad[index] = (piece, problem)

    def _verdict(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        for index, name in enumerate(self._names):
            problem = self._problems.get(index) or self._bad.get(index, (0, ""))[1]
            if problem:
                path = self._snapshot.path
                self.problem = f"{path / name} {problem}; the checkpoint is damaged: {_manifest.instead(path)}"
                return

    def join(self) -> None:
        """Wait for the check to end (its files unmapped), helping it; called by one thread, the one that loads."""
        if self._done:
            return
        self._ready.wait()
        self._work()
        self._thread.join()
        self._done = True
        self._verdict()

    def check(self) -> None:
        """Wait for the check (taking pieces of it meanwhile); CheckpointError naming the first damaged file."""
        self.join()
        if self.problem:
            raise CheckpointError(self.problem)

    def first(self, step: Callable[[], T]) -> T:
        """``step()``; when it fails, a damaged file this check finds is given as the reason instead."""
        try:
            return step()
        except Exception:
            self.check()
            raise


def read(snapshot: Snapshot, objects: dict[str, Any], st: _state.ProcessState, strict: bool | None) -> Loaded:
    """Deserialize what this rank needs (plain files mapped, DCP metadata checked, values, rank state)."""
    path, body = snapshot.path, snapshot.body
    files: dict[str, _safe_io.FileRecord] = body["files"]
    states, metadata = {}, {}
    for name in objects:
        if name in body["sharded"]:
            folder = f"{name}{_sharded.SUFFIX}"
            metadata[name] = _sharded.read_metadata(snapshot, f"{folder}/{_sharded.METADATA}")
            unlisted = sorted(f"{folder}/{ref}" for ref in _sharded.referenced_files(metadata[name]))
            unlisted = [ref for ref in unlisted if ref not in files]
            if unlisted:
                raise CheckpointError(f"{path / unlisted[0]} is missing from the manifest; the checkpoint is damaged")
            continue
        state = _load_file(snapshot, f"{name}.pt")  # mapped from the file
        # A module's load_state_dict copies from the mapping; anything else keeps what it is given: its own copy,
        # made here, while the files are being verified.
        states[name] = state if isinstance(unwrapped(objects[name]), nn.Module) else _files.owned(state)
    values = {**body["values"], **tensor_values(snapshot)}
    return Loaded(body, states, _mine(snapshot, st, strict, f"rank-{st.rank}.json"), values, metadata)


def tensor_values(snapshot: Snapshot) -> dict[str, Any]:
    """The values saved beside tensors (``tensor-values.pt``), read into memory of their own."""
    body = snapshot.body
    if not body["tensor_values"]:
        return {}
    found = _files.owned(_load_file(snapshot, VALUES))
    if not (isinstance(found, dict) and sorted(found) == sorted(body["tensor_values"])):
        path = snapshot.path / VALUES
        raise CheckpointError(f"{path} does not hold the values {body['tensor_values']} the manifest names")
    return dict(found)


def _load_file(snapshot: Snapshot, name: str) -> Any:
    try:
        found = _files.load_torch(snapshot.opener(name))
    except Exception as exc:
        path = snapshot.path
        raise CheckpointError(
            f"{path / name} was refused: {str(exc).splitlines()[0]}; {_manifest.instead(path)}"
        ) from None
    snapshot.check_same(name)
    return found


def _mine(
    snapshot: Snapshot, st: _state.ProcessState, strict: bool | None, rank_file: str
) -> _rank_state.RankState | None:
    """This rank's state to restore, or None when it is skipped (said in a warning).

    ``strict``: True refuses what does not fit; False skips it, each rank saying what it skipped;
    None (the default) skips the per-rank state of another world size, which cannot fit (one
    warning, on the main process: evaluation or fine-tuning on another number of processes),
    and refuses the rest, which a resume on the same world size needs.
    """
    path, body = snapshot.path, snapshot.body
    what = "its RNG states, grad scaler and dataloader positions were not restored"
    if rank_file not in body["files"] or body["world_size"] != st.world_size:  # not our ranks (strict is not True)
        saved = f"saved by {body['world_size']} processes, this job has {st.world_size}"
        if strict is None:  # (the same world size without the file: the verification names it, before any change)
            if body["world_size"] != st.world_size:
                _skipped_ranks(path, body, st)
        else:
            _skipped(path, st, f"{path / rank_file} ({saved}): {what}")
        return None
    try:
        mine = _rank_state.decode(json.loads(snapshot.read_bytes(rank_file)), st.rank)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path / rank_file} is malformed: {exc}") from None
    problem = _rank_state.check_fits(mine)
    if problem and strict is not False:
        raise CheckpointError(f"{path / rank_file} does not fit this run: {problem}")
    if problem:
        _skipped(path, st, f"{path / rank_file} ({problem}): {what}")
        return None
    if mine.numpy is not None and _rank_state.numpy_missing():
        if strict is not False:
            raise CheckpointError(
                f"{path / rank_file} holds NumPy's random state, but numpy cannot be imported here, so it "
                f"cannot be restored: pip install numpy, or pass strict=False to load everything else"
            )
        _skipped(path, st, f"NumPy's random state in {path / rank_file} (numpy cannot be imported here)")
        mine = mine._replace(numpy=None)
    return mine


def _skipped_ranks(path: Path, body: dict[str, Any], st: _state.ProcessState) -> None:
    """The default (strict=None) on another world size: objects load, each rank's own state is skipped; said once."""
    if not st.is_main_process:
        return
    saved = body["world_size"]
    files = "rank-0.json" if saved == 1 else f"rank-0.json to rank-{saved - 1}.json"
    _warn_at_user(
        f"accelkit.load_state({os.fspath(path)!r}): saved by {saved} processes, this job has {st.world_size}: "
        f"the objects are restored, but not the per-rank state ({files}: RNG states, grad scaler, dataloader "
        f"positions), which fits only {saved} processes. Enough to evaluate or fine-tune; to resume training "
        f"exactly, run {saved} processes (strict=True refuses such a load instead of skipping)"
    )


def _skipped(path: Path, st: _state.ProcessState, what: str) -> None:
    """``strict=False`` left something out: say what, on the rank it concerns, at the user's call."""
    _warn_at_user(f"accelkit.load_state({os.fspath(path)!r}, strict=False): rank {st.rank} skipped {what}")


def _warn_at_user(message: str) -> None:
    """A UserWarning pointing at the user's ``load_state`` call."""
    frame = _frames.user_frame()
    warnings.warn_explicit(
        message,
        UserWarning,
        frame.f_code.co_filename if frame else "<unknown>",
        frame.f_lineno if frame else 0,
    )


def apply(call: str, path: Path, name: str, obj: Any, loaded: Loaded, owners: dict[str, Any]) -> None:
    """Load ``loaded``'s state of ``name`` into ``obj`` (read from ``NAME.pt``); CheckpointError if it does not fit."""
    target, state, full = unwrapped(obj), loaded.states[name], name in loaded.body["full"]
    try:
        if isinstance(target, nn.Module):
            _full.load_module(target, state)  # copies from the mapped file into the parameters
        elif full:
            _full.load_optimizer(owners[name], target, state)
        else:
            target.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(f"{call}: {path / name}.pt does not fit {name}: {exc}") from exc


def check_fits(call: str, path: Path, objects: dict[str, Any], body: dict[str, Any]) -> list[str]:
    """The names of ``objects`` to load from DCP folders; CheckpointError for what cannot load at all."""
    sharded = [name for name in objects if name in body["sharded"]]
    for name, obj in objects.items():
        target = unwrapped(obj)
        if name in sharded or name in body["full"] or isinstance(target, nn.Module):
            continue  # a module's plain state_dict() is also its full state: it loads sharded or not
        if _state.strategy().shards_state(target):
            raise CheckpointError(
                f"{call}: {path / name}.pt was saved unsharded but {name} here holds sharded (DTensor) state; "
                f"save it with ak.save_state(..., full_state=True) to load it into any strategy, or load it into "
                f"the unsharded model and optimizer, then shard them"
            )
    return sharded


def readers(snapshot: Snapshot, objects: dict[str, Any], loaded: Loaded, owners: dict[str, Any]) -> dict[str, Any]:
    """For each DCP object, checked against the checkpoint, the function that reads this rank's shards in place."""
    out: dict[str, Callable[[], None]] = {}
    for name, metadata in loaded.metadata.items():
        folder = f"{name}{_sharded.SUFFIX}"
        out[name] = _sharded.load(snapshot, folder, unwrapped(objects[name]), owners[name], metadata)
    return out


def _warn_versions(path: Path, body: dict[str, Any], st: _state.ProcessState) -> None:
    """Once per process and versions, on the main process: the checkpoint comes from other versions."""
    change = _manifest.version_change(body)
    warned = _state.this_process.warned
    if change and st.is_main_process and change not in warned:
        warned.add(change)
        _warn_at_user(
            f"accelkit.load_state({os.fspath(path)!r}): {change}. Loading it anyway; if it does not load or "
            f"resumes differently, load it with the versions that saved it."
        )


def _share(names: list[str], files: dict[str, _safe_io.FileRecord], st: _state.ProcessState) -> list[str]:
    """The files this rank verifies: every listed file goes to one rank, largest first to the least loaded.

    Unlisted names (expected but missing from the manifest) go to every rank. The ranks agree
    on the outcome before anything is applied, so each file is read once in the whole job.
    """
    load, mine = [0] * st.world_size, []
    for name in sorted((n for n in names if n in files), key=lambda n: (-int(files[n]["size"]), n)):
        rank = load.index(min(load))
        load[rank] += int(files[name]["size"]) + 1
        if rank == st.rank:
            mine.append(name)
    return [n for n in names if n not in files] + mine
