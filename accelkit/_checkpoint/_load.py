"""Reading a checkpoint back: verify every file, deserialize what this rank needs, then apply it.

Every file is read through one snapshot of the checkpoint (``_storage.Snapshot``: locally the files
opened once; on an object store the pieces read once, kept in memory), so that the bytes verified are
the bytes loaded. Phases one and two (:func:`read`) change nothing: each rank checks its files against
the manifest (size, XXH3-128 of each piece, on a pool of threads: ``_integrity.Verifier``; the ranks
agree on the outcome), and deserializes without running code from them (``torch.load(weights_only=True)``,
JSON, restricted unpickling of DCP's metadata; DCP's plans and non-tensor items, :func:`readers`). Local
files are mapped, not copied (``_files``). Phase three (:func:`apply`, the functions of :func:`readers`)
changes the live objects, in the order given: ``dcp.load`` reads the verified shards into their tensors.
"""

import json
import warnings
from typing import Any, NamedTuple

from torch import nn

from .. import _frames, _state
from ..errors import CheckpointError
from . import _files, _full, _integrity, _layout, _manifest, _rank_state, _sharded_load
from ._objects import unwrapped
from ._storage import Snapshot, Storage

__all__ = ["Loaded", "apply", "read", "survey", "tensor_values", "verifier"]


class Loaded(NamedTuple):
    body: dict[str, Any]  # the manifest
    states: dict[str, Any]  # name -> state read from NAME.pt (a module's mapped from a local file, others owned)
    mine: _rank_state.RankState | None  # this rank's RNG/scaler/loader state, None when it does not apply
    values: dict[str, Any]  # the plain values, tensors included
    metadata: dict[str, Any]  # name -> DCP's metadata of a sharded object, read once


def survey(storage: Storage, objects: dict[str, Any], st: _state.ProcessState, strict: bool | None) -> Snapshot:
    """The checkpoint, open, its manifest checked against ``objects`` and this job. The caller closes it."""
    try:
        snapshot = storage.snapshot()
    except CheckpointError as exc:
        if not storage.has_manifest() or "while it was being loaded" in str(exc):
            raise  # not a checkpoint at all, or gone: nothing to suggest
        raise CheckpointError(f"{exc}; {_manifest.instead(storage)}") from None
    try:
        _expected(snapshot.where, snapshot.body, objects, st, strict)
    except BaseException:
        snapshot.close()
        raise
    return snapshot


def _expected(
    where: str, body: dict[str, Any], objects: dict[str, Any], st: _state.ProcessState, strict: bool | None
) -> None:
    _warn_versions(where, body, st)
    missing = sorted(set(objects) - set(body.get("objects", [])))
    if missing:
        raise CheckpointError(f"{where} has no {missing}; it holds {body.get('objects')}, pass those names")
    if body.get("world_size") != st.world_size and strict is True:  # asked for: a resume that needs every rank's
        raise CheckpointError(
            f"{where} was saved by {body.get('world_size')} processes, this job has {st.world_size}, and strict=True "
            f"asks for the per-rank RNG and dataloader state, which fits only {body.get('world_size')} processes; "
            f"resume with the same number, or leave strict out (or pass strict=False) to load the objects without it"
        )


def verifier(snapshot: Snapshot, objects: dict[str, Any], st: _state.ProcessState) -> _integrity.Verifier:
    """This rank's check of the checkpoint's files, begun on a pool of threads (``_integrity.Verifier``).

    Which files it checks whole the snapshot says: locally a share of every file (one rank's check
    covers every rank's read of the same bytes); on an object store those this rank reads (the
    others' sizes only), and the pieces a sharded load reads, added once planned.
    """
    body = snapshot.body
    names = sorted(set(_layout.expected(body)) | set(body["files"]))
    reads = [
        f"{_layout.sharded_folder(n)}/{_layout.METADATA}" if n in body["sharded"] else _layout.object_file(n)
        for n in objects
    ]
    reads += [_layout.VALUES] if body["tensor_values"] else []
    reads += [_layout.rank_file(st.rank)] if body["world_size"] == st.world_size else []
    whole, sized = snapshot.to_verify(names, reads, st.rank, st.world_size)

    def damaged(name: str, problem: str) -> CheckpointError:
        return CheckpointError(
            f"{snapshot.where}/{name} {problem}; the checkpoint is damaged: {_manifest.instead(snapshot.storage)}"
        )

    return _integrity.Verifier(snapshot, whole, sized, damaged)


