"""Collectives: µs per call of accelkit's gather / reduce / broadcast / pad_across_processes
against the same job done with raw torch.distributed, on 2 gloo CPU processes.

Each case times accelkit and the reference in interleaved blocks (the order alternates
from block to block) in the same two processes, and reports the median of the paired
ratios. ``raw vs raw`` rows time the reference against itself: their spread is the noise.

The references do what accelkit promises (new tensors, inputs untouched) the way one
would write it by hand: gather = ``all_gather_into_tensor`` into a new tensor; reduce =
``clone`` + ``all_reduce``; broadcast = ``clone`` on the source, ``empty_like`` elsewhere, +
``broadcast``; pad = ``all_gather`` of the sizes + ``new_zeros`` + copy; trees one call per leaf.

Where Accelerate is installed (``pip install accelerate``), its calls for the same jobs
(``accelerate.utils.gather/reduce/broadcast/pad_across_processes`` and
``Accelerator.gather_for_metrics``) are timed in the same blocks, each contender leading in
turn: the ``Accelerate:`` rows give its ratio against the same raw reference.

``result used`` rows time each call followed by a first use of its result (its sum): the first tensor
operation after a blocking wait costs a wake-up (measured ~15 µs on a 2-core machine, ~1 µs otherwise), which a
call that returns without touching its result leaves to its caller, and the caller's next step pays.

``header by hand`` rows time the least a checked broadcast does, written by hand (a header after the
source's data, copied out and compared by each receiver) against raw: the floor of a broadcast that checks.

``added CPU`` rows isolate what accelkit adds per call from the network's noise: the same
pairs on torch's in-process fake process group (collectives that do nothing), in a child
process; their ``diff`` is the µs accelkit spends around each torch.distributed call.

``--instructions`` counts instead the machine instructions each call runs on the fake group
(valgrind's callgrind, thousands per call: ``kI``), for accelkit, raw torch.distributed and
Accelerate: a measure of host work that a loaded machine does not move (about 3 minutes; needs
``valgrind`` on the PATH).

``world N`` rows sweep the world size (2, 4 and 8 processes on this machine: more processes
than cores, so the absolute times grow; the ratio is what compares): µs per call against raw,
and the bytes each rank sends per call (``bytes/call`` rows: what the process wrote to its
sockets, from ``/proc/self/io``) against raw.

Run ``python bench/collectives.py [--quick] [--no-sweep] [--only=gather,reduce] [--instructions]`` or through
``bench/run.py`` (``--only`` keeps the cases whose names begin so).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import Row, child_env, paired_row, run_child

TARGET_RATIO = 1.05
SIZES = {"1e3": 1_000, "1e5": 100_000, "1e6": 1_000_000}
OPS = ("gather", "reduce", "broadcast", "pad_across_processes")
_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _raw_gather(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]) if x.dim() else (dist.get_world_size(),))
    _single(out, x.reshape(-1) if x.dim() == 0 else x)
    return out


def _raw_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, dist.ReduceOp.SUM)
    return out


def _raw_broadcast(x: torch.Tensor) -> torch.Tensor:
    out = x.clone() if dist.get_rank() == 0 else torch.empty_like(x)
    dist.broadcast(out, 0)
    return out


def _raw_pad(x: torch.Tensor) -> torch.Tensor:
    size = torch.tensor([x.shape[0]])
    sizes = size.new_empty(dist.get_world_size())
    _single(sizes, size)
    out = x.new_zeros((int(sizes.max()), *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


class _HeaderBroadcast:
    """The least a checked broadcast does, by hand: a 64-byte header after the source's data, copied out and
    compared by each receiver (no count, plan or position; the ``header by hand`` rows)."""

    def __init__(self) -> None:
        self.seq, self.raw = 0, bytearray(64)
        self.head = torch.frombuffer(self.raw, dtype=torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        number, n = self.seq.to_bytes(8, "little"), x.numel()
        if dist.get_rank() == 0:
            self.raw[:] = b"".join((b"akc2", number, bytes(52)))
            message = torch.cat([x, self.head])
        else:
            message = torch.empty(n + 16)
        out, tail = message.split_with_sizes([n, 16])
        dist.broadcast(message, 0)
        if dist.get_rank() != 0:
            self.head.copy_(tail)
            if self.raw[4:12] != number:
                raise RuntimeError("the broadcasts differ")
        return out


RAW = {"gather": _raw_gather, "reduce": _raw_reduce, "broadcast": _raw_broadcast, "pad_across_processes": _raw_pad}


# (name, accelkit's call, raw torch's, Accelerate's or None where it is not installed)
Case = tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], Any] | None]


def _bind(fn: Callable[[Any], Any], data: Any) -> Callable[[], Any]:
    return lambda: fn(data)


def _per_leaf(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], Any]:
    return lambda tree: {k: fn(v) for k, v in tree.items()}


def _accelerate() -> dict[str, Callable[[Any], Any]] | None:
    """Accelerate's calls for the same jobs (its utils, as ``Accelerator.gather`` etc. call them), if installed."""
    try:
        from accelerate import Accelerator
        from accelerate.utils import broadcast, gather, pad_across_processes, reduce
    except ImportError:
        return None
    accelerator = Accelerator(cpu=True)
    return {
        "gather": gather,
        "reduce": lambda d: reduce(d, reduction="sum"),
        "broadcast": broadcast,
        "pad_across_processes": pad_across_processes,
        "gather_for_metrics": accelerator.gather_for_metrics,
    }


