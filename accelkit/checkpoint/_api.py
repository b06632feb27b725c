"""Checkpoints that survive crashes: atomic save, verified safe load, exact resume.

Resuming after an elastic restart (``@ak.distributed(max_restarts=N)``) is two lines at
the start of the training function, after ``ak.prepare``::

    ckpt = ak.latest_checkpoint("checkpoints")
    start = ak.load_state(ckpt, model=model, optimizer=opt)["step"] if ckpt else 0

``ak.state().restart_count`` says how many times the group was restarted.

Layout of a checkpoint directory: ``NAME.pt`` per named object (its ``state_dict()``,
written by the main process), or ``NAME.dcp/`` for a sharded one (a module ``fully_shard``-ed,
its optimizer: each rank's shards, written with ``torch.distributed.checkpoint``),
``rank-R.json`` per rank (RNG states, grad scaler, prepared-dataloader positions) and
``manifest.json`` (file sizes and checksums, plain values, step, world size, versions), written last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .. import _frames, _group, _safe_io, _state, collectives
from .._safe_io import CheckpointError
from . import _commit, _manifest, _rank_state, _sharded

__all__ = ["CheckpointError", "latest_checkpoint", "load_state", "save_state"]

T = TypeVar("T")
_TMP = _commit.TMP


def save_state(directory: str | os.PathLike[str], *, keep_last: int | None = None, **objects: Any) -> Path:
    """Save ``objects`` and this job's RNG/scaler/dataloader state to ``directory``, atomically.

    Every rank must call it, with the same arguments. Objects with ``state_dict()`` are
    saved from the main process, sharded ones (DTensor state: a ``fully_shard``-ed model and
    its optimizer, passed together) by every rank with ``torch.distributed.checkpoint``;
    other values must be JSON-able (``load_state`` returns them). Each rank writes into a
    temporary directory beside ``directory``; once all succeeded, the main process writes
    the manifest and renames it into place. A crash or an error at any moment leaves the
    previous checkpoints as they were. With ``keep_last=K``, the oldest committed
    checkpoints beside it are then pruned to K.

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> ak.save_state("ckpt/step-10", model=model, step=10)  # doctest: +SKIP
        PosixPath('.../ckpt/step-10')
    """
    call = f"accelkit.save_state({os.fspath(directory)!r})"
    if not objects:
        raise TypeError(
            f"{call}: nothing to save; name what to save, e.g. ak.save_state(directory, model=model, "
            f"optimizer=optimizer, scheduler=scheduler, step=step) (accelkit does not save prepared objects by itself)"
        )
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"{call}: keep_last={keep_last!r}; expected None or an integer >= 1, e.g. keep_last=3")
    states, sharded, values = _split(call, objects)
    st = _state.get()
    target = Path(directory).absolute()
    token = str(collectives.broadcast_object(f"{uuid.uuid4().hex[:12]}|{target}" if st.is_main_process else None))
    tmp = target.with_name(f"{_TMP}{target.name}-{token[:12]}")
    main = st.is_main_process

    def same_directory() -> None:
        if token[13:] != str(target):  # inside an agreement: every rank raises, none waits
            raise CheckpointError(
                f"this rank saves to {str(target)!r} but rank 0 to {token[13:]!r}; a checkpoint is one directory: "
                f"pass the same path on every rank (decide it on the main process and share it with "
                f"ak.broadcast_object(path), or derive it from the step)"
            )

    _every_rank(call, "nothing was written", same_directory)
    _every_rank(call, "nothing was written", lambda: _commit.begin(target, tmp) if main else None)

    def write() -> dict[str, _safe_io.FileRecord]:
        files = {}
        for name, sd in sharded.items():  # first: dcp.save fails on every rank or on none, never out of step
            files.update(_sharded.save(tmp / f"{name}{_sharded.SUFFIX}", sd, st.distributed))
        if main:
            for name, sd in states.items():
                files[f"{name}.pt"] = _safe_io.write_file(tmp / f"{name}.pt", _torch_writer(sd))
        rank_data = json.dumps(_rank_state.capture()).encode()
        files[f"rank-{st.rank}.json"] = _safe_io.write_file(tmp / f"rank-{st.rank}.json", _bytes_writer(rank_data))
        return files

    undo = f"nothing was committed; the previous checkpoints are untouched and {tmp.name} is removed by the next save"
    parts = _every_rank_results(call, undo, write)
    files = {name: rec for part in parts for name, rec in part.items()}
    facts = _group.job_facts(st.options, st.world_size)
    manifest = _manifest.build(files, sorted([*states, *sharded]), values, st.world_size, sorted(sharded), facts)

    def commit() -> None:
        if main:
            for name in sharded:
                _sharded.check_listed(tmp / f"{name}{_sharded.SUFFIX}", files)
            _commit.commit(tmp, target, manifest)

    _every_rank(call, undo, commit)
    if keep_last is not None:
        _every_rank(
            call,
            f"{target} was committed but pruning failed",
            lambda: _commit.prune(target, keep_last) if main else None,
        )
    return target


def load_state(directory: str | os.PathLike[str], *, strict: bool = True, **objects: Any) -> dict[str, Any]:
    """Restore ``objects`` and the RNG/scaler/dataloader state from ``directory``; return the plain values.

    Every rank must call it, after ``ak.prepare`` (prepared dataloaders get back their
    positions, in the order they were prepared). Every file is checked against the
    manifest (size, checksum) and deserialized first, without executing code from it
    (``torch.load(weights_only=True)``, JSON, a restricted unpickler for DCP's metadata);
    only then is anything changed. A damaged or missing file raises :class:`CheckpointError`
    naming it on every rank. Sharded objects load on any number of processes, sharded or
    not (pass an optimizer with its model). ``strict=False`` skips this rank's RNG/dataloader
    state when it does not fit (a different world size) instead of raising.

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> ak.load_state("ckpt/step-10", model=model)  # doctest: +SKIP
        {'step': 10}
    """
    call = f"accelkit.load_state({os.fspath(directory)!r})"
    for name, obj in objects.items():
        if not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(
                f"{call}: {name}={type(obj).__qualname__} has no load_state_dict(); pass objects to restore "
                f"(plain values saved with save_state are returned: values = ak.load_state(...))"
            )
    st = _state.get()
    path = Path(directory)
    body, states, mine = _every_rank(call, "nothing was changed", lambda: _read(path, objects, st, strict))
    left = sorted(set(body["objects"]) - set(objects))
    if left and st.is_main_process:
        names = ", ".join(left)
        warnings.warn(
            f"{call}: the checkpoint also holds {names}, which this call does not restore; pass "
            f"{', '.join(f'{n}={n}' for n in left)} to restore it too",
            stacklevel=2,
        )
    sharded = [name for name in objects if name in body["sharded"]]
    for name in objects:
        if name not in sharded and _state.strategy().shards_state(_unwrapped(objects[name])):
            raise CheckpointError(
                f"{call}: {path / name}.pt was saved unsharded but {name} here holds sharded (DTensor) state; "
                f"load it into the unsharded {name}, then shard it (fully_shard / ak.prepare)"
            )
    owners = _owners(call, {name: objects[name] for name in sharded}, objects)  # the same on every rank

    def read_sharded() -> dict[str, Callable[[], None]]:  # DCP's collectives: in the same order on every rank
        return {
            name: _sharded.load(path / f"{name}{_sharded.SUFFIX}", _unwrapped(obj), owners[name], st.distributed)
            for name, obj in objects.items()
            if name in sharded
        }

    appliers = _every_rank(call, "nothing was changed", read_sharded)
    for name, obj in objects.items():
        try:
            if name in appliers:
                appliers[name]()
            else:
                _unwrapped(obj).load_state_dict(states[name])
        except Exception as exc:
            where = path / (name + (_sharded.SUFFIX if name in appliers else ".pt"))
            raise CheckpointError(f"{call}: {where} does not fit {name}: {exc}") from exc
    if mine is not None:
        _rank_state.apply(mine)
    return dict(body["values"])


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The most recently committed checkpoint directly under ``root``, or None if there is none.

    Example:
        >>> import accelkit as ak
        >>> ak.latest_checkpoint("checkpoints")  # e.g. PosixPath('checkpoints/step-300')  # doctest: +SKIP
    """
    found = _manifest.committed(Path(root))
    return found[-1][1] if found else None


# --- the steps --------------------------------------------------------------------------------


def _unwrapped(obj: Any) -> Any:
    """Modules without DDP/FSDP/compile wrappers: a checkpoint loads on any number of processes."""
    from ..training import unwrap

    return unwrap(obj) if isinstance(obj, nn.Module) else obj


def _torch_writer(state: Any) -> Callable[[Any], None]:
    return lambda f: torch.save(state, f)


def _bytes_writer(data: bytes) -> Callable[[Any], None]:
    return lambda f: f.write(data)


def _split(call: str, objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The state dicts of ``objects``: plain, sharded (this rank's shards); and the plain values."""
    states, sharded, values = {}, {}, {}
    for name, obj in objects.items():
        if not name.isidentifier():
            raise ValueError(f"{call}: object name {name!r} is not an identifier; name objects like model=...")
        if callable(getattr(obj, "state_dict", None)):
            if _state.strategy().shards_state(_unwrapped(obj)):
                sharded[name] = obj
            else:
                states[name] = _unwrapped(obj).state_dict()
            continue
        try:
            json.dumps(obj)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{call}: {name}={type(obj).__qualname__} {obj!r:.60} has no state_dict() and is not JSON-able "
                f"({exc}); pass an object with state_dict()/load_state_dict(), or convert it (lists, dicts, "
                f"numbers, strings)"
            ) from None
        values[name] = obj
    owners = _owners(call, sharded, objects)
    sharded = {name: _sharded.state_dict(_unwrapped(obj), owners[name]) for name, obj in sharded.items()}
    return states, sharded, values


def _owners(call: str, sharded: dict[str, Any], objects: dict[str, Any]) -> dict[str, nn.Module | None]:
    """For each sharded optimizer, the module among ``objects`` it optimizes (None for modules)."""
    modules = {name: _unwrapped(obj) for name, obj in objects.items() if isinstance(obj, nn.Module)}
    return {
        name: None if isinstance(obj, nn.Module) else _sharded.optimizer_owner(call, name, obj, modules)
        for name, obj in sharded.items()
    }


def _read(path: Path, objects: dict[str, Any], st: _state.ProcessState, strict: bool) -> Any:
    """Phases one and two: validate every file, then deserialize what this rank needs."""
    body = _manifest.read(path)
    _warn_versions(path, body, st)
    files: dict[str, _safe_io.FileRecord] = body["files"]
    missing = sorted(set(objects) - set(body.get("objects", [])))
    if missing:
        raise CheckpointError(f"{path} has no {missing}; it holds {body.get('objects')}, pass those names")
    rank_file = f"rank-{st.rank}.json"
    if body.get("world_size") != st.world_size and strict:
        raise CheckpointError(
            f"{path} was saved by {body.get('world_size')} processes, this job has {st.world_size}; resume with "
            f"the same number, or pass strict=False to skip the per-rank RNG and dataloader state"
        )
    sharded = body["sharded"]
    expected = [f"{name}{_sharded.SUFFIX}/.metadata" if name in sharded else f"{name}.pt" for name in body["objects"]]
    expected += [f"rank-{r}.json" for r in range(body["world_size"])]
    for name in _share(sorted(set(expected) | set(files)), files, st):
        problem = "is missing from the manifest" if name not in files else _safe_io.check_file(path / name, files[name])
        if problem:
            raise CheckpointError(f"{path / name} {problem}; the checkpoint is damaged: load an older one")
    states = {}
    for name in objects:
        if name in sharded:
            folder = f"{name}{_sharded.SUFFIX}"
            metadata = _sharded.read_metadata(path / folder / ".metadata")
            unlisted = sorted(f"{folder}/{ref}" for ref in _sharded.referenced_files(metadata))
            unlisted = [ref for ref in unlisted if ref not in files]
            if unlisted:
                raise CheckpointError(f"{path / unlisted[0]} is missing from the manifest; the checkpoint is damaged")
            continue
        try:
            states[name] = torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{path / name}.pt was refused: {str(exc).splitlines()[0]}") from None
    mine = None
    if rank_file in files and body["world_size"] == st.world_size:  # else strict=False: not this run's ranks
        try:
            mine = _rank_state.decode(json.loads((path / rank_file).read_bytes()), st.rank)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path / rank_file} is malformed: {exc}") from None
        problem = _rank_state.check_fits(mine)
        if problem and strict:
            raise CheckpointError(f"{path / rank_file} does not fit this run: {problem}")
        mine = None if problem else mine
        if mine is not None and mine.numpy is not None and _rank_state.numpy_missing():
            if strict:
                raise CheckpointError(
                    f"{path / rank_file} holds NumPy's random state, but numpy cannot be imported here, so it "
                    f"cannot be restored: pip install numpy, or pass strict=False to load everything else"
                )
            mine = dataclasses.replace(mine, numpy=None)
    return body, states, mine


def _warn_versions(path: Path, body: dict[str, Any], st: _state.ProcessState) -> None:
    """Once per process and versions, on the main process: the checkpoint comes from other versions."""
    change = _manifest.version_change(body)
    if change and st.is_main_process and change not in _state.warned:
        _state.warned.add(change)
        frame = _frames.user_frame()  # the warning points at the user's load_state call
        warnings.warn_explicit(
            f"accelkit.load_state({os.fspath(path)!r}): {change}. Loading it anyway; if it does not load or "
            f"resumes differently, load it with the versions that saved it.",
            UserWarning,
            frame.f_code.co_filename if frame else "<unknown>",
            frame.f_lineno if frame else 0,
        )


def _share(names: list[str], files: dict[str, _safe_io.FileRecord], st: _state.ProcessState) -> list[str]:
    """The files this rank verifies: all but shards; shards (``NAME.dcp/__R_I.distcp``) split among the ranks."""
    shards = sorted(n for n in names if "/" in n and n in files and not n.endswith("/.metadata"))
    load, mine = [0] * st.world_size, []
    for name in sorted(shards, key=lambda n: -int(files[n]["size"])):  # largest first, to the least loaded rank
        rank = load.index(min(load))
        load[rank] += int(files[name]["size"]) + 1
        if rank == st.rank:
            mine.append(name)
    return [n for n in names if n not in set(shards)] + mine


def _every_rank(call: str, consequence: str, step: Callable[[], T]) -> T:
    """Run ``step`` on every rank; its result here, or the same CheckpointError on every rank.

    Every rank must call it: the ranks exchange success or failure (a small message, never
    the result), so that one rank's error never leaves the others waiting or goes on to a commit.
    """
    return _every_rank_results(call, consequence, step, share=False)[0]


def _every_rank_results(call: str, consequence: str, step: Callable[[], T], share: bool = True) -> list[T]:
    """:func:`_every_rank`, returning every rank's result (with ``share``: keep results small)."""
    st = _state.get()
    error: Exception | None = None
    value: Any = None
    try:
        value = step()
        outcome: tuple[bool, Any] = (True, value if share else None)
    except Exception as exc:
        error, outcome = exc, (False, _describe(exc))
    outcomes = collectives.gather_object(outcome) if st.distributed else [outcome]
    failed = [(rank, text) for rank, (ok, text) in enumerate(outcomes) if not ok]
    if failed:
        if isinstance(error, CheckpointError) and not st.distributed:
            raise error
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in failed)
        raise CheckpointError(f"{call} failed, {consequence}:\n{lines}") from error
    return [v for _, v in outcomes] if share else [value]


def _describe(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno in (28, 122):  # ENOSPC, EDQUOT
        where = exc.filename or "the checkpoint directory"
        return f"no space left on device writing {where} ({exc.strerror}); free some space or save elsewhere"
    return f"{type(exc).__name__}: {exc}"
