"""Checkpoint throughput: ``ak.save_state`` / ``ak.load_state`` vs plain ``torch.save`` / ``torch.load``.

The state: a ~67 MB model and its AdamW optimizer (~133 MB of moments), ~200 MB in all.
The reference saves ``{"model": sd, "optimizer": sd}`` in one ``torch.save`` to a path and
fsyncs the file (fsync on both sides: accelkit fsyncs every file it writes, the manifest, the
temporary directory and, after the rename, its parent; the reference has no checksum, manifest
or rename, and torch.save computes its zip records' CRC-32 as it does by default), and loads it
with ``torch.load(weights_only=True)`` + both ``load_state_dict``; accelkit does the same work
through its commit protocol and its verified load (every byte checksummed). Samples are paired
and alternate in order; the target is a median paired ratio >= 0.9 (``ok``).

The sharded rows run the same state ``fully_shard``-ed over 2 gloo CPU processes: accelkit
(DCP inside its commit protocol, checksummed while writing; on load every file verified and
DCP's plans and non-tensor items checked, then read in place) against the plain recipe:
``dcp.save`` / ``dcp.load`` of ``get_state_dict`` and ``set_state_dict`` (DCP fsyncs every
file, not its folder; no checksums, loaded in place).
Times are rank 0's.

The last row is the stall a training loop sees for ``save_state(blocking=False)`` of ~1 GB of
state (a larger model and its AdamW moments), against the blocking save of the same state: the
call returns once the state is copied to host memory, into buffers kept from the first
asynchronous save (a warm-up save allocates them, and is not counted); target <= 0.1x.
The S3 rows save and load the first state to a bucket of moto's S3 server on 127.0.0.1 (the server
the tests use: ``tests/s3_server.py``), through s3fs, against what a script does by hand with the
same bytes: ``torch.save`` into memory and ``fs.pipe_file`` (s3fs uploads the parts at once), and
``fs.cat_file`` (its parts read at once) into ``torch.load`` + both ``load_state_dict``. accelkit
checksums every byte on the way up, writes the manifest last, and on the way down reads each 64 MiB
piece with a request of its own and verifies it before anything is loaded. The server runs on the
same two cores as the benchmark; skipped without moto's server or s3fs.
The machine is shared: every figure is a median of paired runs, and moves from run to run.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import Row, paired_row
from torch import nn

import accelkit as ak

TARGET_RATIO = 0.9
TARGET_STALL = 0.1


def _state(shard: bool = False, width: int = 2048, layers: int = 4) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    tensors = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]
    megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6  # DTensors: their global size
    return model, opt, megabytes


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fsynced_save(state: object, path: str) -> None:
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sharded_rounds(root: str, n: int) -> tuple[float, list[tuple[float, float, float, float]]]:
    """In each of 2 workers: the state's MB and per round (ak save s, dcp save s, ak load s, dcp load s)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ak.state()
    model, opt, mb = _state(shard=True)

    def timed(fn: Callable[[], object]) -> float:
        ak.wait_for_everyone()
        return _timed(fn)

    out = []
    for i in range(n):
        ours, ref = os.path.join(root, f"ak-{i}"), os.path.join(root, f"ref-{i}")

        def ak_save(ours: str = ours) -> None:
            ak.save_state(ours, model=model, optimizer=opt)

        def ref_save(ref: str = ref) -> None:
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optimizer": opt_sd}, checkpoint_id=ref)

        def ak_load(ours: str = ours) -> None:
            ak.load_state(ours, model=model, optimizer=opt)

        def ref_load(ref: str = ref) -> None:
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optimizer": opt_sd}, checkpoint_id=ref)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)

        times = {}
        for a, b in ((ak_save, ref_save), (ak_load, ref_load)):
            for fn in (a, b) if i % 2 == 0 else (b, a):
                times[fn] = timed(fn)
        out.append((times[ak_save], times[ref_save], times[ak_load], times[ref_load]))
        ak.wait_for_everyone()
        if ak.is_main_process():
            shutil.rmtree(ours)
            shutil.rmtree(ref)
    return mb, out


def _sharded_rows(quick: bool) -> list[Row]:
    from accelkit.testing import run_distributed

    root = tempfile.mkdtemp(prefix="accelkit-bench-dcp-", dir=os.environ.get("ACCELKIT_BENCH_DIR"))
    try:
        mb, rounds = run_distributed(_sharded_rounds, (root, 3 if quick else 7), task_timeout=900)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ak_save, ref_save, ak_load, ref_load = (list(col) for col in zip(*rounds, strict=True))
    return [
        paired_row(
            f"sharded save_state {mb:.0f} MB, 2 ranks (vs dcp.save)",
            [mb / t for t in ak_save],
            [mb / t for t in ref_save],
            unit="MB/s",
        ),
        paired_row(
            f"sharded load_state {mb:.0f} MB, 2 ranks (vs dcp.load)",
            [mb / t for t in ak_load],
            [mb / t for t in ref_load],
            unit="MB/s",
        ),
    ]