def _cases(rank: int, only: tuple[str, ...] = (), with_accelerate: bool = True) -> list[Case]:
    import accelkit as ak

    theirs = _accelerate() if with_accelerate else None

    ours: dict[str, Callable[[Any], Any]] = {
        "gather": ak.gather,
        "reduce": lambda d: ak.reduce(d, op="sum"),
        "broadcast": ak.broadcast,
        "pad_across_processes": ak.pad_across_processes,
    }
    cases: list[Case] = []
    for op in OPS:
        for label, n in SIZES.items():
            # pad: ranks hold different lengths, so that padding really happens
            x = torch.randn(n - rank if op == "pad_across_processes" else n)
            other = _bind(theirs[op], x.clone()) if theirs else None  # Accelerate's broadcast is in place
            cases.append((f"{op} {label} floats", _bind(ours[op], x), _bind(RAW[op], x), other))
        if op == "pad_across_processes":
            tree = {"logits": torch.randn(8 - rank, 10), "labels": torch.arange(8 - rank)}
        else:
            tree = {"loss": torch.tensor(0.5), "logits": torch.randn(8, 10), "labels": torch.arange(8)}
        name = f"{op} dict of {len(tree)} tensors"
        other = _bind(theirs[op], {k: v.clone() for k, v in tree.items()}) if theirs else None
        cases.append((name, _bind(ours[op], tree), _bind(_per_leaf(RAW[op]), tree), other))
    x = torch.randn(SIZES["1e3"])
    metrics = _bind(theirs["gather_for_metrics"], x) if theirs else None
    cases.append(("gather_for_metrics 1e3 floats", _bind(ak.gather_for_metrics, x), _bind(_raw_gather, x), metrics))
    for op in ("gather", "reduce", "broadcast"):  # each call, then the first use of its result, as a step makes it
        for label in ("1e3", "1e5"):
            x = torch.randn(SIZES[label])
            other = _used(theirs[op], x.clone()) if theirs else None
            cases.append((f"{op} {label} floats, result used", _used(ours[op], x), _used(RAW[op], x), other))
    for label in ("1e3", "1e5"):
        x = torch.randn(SIZES[label])
        cases.append((f"header by hand: broadcast {label} floats", _bind(_HeaderBroadcast(), x),
                      _bind(_raw_broadcast, x), None))  # fmt: skip
    for label in ("1e3", "1e6"):
        x = torch.randn(SIZES[label])
        cases.append((f"raw vs raw: gather {label} floats", _bind(_raw_gather, x), _bind(_raw_gather, x), None))
    return [c for c in cases if not only or c[0].startswith(only)]


def _used(fn: Callable[[Any], Any], data: Any) -> Callable[[], Any]:
    """The call, then a first operation on its result (its sum): a blocking collective's caller pays, in its first
    tensor operation after the wait, a wake-up cost that a call which touches nothing after it leaves to its caller
    (~15 µs on a 2-core machine): with the result used, every contender pays it once."""
    return lambda: fn(data).sum()


