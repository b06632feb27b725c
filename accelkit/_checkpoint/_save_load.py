"""Checkpoints that survive crashes: atomic save, verified safe load, exact resume.

Resuming after an elastic restart (``@ak.distributed(max_restarts=N)``) is two lines at
the start of the training function, after ``ak.prepare``::

    ckpt = ak.latest_checkpoint("checkpoints")
    start = ak.load_state(ckpt, model=model, optimizer=opt)["step"] if ckpt else 0

``ak.state().restart_count`` says how many times the group was restarted.

Layout of a checkpoint directory: ``NAME.pt`` per named object (its ``state_dict()``,
written by the main process), or ``NAME.dcp/`` for a sharded one (a module ``fully_shard``-ed,
its optimizer: each rank's shards, written with ``torch.distributed.checkpoint``),
``tensor-values.pt`` for values holding tensors, ``rank-R.json`` per rank (RNG states, grad
scaler, prepared-dataloader positions) and ``manifest.json`` (file sizes and checksums, plain
values, step, world size, versions), written last.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from .. import _group, _state
from .._options import is_int
from ..errors import CheckpointError
from ._where import storage_for

if TYPE_CHECKING:
    from . import _load
    from ._agree import Agreement

# The machinery (_save, _load, _manifest, ...) loads with the first call that needs it, not with
# the names: ``import accelkit`` and every public name stay cheap for a script that never saves.

__all__ = ["finish_saving", "full_state_dict", "latest_checkpoint", "load_state", "save_state", "wait_for_checkpoint"]


def save_state(
    directory: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
    blocking: bool = True,
    full_state: bool = False,
    **objects: Any,
) -> Path | str:
    """Save ``objects`` and this job's RNG/scaler/dataloader state to ``directory``, atomically.

    Every rank must call it, with the same arguments: saving is collective. Objects with
    ``state_dict()`` are saved from the main process, sharded ones (DTensor state: a
    ``fully_shard``-ed model and its optimizer, passed together) by every rank with
    ``torch.distributed.checkpoint``; other values must be JSON-able or hold tensors
    (``load_state`` and ``read_checkpoint`` return them). Each rank writes into a temporary
    directory beside ``directory``; once all succeeded, the main process writes the manifest
    and renames it into place. A crash or an error at any moment leaves the previous
    checkpoints as they were. With ``keep_last=K``, the oldest committed checkpoints beside
    it are then pruned to K.

    ``directory`` may be a URL of an object store (``s3://bucket/run/step-10``, ``gs://``, ``az://``,
    ``memory://``, any fsspec protocol; ``pip install "accelkit[fsspec]"``), with the same promises: each
    save's files go into a folder of their own and the manifest, written last, is the commit. It returns
    the checkpoint's path, or its URL. A URL nothing installed serves, a missing bucket or missing
    credentials are refused before any work.

    ``blocking=False`` returns once the state is copied to host memory; a background thread
    writes and commits it with the same guarantees (one save in flight: the next call waits for
    it). Its failure raises at the next ``save_state``, ``load_state``, :func:`wait_for_checkpoint`
    or ``ak.end_training()``, on every rank: call :func:`wait_for_checkpoint` before the script
    ends to handle it. A failure no call raised (``ak.reset_state()`` only warns) ends the
    process with exit code 1 at interpreter exit, the error on stderr (on each rank: launchers
    name them). A failed save's temporary directory is removed, blocking or not.

    ``full_state=True`` gathers sharded models and their optimizers into one consolidated state
    (``NAME.pt`` on the main process) that loads on any number of processes and strategies;
    optimizers then need their model passed too.

    Inside an ``ak.accumulate`` window with gradients pending (``ak.sync_gradients()`` False
    after an ``ak.backward``) it raises :class:`CheckpointError` on every rank and writes
    nothing: the checkpoint would hold neither those gradients nor the window's position, and
    the resumed run would differ. Save between windows: ``if ak.sync_gradients(): ak.save_state(...)``.

    Args:
        directory: the checkpoint's directory, the same on every rank. A checkpoint there is
            replaced in one step; a folder that is neither empty nor a checkpoint is refused.
        keep_last: then prune the oldest committed checkpoints beside it, keeping this many
            (``None``: keep them all).
        blocking: ``False``: return once the state is copied to host memory, and write it in the
            background.
        full_state: gather sharded models and their optimizers into one consolidated state.
        **objects: what to save, each under its keyword's name: objects with ``state_dict()``
            (``model=model``, ``scheduler=scheduler``) and plain values (``epoch=3``). ``load_state``
            takes the same names.

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> ak.save_state("ckpt/step-10", model=model, step=10)  # doctest: +SKIP
        PosixPath('.../ckpt/step-10')
    """
    call = f"accelkit.save_state({os.fspath(directory)!r})"
    storage = storage_for(call, directory)  # a URL nothing serves is refused before any work
    if not objects:
        raise TypeError(
            f"{call}: nothing to save; name what to save, e.g. ak.save_state(directory, model=model, "
            f"optimizer=optimizer, scheduler=scheduler, step=step) (accelkit does not save prepared objects by itself)"
        )
    if keep_last is not None and (not is_int(keep_last) or keep_last < 1):
        raise ValueError(f"{call}: keep_last={keep_last!r}; expected None or an integer >= 1, e.g. keep_last=3")
    for name, flag in (("blocking", blocking), ("full_state", full_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{call}: {name}={flag!r}; expected True or False")
    from . import _rank_state

    window = _rank_state.pending_window()  # every rank alike (the same window), before any collective or file
    if window is not None:
        raise CheckpointError(
            f"{call}: {window} has pending gradients, which a checkpoint does not hold (nor the window's position), "
            f"so a run resumed from it would end with other weights; save when ak.sync_gradients() is True (after "
            f"the optimizer step), e.g. `if ak.sync_gradients(): ak.save_state(...)`"
        )
    finish_saving(call)
    _meet("save_state")
    from . import _objects, _save
    from ._agree import Agreement

    contents = _objects.collect(call, objects, full_state)
    job = _save.begin(call, storage.absolute(), keep_last, contents)
    if not blocking:
        from . import _async  # the background saving: loaded with the first save that asks for it

        _async.start(job)
        return job.target
    return _save.write(job, Agreement.here(call))


def wait_for_checkpoint() -> None:
    """Wait until the save in flight (``save_state(..., blocking=False)``) is committed; raise if it failed.

    Every rank's background save ends with the same outcome, so its failure raises here on
    every rank (a :class:`CheckpointError` naming each failed rank). Without a save in flight
    it returns at once.

    Example:
        >>> import accelkit as ak
        >>> ak.wait_for_checkpoint()
    """
    finish_saving("accelkit.wait_for_checkpoint()")


def load_state(directory: str | os.PathLike[str], *, strict: bool | None = None, **objects: Any) -> dict[str, Any]:
    """Restore ``objects`` and the RNG/scaler/dataloader state from ``directory``; return the plain values.

    Every rank must call it, after ``ak.prepare`` (prepared dataloaders get back their
    positions, in the order they were prepared). Every file is checked against the
    manifest (its size, the XXH3-128 of each 64 MiB piece) and deserialized first, without
    executing code from it (``torch.load(weights_only=True)``, JSON, a restricted unpickler for
    DCP's metadata); only then is anything changed. The files are opened once and only those are
    read: a save or prune into the same directory meanwhile gives the old checkpoint or the new
    one whole, or an error saying it was replaced or removed. From an object store (a URL), each
    rank reads what it loads in pieces, each verified as it arrives and kept in memory until the
    load ends. A damaged or missing file raises
    :class:`CheckpointError` naming it (and the piece) on every rank, and another checkpoint
    beside it that verifies. Sharded objects load on any number of processes, sharded or
    not (pass an optimizer with its model), and so do modules and full states
    (``full_state=True``). A save in flight is waited for.

    The per-rank state (RNG states, grad scaler, dataloader positions) fits only the world size
    that saved it. By default (``strict=None``) a checkpoint of another world size loads every
    object and skips that state, saying so once in a warning on the main process (to evaluate
    or fine-tune a 2-process FSDP run's ``full_state=True`` checkpoint in one process); on the
    same world size, per-rank state that does not fit (other dataloaders, no fp16 scaler, another
    device) raises. ``strict=True`` also refuses another world size: a resume that needs the
    per-rank state. ``strict=False`` skips whatever per-rank state does not fit, each rank
    warning about its own.

    Args:
        directory: the checkpoint's directory (e.g. what :func:`latest_checkpoint` found).
        strict: ``None``: a checkpoint of another world size loads without its per-rank state, with
            a warning; ``True``: it is refused; ``False``: whatever per-rank state does not fit is skipped.
        **objects: the objects to restore, by the names they were saved under (``model=model``,
            ``optimizer=optimizer``, ``scheduler=scheduler``).

    Example:
        >>> import accelkit as ak, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> ak.load_state("ckpt/step-10", model=model)  # doctest: +SKIP
        {'step': 10}
    """
    call = f"accelkit.load_state({os.fspath(directory)!r})"
    storage = storage_for(call, directory)  # a URL nothing serves is refused before any work
    if strict not in (None, True, False):
        raise TypeError(f"{call}: strict={strict!r}; expected None (the default), True or False")
    for name, obj in objects.items():
        if not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(
                f"{call}: {name}={type(obj).__qualname__} has no load_state_dict(); pass objects to restore "
                f"(plain values saved with save_state are returned: values = ak.load_state(...); to read them "
                f"before the objects exist: ak.read_checkpoint(directory))"
            )
    finish_saving(call)
    from . import _load, _objects
    from ._agree import Agreement
    from ._integrity import Verifier
    from ._storage import Snapshot

    st = _state.get()
    agree = Agreement.here(call)
    nothing = "nothing was changed"
    opened: list[tuple[Snapshot, Verifier | None]] = []  # closed however the load ends

    def read() -> _Read:
        snapshot = _load.survey(storage, objects, st, strict)  # open: what is verified is what is loaded
        opened.append((snapshot, None))
        check = _load.verifier(snapshot, objects, st)  # on its threads, while the files are read
        opened[-1] = (snapshot, check)
        loaded = check.first(lambda: _load.read(snapshot, objects, st, strict))
        try:  # what the call asks for against what the checkpoint holds: the same on every rank
            sharded = _load.check_fits(call, snapshot.where, objects, snapshot.body)
            owned = {
                n: o for n, o in objects.items() if n in sharded or (n in snapshot.body["full"] and not _is_module(o))
            }
            owners = _objects.owners(call, owned, objects)
        except (CheckpointError, ValueError, TypeError) as misuse:
            return _Read(snapshot.body, loaded, {}, {}, misuse)
        shards = check.first(lambda: _load.readers(snapshot, objects, loaded, owners))  # DCP's plans, checked
        for shard in shards.values():  # what each plan reads, where this rank checks it itself
            for name, offset, length in shard.ranges:
                check.add(name, snapshot.reading(name, offset, length))
        check.check()  # every file verified before DCP reads into the live tensors (below)
        return _Read(snapshot.body, loaded, owners, {name: shard.apply for name, shard in shards.items()}, None)

    try:
        # One exchange: each rank's reading, plans and checksums, and which checkpoint it read (a save may have
        # replaced the directory between two ranks' reads); nothing changed yet.
        return _apply(call, str(storage), objects, agree, agree.each_same(nothing, read, _saved_at))
    finally:
        for snapshot, check in opened:
            if check is not None:
                check.join()
            snapshot.close()


def _saved_at(read: _Read) -> str:
    """Which checkpoint a rank read: when it was committed, and by how many processes."""
    return f"saved at {read.body.get('created_ns')} ns by {read.body.get('world_size')} processes"


def _apply(call: str, where: str, objects: dict[str, Any], agree: Agreement, read: _Read) -> dict[str, Any]:
    """load_state's changes, once every rank read and verified the same checkpoint."""
    from . import _load, _rank_state

    body, loaded, owners, appliers, misuse = read
    if misuse is not None:
        raise misuse
    left = sorted(set(body["objects"]) - set(objects))
    if left and _state.get().is_main_process:
        warnings.warn(
            f"{call}: the checkpoint also holds {', '.join(left)}, which this call does not restore; pass "
            f"{', '.join(f'{n}={n}' for n in left)} to restore it too",
            stacklevel=3,  # the user's load_state call
        )

    def read_shards() -> None:  # every rank its own shards, in place; one exchange after all of them
        for read_into in appliers.values():
            read_into()

    if appliers:
        agree.each("the sharded objects may be partly loaded", read_shards)
    for name, obj in objects.items():
        if name not in appliers:
            _load.apply(call, where, name, obj, loaded, owners)
    if loaded.mine is not None:
        _rank_state.apply(loaded.mine)
    return loaded.values


def finish_saving(call: str) -> None:
    """Wait for this process's save in flight, if any; raise its failure (the same on every rank), naming ``call``."""
    if _state.training.saving is not None:
        from . import _async

        _async.finish(call)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | str | None:
    """The most recently committed checkpoint directly under ``root`` that is whole, or None if there is none.

    A checkpoint whose manifest is damaged, or one of whose files is missing or of another size
    than the manifest says (truncated, overwritten), is skipped. The files' checksums are not
    read here (that would read every byte): ``load_state`` checks them, and when one fails it
    names the newest whole checkpoint to load instead. ``root`` may be a URL (``s3://bucket/run``):
    the checkpoint's URL is returned then.

    Args:
        root: the folder whose subdirectories are checkpoints (``"checkpoints"`` for
            ``checkpoints/epoch_3``); a missing folder has none.

    Example:
        >>> import accelkit as ak
        >>> ak.latest_checkpoint("checkpoints")  # doctest: +SKIP
        PosixPath('checkpoints/step-300')
    """
    from . import _manifest

    place = storage_for(f"accelkit.latest_checkpoint({os.fspath(root)!r})", root)  # a URL: refused, or served
    found = _manifest.committed(place, whole=True)
    return found[-1][1].location() if found else None


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The full (unsharded) state dict of ``model``, for ``save_pretrained`` and exports.

    For a sharded model (``strategy="fsdp"``, ``fully_shard``) every rank must call it: the
    shards are gathered onto the main process' CPU (tied weights stay one tensor, as in
    ``state_dict()``), and the other processes get an empty dict. Otherwise it is the
    unwrapped model's ``state_dict()``, on every process, without a collective. Accelerate's
    ``accelerator.get_state_dict(model)``.

    Args:
        model: a prepared model, sharded or not, or a plain one.

    Example:
        >>> import accelkit as ak, torch
        >>> sorted(ak.full_state_dict(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"accelkit.full_state_dict(model={type(model).__qualname__}): expected a torch.nn.Module")
    from . import _full, _objects

    return _full.full_state_dict(_objects.unwrapped(model))


def _meet(name: str) -> None:
    """Every rank reaches this collective step, or every rank that did raises (see ``_group.meet``)."""
    st, group = _state.get(), _state.group
    if not st.distributed or group.store is None:
        return
    group.meetings[name] = number = group.meetings.get(name, 0) + 1
    _group.meet(group.store, group.board, name, number, st.rank, st.world_size, st.options.timeout)


class _Read(NamedTuple):
    """What every rank of ``load_state`` read and checked before anything is applied."""

    body: dict[str, Any]  # the manifest
    loaded: _load.Loaded
    owners: dict[str, nn.Module | None]  # the module each sharded or full optimizer belongs to
    appliers: dict[str, Any]  # name -> reads its DCP shards in place
    misuse: Exception | None  # the call does not fit the checkpoint (raised as is, on every rank alike)


def _is_module(obj: Any) -> bool:
    return isinstance(obj, nn.Module)