def _stall_row(root: str, quick: bool) -> Row:
    """Seconds a loop stands still for an async save of ~1 GB vs a blocking save of it."""
    model, opt, mb = _state(width=4096, layers=5)
    stalls: list[float] = []
    blocking: list[float] = []
    ak.save_state(os.path.join(root, "warm-up"), blocking=False, model=model, optimizer=opt)
    ak.wait_for_checkpoint()
    for i in range(3 if quick else 5):
        ours, ref = os.path.join(root, f"async-{i}"), os.path.join(root, f"blocking-{i}")
        for kind in ("async", "blocking") if i % 2 == 0 else ("blocking", "async"):
            if kind == "async":
                start = time.perf_counter()
                ak.save_state(ours, blocking=False, model=model, optimizer=opt)
                stalls.append(time.perf_counter() - start)
                ak.wait_for_checkpoint()  # the loop would go on training here
            else:
                start = time.perf_counter()
                ak.save_state(ref, model=model, optimizer=opt)
                blocking.append(time.perf_counter() - start)
        shutil.rmtree(ours)
        shutil.rmtree(ref)
    ak.reset_state()  # lets the staging buffers go
    row = paired_row(f"save_state(blocking=False) stall, {mb:.0f} MB (vs blocking)", stalls, blocking)
    row["ok"] = row["ratio"] <= TARGET_STALL
    return row


def _single_rounds(root: str, n: int) -> tuple[float, list[float], list[float], list[float], list[float]]:
    """The state's MB and MB/s of (ak save, torch save, ak load, torch load), ``n`` paired rounds each."""
    model, opt, mb = _state()
    saves: tuple[list[float], list[float]] = ([], [])
    loads: tuple[list[float], list[float]] = ([], [])
    for i in range(n):
        ours, ref = os.path.join(root, f"ak-{i}"), os.path.join(root, f"ref-{i}.pt")

        def ak_save(ours: str = ours) -> None:
            ak.save_state(ours, model=model, optimizer=opt)

        def ref_save(ref: str = ref) -> None:
            _fsynced_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ref)

        def ak_load(ours: str = ours) -> None:
            ak.load_state(ours, model=model, optimizer=opt)

        def ref_load(ref: str = ref) -> None:
            state = torch.load(ref, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])

        pairs = [(ak_save, ref_save, saves), (ak_load, ref_load, loads)]
        for a, b, samples in pairs:
            first, second = (a, b) if i % 2 == 0 else (b, a)
            t1, t2 = _timed(first), _timed(second)
            samples[0].append(mb / (t1 if first is a else t2))
            samples[1].append(mb / (t2 if first is a else t1))
        shutil.rmtree(ours)
        os.remove(ref)
    return mb, *saves, *loads


def _s3_rows(quick: bool) -> list[Row]:
    """accelkit to and from S3 (moto on 127.0.0.1) against torch.save + s3fs put, s3fs get + torch.load."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import s3_server

    if s3_server.missing():
        print(f"checkpoint: the S3 rows are skipped: {s3_server.missing()}")
        return []
    model, opt, mb = _state()
    saves: tuple[list[float], list[float]] = ([], [])
    loads: tuple[list[float], list[float]] = ([], [])
    before = dict(os.environ)
    with s3_server.serving() as env:
        try:
            s3_server.use(env)
            s3_server.make_bucket("bench")
            import fsspec

            fs, _ = fsspec.core.url_to_fs("s3://bench")
            for i in range(3 if quick else 5):
                ours, ref = f"s3://bench/ak-{i}", f"bench/ref-{i}.pt"

                def ak_save(ours: str = ours) -> None:
                    ak.save_state(ours, model=model, optimizer=opt)

                def ref_save(ref: str = ref) -> None:
                    buffer = io.BytesIO()
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
                    fs.pipe_file(ref, buffer.getvalue())

                def ak_load(ours: str = ours) -> None:
                    ak.load_state(ours, model=model, optimizer=opt)

                def ref_load(ref: str = ref) -> None:
                    state = torch.load(io.BytesIO(fs.cat_file(ref)), weights_only=True)
                    model.load_state_dict(state["model"])
                    opt.load_state_dict(state["optimizer"])

                for a, b, samples in ((ak_save, ref_save, saves), (ak_load, ref_load, loads)):
                    first, second = (a, b) if i % 2 == 0 else (b, a)
                    t1, t2 = _timed(first), _timed(second)
                    samples[0].append(mb / (t1 if first is a else t2))
                    samples[1].append(mb / (t2 if first is a else t1))
                fs.rm(f"bench/ak-{i}", recursive=True)
                fs.rm_file(ref)
        finally:
            ak.reset_state()
            os.environ.clear()
            os.environ.update(before)
    return [
        paired_row(f"save_state to S3 {mb:.0f} MB (vs torch.save + s3fs put)", *saves, unit="MB/s"),
        paired_row(f"load_state from S3 {mb:.0f} MB (vs s3fs get + torch.load)", *loads, unit="MB/s"),
    ]


def run(quick: bool) -> list[Row]:
    root = tempfile.mkdtemp(prefix="accelkit-bench-ckpt-", dir=os.environ.get("ACCELKIT_BENCH_DIR"))
    try:
        mb, ak_save, ref_save, ak_load, ref_load = _single_rounds(root, 3 if quick else 7)
        stall = _stall_row(root, quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        paired_row(f"save_state {mb:.0f} MB (vs torch.save + fsync)", ak_save, ref_save, unit="MB/s"),
        paired_row(f"load_state {mb:.0f} MB (vs torch.load)", ak_load, ref_load, unit="MB/s"),
        *_sharded_rows(quick),
        *_s3_rows(quick),
    ]
    for row in rows:
        row["ok"] = row["ratio"] >= TARGET_RATIO
    return [*rows, stall]