def _measure(quick: bool, only: tuple[str, ...] = ()) -> list[tuple[str, list[float], list[float], list[float]]]:
    """In each worker: (name, accelkit µs per call, reference µs, Accelerate µs or []) per block."""
    import accelkit as ak

    rounds = 10 if quick else 200  # short paired blocks, many of them: the median ratio is stable
    results = []
    for name, ours, ref, theirs in _cases(ak.rank(), only):
        n_rounds, n_calls = (max(4, rounds // 5), 1) if "1e6" in name else (rounds, 2)
        fns = [ours, ref] if theirs is None else [ours, ref, theirs]
        for fn in fns * 2:  # warm-up
            fn()
        samples: list[list[float]] = [[] for _ in fns]
        for r in range(n_rounds):
            shift = r % len(fns)  # each contender leads in turn
            for which in [*range(shift, len(fns)), *range(shift)]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(n_calls):
                    fns[which]()
                samples[which].append((time.perf_counter() - start) / n_calls * 1e6)
        results.append((name, samples[0], samples[1], samples[2] if theirs is not None else []))
    return results


def _added_cpu(quick: bool, only: tuple[str, ...] = ()) -> list[tuple[str, list[float], list[float]]]:
    """In a child process: the cases on a fake 2-process group (no communication at all)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        results = []
        for name, ours, ref, _ in _cases(0, only, with_accelerate=False):
            if "1e3" not in name and "dict" not in name:
                continue  # the added time does not depend on the size
            samples: dict[int, list[float]] = {0: [], 1: []}
            for r in range(20 if quick else 200):
                for which in (0, 1) if r % 2 == 0 else (1, 0):
                    fn = ours if which == 0 else ref
                    start = time.perf_counter()
                    for _ in range(20):
                        fn()
                    samples[which].append((time.perf_counter() - start) / 20 * 1e6)
            results.append((name, samples[0], samples[1]))
        return results
    finally:
        import accelkit as ak

        ak.reset_state()
        dist.destroy_process_group()


def _counted(only: tuple[str, ...] = ()) -> None:
    """In a child under callgrind: each contender's calls on a fake 2-process group, counted (they run inside
    ``functools.reduce``, the one function whose instructions callgrind collects), each followed by a dump
    (callgrind dumps before ``os.getppid``). Prints which case each dump holds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dumps = []
        for name, ours, ref, theirs in _cases(0, only):
            if "1e3" not in name and "dict" not in name:
                continue  # the work around the backend call does not depend on the size
            for who, fn in (("accelkit", ours), ("raw", ref), ("Accelerate", theirs)):
                if fn is None:
                    continue
                for _ in range(30):
                    fn()
                functools.reduce(lambda _, __, fn=fn: fn(), range(COUNTED), None)
                os.getppid()
                dumps.append((name, who))
        print(json.dumps(dumps))
    finally:
        import accelkit as ak

        ak.reset_state()
        dist.destroy_process_group()


COUNTED = 50  # calls per count


def instructions(only: tuple[str, ...] = ()) -> list[Row]:
    """Thousands of instructions per call on the fake group, accelkit against raw (and Accelerate's rows)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
               "--dump-before=os_getppid", f"--callgrind-out-file={out}", sys.executable, __file__, "--counted",
               f"--only={','.join(only)}"]  # fmt: skip
        _, stdout = run_child(cmd, child_env(ACCELKIT_CPU="1"), timeout=3600)
        dumps = json.loads(stdout.strip().splitlines()[-1])
        counts: dict[tuple[str, str], float] = {}
        for i, key in enumerate(dumps, start=1):
            with open(f"{out}.{i}") as f:
                total = next(int(line.split()[1]) for line in f if line.startswith("summary:"))
            counts[tuple(key)] = total / COUNTED / 1000  # type: ignore[index]
    rows = []
    for name in dict.fromkeys(name for name, _ in dumps):
        ref = counts[name, "raw"]
        rows.append(paired_row(f"instructions: {name} (fake group)", [counts[name, "accelkit"]], [ref], unit="kI"))
        if (name, "Accelerate") in counts:
            rows.append(paired_row(f"  Accelerate: {name}", [counts[name, "Accelerate"]], [ref], unit="kI"))
    return rows


SWEEP_WORLDS = (2, 4, 8)
SWEEP_SIZES = {"1e3": 1_000, "1e6": 1_000_000}


def _written() -> int:
    """Bytes this process has written through system calls so far (its sockets' traffic, here)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return -1


def _sweep_measure(quick: bool) -> list[tuple[str, list[float], list[float], float, float]]:
    """In each worker of a world: (name, accelkit µs, raw µs per block, accelkit bytes/call, raw bytes/call)."""
    import accelkit as ak

    ours = {"gather": ak.gather, "reduce": ak.reduce, "broadcast": ak.broadcast}
    results = []
    for op in ("gather", "reduce", "broadcast"):
        for label, n in SWEEP_SIZES.items():
            x = torch.randn(n)
            mine, ref = _bind(ours[op], x), _bind(RAW[op], x)
            for fn in (mine, ref, mine, ref):  # warm-up: the first call at a point of the program is checked first
                fn()
            calls = 1 if n >= 1_000_000 else 5
            sent = []
            for fn in (mine, ref):
                dist.barrier()
                before = _written()
                for _ in range(calls):
                    fn()
                sent.append((_written() - before) / calls)
            samples: dict[int, list[float]] = {0: [], 1: []}
            for r in range(3 if quick else (8 if n >= 1_000_000 else 40)):
                for which in (0, 1) if r % 2 == 0 else (1, 0):
                    fn = mine if which == 0 else ref
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    samples[which].append((time.perf_counter() - start) / calls * 1e6)
            results.append((f"{op} {label} floats", samples[0], samples[1], sent[0], sent[1]))
    return results


def sweep(quick: bool) -> list[Row]:
    """The world-size sweep's rows: time against raw, and bytes sent per rank per call against raw."""
    from accelkit.testing import WorkerPool

    rows = []
    for world in SWEEP_WORLDS:
        with WorkerPool(world, task_timeout=1800.0, debug=False) as pool:
            per_rank = pool.run(_sweep_measure, quick)
        for i, (name, ours, ref, _, _) in enumerate(per_rank[0]):  # rank 0's clock; every rank's bytes
            rows.append(paired_row(f"world {world}: {name}", ours, ref, unit="us"))
            mine = statistics.mean(rank[i][3] for rank in per_rank)
            raw = statistics.mean(rank[i][4] for rank in per_rank)
            rows.append(paired_row(f"world {world}: {name}, bytes/call per rank", [mine], [raw], unit="B"))
    return rows


def _only(argv: list[str]) -> tuple[str, ...]:
    """``--only=gather,reduce``: the name prefixes of the cases to run (all, without it)."""
    return tuple(p for a in argv if a.startswith("--only=") for p in a.split("=", 1)[1].split(",") if p)


def run(quick: bool) -> list[Row]:
    from accelkit.testing import WorkerPool

    only = _only(sys.argv)
    with WorkerPool(2, task_timeout=900.0, debug=False) as pool:
        per_rank = pool.run(_measure, quick, only)
    rows = []
    for name, ours, ref, theirs in per_rank[0]:  # rank 0's clock
        target = (TARGET_RATIO - 1) * statistics.median(ref)
        rows.append(paired_row(f"{name} (2 gloo procs)", ours, ref, target=target, unit="us"))
        if theirs:
            rows.append(paired_row(f"  Accelerate: {name}", theirs, ref, unit="us"))
    if "--no-sweep" not in sys.argv:
        rows += sweep(quick)
    args = [sys.executable, __file__, "--added-cpu"] + (["--quick"] if quick else []) + [f"--only={','.join(only)}"]
    _, out = run_child(args, child_env(ACCELKIT_CPU="1"), timeout=600)
    for name, ours, ref in json.loads(out.strip().splitlines()[-1]):
        rows.append(paired_row(f"added CPU: {name} (fake group)", ours, ref, unit="us"))
    return rows


def main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return
    if "--added-cpu" in argv:
        print(json.dumps(_added_cpu("--quick" in argv, _only(argv))))
        return
    if "--counted" in argv:
        _counted(_only(argv))
        return
    if "--instructions" in argv:
        rows = instructions(_only(argv))
    else:
        rows = sweep("--quick" in argv) if "--sweep" in argv else run("--quick" in argv)
    print(f"{'case':52} {'accelkit':>10} {'raw':>10} {'diff':>9} {'ratio':>7}")
    for row in rows:
        flag = "" if row["ok"] is None else "  ok" if row["ratio"] <= TARGET_RATIO else "  OVER"
        unit = row["unit"]
        print(
            f"{row['name']:52} {row['accelkit']:8.1f}{unit} {row['reference']:8.1f}{unit} "
            f"{row['diff']:+7.1f}{unit} {row['ratio']:6.3f}x{flag}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