def read(snapshot: Snapshot, objects: dict[str, Any], st: _state.ProcessState, strict: bool | None) -> Loaded:
    """Deserialize what this rank needs (plain files mapped, DCP metadata checked, values, rank state)."""
    where, body = snapshot.where, snapshot.body
    files: dict[str, _integrity.FileRecord] = body["files"]
    states, metadata = {}, {}
    for name in objects:
        if name in body["sharded"]:
            folder = _layout.sharded_folder(name)
            metadata[name] = _sharded_load.read_metadata(snapshot, f"{folder}/{_layout.METADATA}")
            unlisted = sorted(f"{folder}/{ref}" for ref in _sharded_load.referenced_files(metadata[name]))
            unlisted = [ref for ref in unlisted if ref not in files]
            if unlisted:
                raise CheckpointError(f"{where}/{unlisted[0]} is missing from the manifest; the checkpoint is damaged")
            continue
        state, mapped = _load_file(snapshot, _layout.object_file(name))
        # A module's load_state_dict copies from a mapping; anything else keeps what it is given: its own copy,
        # made here, while the files are being verified.
        keep = isinstance(unwrapped(objects[name]), nn.Module) or not mapped
        states[name] = state if keep else _files.owned(state)
    values = {**body["values"], **tensor_values(snapshot)}
    return Loaded(body, states, _mine(snapshot, st, strict, _layout.rank_file(st.rank)), values, metadata)


def tensor_values(snapshot: Snapshot) -> dict[str, Any]:
    """The values saved beside tensors (``tensor-values.pt``), read into memory of their own."""
    body = snapshot.body
    if not body["tensor_values"]:
        return {}
    found, mapped = _load_file(snapshot, _layout.VALUES)
    found = _files.owned(found) if mapped else found
    if not (isinstance(found, dict) and sorted(found) == sorted(body["tensor_values"])):
        where = f"{snapshot.where}/{_layout.VALUES}"
        raise CheckpointError(f"{where} does not hold the values {body['tensor_values']} the manifest names")
    return dict(found)


def _load_file(snapshot: Snapshot, name: str) -> tuple[Any, bool]:
    try:
        found = _files.load_torch(snapshot, name)
    except _integrity.Damaged:
        raise  # a piece read from an object store is not what the manifest says: the message names it
    except Exception as exc:
        raise CheckpointError(
            f"{snapshot.where}/{name} was refused: {str(exc).splitlines()[0]}; {_manifest.instead(snapshot.storage)}"
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
    where, body = snapshot.where, snapshot.body
    what = "its RNG states, grad scaler and dataloader positions were not restored"
    if rank_file not in body["files"] or body["world_size"] != st.world_size:  # not our ranks (strict is not True)
        saved = f"saved by {body['world_size']} processes, this job has {st.world_size}"
        if strict is None:  # (the same world size without the file: the verification names it, before any change)
            if body["world_size"] != st.world_size:
                _skipped_ranks(where, body, st)
        else:
            _skipped(where, st, f"{where}/{rank_file} ({saved}): {what}")
        return None
    try:
        mine = _rank_state.decode(json.loads(snapshot.read_bytes(rank_file)), st.rank)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}/{rank_file} is malformed: {exc}") from None
    problem = _rank_state.check_fits(mine)
    if problem and strict is not False:
        raise CheckpointError(f"{where}/{rank_file} does not fit this run: {problem}")
    if problem:
        _skipped(where, st, f"{where}/{rank_file} ({problem}): {what}")
        return None
    if mine.numpy is not None and _rank_state.numpy_missing():
        if strict is not False:
            raise CheckpointError(
                f"{where}/{rank_file} holds NumPy's random state, but numpy cannot be imported here, so it "
                f"cannot be restored: pip install numpy, or pass strict=False to load everything else"
            )
        _skipped(where, st, f"NumPy's random state in {where}/{rank_file} (numpy cannot be imported here)")
        mine = mine._replace(numpy=None)
    return mine


def _skipped_ranks(where: str, body: dict[str, Any], st: _state.ProcessState) -> None:
    """The default (strict=None) on another world size: objects load, each rank's own state is skipped; said once."""
    if not st.is_main_process:
        return
    saved = body["world_size"]
    files = "rank-0.json" if saved == 1 else f"rank-0.json to rank-{saved - 1}.json"
    _warn_at_user(
        f"accelkit.load_state({where!r}): saved by {saved} processes, this job has {st.world_size}: "
        f"the objects are restored, but not the per-rank state ({files}: RNG states, grad scaler, dataloader "
        f"positions), which fits only {saved} processes. Enough to evaluate or fine-tune; to resume training "
        f"exactly, run {saved} processes (strict=True refuses such a load instead of skipping)"
    )


def _skipped(where: str, st: _state.ProcessState, what: str) -> None:
    """``strict=False`` left something out: say what, on the rank it concerns, at the user's call."""
    _warn_at_user(f"accelkit.load_state({where!r}, strict=False): rank {st.rank} skipped {what}")


def _warn_at_user(message: str) -> None:
    """A UserWarning pointing at the user's ``load_state`` call."""
    frame = _frames.user_frame()
    warnings.warn_explicit(
        message,
        UserWarning,
        frame.f_code.co_filename if frame else "<unknown>",
        frame.f_lineno if frame else 0,
    )


def apply(call: str, where: str, name: str, obj: Any, loaded: Loaded, owners: dict[str, Any]) -> None:
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
        raise CheckpointError(f"{call}: {where}/{name}.pt does not fit {name}: {exc}") from exc


def check_fits(call: str, where: str, objects: dict[str, Any], body: dict[str, Any]) -> list[str]:
    """The names of ``objects`` to load from DCP folders; CheckpointError for what cannot load at all."""
    sharded = [name for name in objects if name in body["sharded"]]
    for name, obj in objects.items():
        target = unwrapped(obj)
        if name in sharded or name in body["full"] or isinstance(target, nn.Module):
            continue  # a module's plain state_dict() is also its full state: it loads sharded or not
        if _state.strategy().shards_state(target):
            raise CheckpointError(
                f"{call}: {where}/{name}.pt was saved unsharded but {name} here holds sharded (DTensor) state; "
                f"save it with ak.save_state(..., full_state=True) to load it into any strategy, or load it into "
                f"the unsharded model and optimizer, then shard them"
            )
    return sharded


def readers(
    snapshot: Snapshot, objects: dict[str, Any], loaded: Loaded, owners: dict[str, Any]
) -> dict[str, _sharded_load.Sharded]:
    """For each DCP object, checked against the checkpoint, the ranges it reads and the function that reads this
    rank's shards in place."""
    out: dict[str, _sharded_load.Sharded] = {}
    for name, metadata in loaded.metadata.items():
        folder = _layout.sharded_folder(name)
        out[name] = _sharded_load.load(snapshot, folder, unwrapped(objects[name]), owners[name], metadata)
    return out


def _warn_versions(where: str, body: dict[str, Any], st: _state.ProcessState) -> None:
    """Once per process and versions, on the main process: the checkpoint comes from other versions."""
    change = _manifest.version_change(body)
    warned = _state.this_process.warned
    if change and st.is_main_process and change not in warned:
        warned.add(change)
        _warn_at_user(
            f"accelkit.load_state({where!r}): {change}. Loading it anyway; if it does not load or "
            f"resumes differently, load it with the versions that saved it."
        )
