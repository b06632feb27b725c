"""What grows with the world size: forming the group, and the load on the job's store; then 1024 ranks.

Measured here at 2, 4 and 8 processes (``--quick``: 2 and 4), each a fresh process started at
once (a shared starting gate, so that torch's import time is not counted):

- **forming the group**, as accelkit does it: the store (rank 0 hosts torch's ``TCPStore``, every
  rank connects), gloo's connection of every pair of ranks, and accelkit's handshake; each through
  a store that counts every operation, so the counts are exact; then the whole ``ak.init()``;
- **the heartbeat's load**: the store operations of each rank's heartbeat thread, counted while the
  ranks run collectives (``seconds`` each) and while all wait 5 s for one late rank;
- **the store's capacity**: ``2 x N`` client processes writing a rank's position to one
  ``TCPStore`` as fast as they can (on 2 shared cores, the clients take CPU from the server: a
  lower bound), and one read of 1024 positions (what each waiting rank reads).

From the counts and the capacity: what a job of 1024 ranks (128 nodes x 8) costs at the store, with
the heartbeat and node records at a fixed period (before) and at periods that grow with the world
(``heartbeat_period``, ``node_beat_period``: after). Run alone: ``python bench/scale.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, child_env, free_port

WORLD, NODES = 1024, 128  # the job extrapolated to: 128 nodes of 8 ranks
LATE_S = 5.0  # how long every rank waits for a late one
HERE = os.path.abspath(__file__)


class Counting(dist.Store):  # type: ignore[misc]
    """A store that counts each operation (and the keys of multi_get) and passes it on to ``inner``."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.ops = inner, Counter[str]()

    def set(self, key: str, value: Any) -> None:
        self.ops["set"] += 1
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.ops["get"] += 1
        return bytes(self.inner.get(key))

    def add(self, key: str, value: int) -> int:
        self.ops["add"] += 1
        return int(self.inner.add(key, value))

    def append(self, key: str, value: Any) -> None:
        self.ops["append"] += 1
        self.inner.append(key, value)

    def check(self, keys: list[str]) -> bool:
        self.ops["check"] += 1
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.ops["wait"] += 1
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops["multi_get"] += 1
        self.ops["keys read"] += len(keys)
        return list(self.inner.multi_get(keys))

    def delete_key(self, key: str) -> bool:
        self.ops["delete_key"] += 1
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def total(self) -> int:
        return _ops(self.ops)


def _gate(port: int) -> None:
    """Wait at the parent's starting gate: every process starts its clock at the same moment."""
    gate = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False)  # type: ignore[attr-defined]
    gate.add("ready", 1)
    gate.wait(["go"])


def _worker(rank: int, world: int, gate: int, ports: list[int], seconds: float) -> dict[str, Any]:
    """One rank: the group formed step by step on each port but the last, then by ``ak.init`` on the last.

    Returns each step's seconds, the store operations they made, and those of the heartbeat.
    """
    import accelkit as ak
    from accelkit import _state
    from accelkit._group import handshake, job_facts
    from accelkit._options import Options

    _gate(gate)
    steps: list[list[float]] = []  # per formation: store, gloo, handshake seconds
    for port in ports[:-1]:
        t0 = time.perf_counter()
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        mesh, fds = Counting(store), len(os.listdir("/proc/self/fd"))
        dist.init_process_group("gloo", store=dist.PrefixStore("mesh", mesh), rank=rank, world_size=world)  # type: ignore[attr-defined]
        t2 = time.perf_counter()
        fds = len(os.listdir("/proc/self/fd")) - fds  # gloo's sockets: one per pair of ranks
        shake = Counting(store)
        handshake(dist.PrefixStore("handshake", shake), rank, world, job_facts(Options(), world))  # type: ignore[attr-defined]
        steps.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
        dist.barrier()  # the next formation starts together (and rank 0's store outlives every client's use)
        dist.destroy_process_group()
        del store
    # The real thing: accelkit forms its own group (store, gloo, handshake) and starts the heartbeat.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[-1]))  # fmt: skip
    t4 = time.perf_counter()
    ak.init(cpu=True)
    ak.wait_for_everyone()
    t5 = time.perf_counter()
    beat = _state.group.heartbeat
    period = float(beat.period)
    beat.store = running = Counting(beat.store)
    start = time.monotonic()
    while True:  # a training loop's collectives, about 100 a second, until one rank has run long enough
        more = ak.reduce(torch.tensor([float(time.monotonic() - start < seconds)]))
        if int(more.item()) < world:
            break
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    ak.wait_for_everyone()
    beat.store = waiting = Counting(running.inner)
    if rank == 0:
        time.sleep(LATE_S)
    ak.wait_for_everyone()
    return {
        "steps": steps, "init": t5 - t4, "period": period,
        "fds": fds, "mesh_ops": mesh.total(), "handshake_ops": shake.total(), "elapsed": elapsed,
        "running": dict(running.ops), "waiting": dict(waiting.ops),
    }  # fmt: skip


def _client(port: int, gate: int, index: int, seconds: float, op: str) -> dict[str, Any]:
    """``op`` ("set": write a rank's position, "get": read it back) as fast as possible for ``seconds``; the count.

    A set has no reply: the clock stops after a get, once the store has taken every set before it.
    """
    from accelkit._group import Position

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False)  # type: ignore[attr-defined]
    payload, key = json.dumps(_position(Position, index)._asdict()), f"board/position/{index}"
    store.set(key, payload)
    _gate(gate)
    count, start = 0, time.perf_counter()
    call = store.set if op == "set" else store.get
    args = (key, payload) if op == "set" else (key,)
    while time.perf_counter() - start < seconds:
        call(*args)
        count += 1
    store.get(key)
    return {"ops": count, "seconds": time.perf_counter() - start, "bytes": len(payload)}


def _reader(port: int, gate: int, keys: int, repeats: int) -> dict[str, Any]:
    """One rank's read of ``keys`` positions (what a waiting rank reads), timed ``repeats`` times."""
    from accelkit._group import Position

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False)  # type: ignore[attr-defined]
    names = [f"board/position/{k}" for k in range(keys)]
    for k, name in enumerate(names):
        store.set(name, json.dumps(_position(Position, k)._asdict()))
    _gate(gate)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        got = store.multi_get(names)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "bytes": sum(len(v) for v in got)}


def _position(position: Any, rank: int) -> Any:
    now = time.time()
    return position(rank, "reduce", 123456, True, now, "/home/user/project/train.py:123 in train_one_epoch", now,
                    "9f3c2a4b5d6e7f80", "")  # fmt: skip


def _spawn(mode: str, args: list[str], count: int) -> list[dict[str, Any]]:
    """Start ``count`` children of this script at once, open the gate when all wait at it; their results."""
    port = free_port()
    gate = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=120), wait_for_workers=False)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, HERE, mode, str(port), *args]
        procs = [subprocess.Popen([*argv, str(i), os.path.join(out, f"{i}.json")], env=child_env(),
                                  start_new_session=True) for i in range(count)]  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while int(gate.add("ready", 0)) < count:
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"bench/scale.py {mode}: the children did not all start")
                time.sleep(0.05)
            gate.set("go", "1")
            for proc in procs:
                if proc.wait(timeout=180) != 0:
                    raise RuntimeError(f"bench/scale.py {mode} exited with {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
        results = []
        for i in range(count):
            with open(os.path.join(out, f"{i}.json")) as f:
                results.append(json.load(f))
    return results


def _ops(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if k != "keys read")


def _row(name: str, value: float | None, unit: str, n: int = 1, reference: float | None = None) -> Row:
    ratio = None if reference is None or value is None else value / reference
    return {"name": name, "unit": unit, "accelkit": value, "reference": reference, "diff": None, "ratio": ratio,
            "target": None, "ok": None, "n": n}  # fmt: skip


def measure(quick: bool) -> dict[str, Any]:
    """Every measurement, by world size; the inputs of :func:`run`'s rows and the README's table."""
    sizes, seconds, repeats = ((2, 4), 3.0, 1) if quick else ((2, 4, 8), 6.0, 5)
    found: dict[str, Any] = {"sizes": {}, "capacity": {}}
    for world in sizes:
        ports = ",".join(str(free_port()) for _ in range(repeats + 1))
        ranks = _spawn("--worker", [str(world), ports, str(seconds)], world)
        waiting = [r["waiting"] for r in ranks[1:]]
        # Each step of a formation takes as long as its slowest rank; the median over the repeats.
        steps = [[max(r["steps"][k][j] for r in ranks) for k in range(repeats)] for j in range(3)]
        found["sizes"][world] = {
            **dict(zip(("rendezvous", "mesh", "handshake"), map(statistics.median, steps), strict=True)),
            **{k: max(r[k] for r in ranks) for k in ("init", "period")},
            "form_ops": sum(r["mesh_ops"] + r["handshake_ops"] for r in ranks),
            "fds": max(r["fds"] for r in ranks),
            "handshake_ops": sum(r["handshake_ops"] for r in ranks),
            "beat_ops_per_s": sum(_ops(r["running"]) / r["elapsed"] for r in ranks),
            "wait_reads": sum(w.get("multi_get", 0) for w in waiting),
            "wait_keys": sum(w.get("keys read", 0) for w in waiting),
        }  # fmt: skip
    server_port = free_port()
    server = dist.TCPStore("127.0.0.1", server_port, None, True, timedelta(seconds=60), wait_for_workers=False)  # type: ignore[attr-defined]
    for op in ("set", "get"):
        for clients in (2, 4) if quick else (2, 8, 16):
            results = _spawn("--client", [str(server_port), str(seconds / 2), op], clients)
            found["capacity"][op, clients] = sum(r["ops"] / r["seconds"] for r in results)
    found["position_bytes"] = results[0]["bytes"]
    [read] = _spawn("--reader", [str(server_port), str(WORLD), "5" if quick else "20"], 1)
    found["read_world"] = read
    del server
    return found


def run(quick: bool) -> list[Row]:
    from accelkit._group._heartbeat import heartbeat_period
    from accelkit._launcher._nodes import PERIOD, node_beat_period

    m = measure(quick)
    rows: list[Row] = []
    for world, s in m["sizes"].items():
        rows += [
            _row(f"{world} ranks: form the store (rank 0 hosts, all connect)", s["rendezvous"], "s", world),
            _row(f"{world} ranks: gloo connects every pair", s["mesh"], "s", world),
            _row(f"{world} ranks: ... sockets each rank opens", s["fds"], "fds", world),
            _row(f"{world} ranks: handshake", s["handshake"], "s", world),
            _row(f"{world} ranks: ak.init() to the first barrier", s["init"], "s", world),
            _row(f"{world} ranks: store ops to form (gloo + handshake)", s["form_ops"], "ops", world),
            _row(f"{world} ranks: heartbeat store ops/s while training", s["beat_ops_per_s"], "ops/s", world),
            _row(f"{world} ranks: keys read while all wait {LATE_S:g} s for one", s["wait_keys"], "keys", world),
        ]  # fmt: skip
    for (op, clients), rate in m["capacity"].items():
        rows.append(_row(f"store capacity: {op}s/s, {clients} clients", rate, "ops/s", clients))
    writes = max(rate for (op, _), rate in m["capacity"].items() if op == "set")
    gets = max(rate for (op, _), rate in m["capacity"].items() if op == "get")
    read = m["read_world"]
    rows.append(_row(f"read {WORLD} positions (one waiting rank)", read["seconds"], "s"))
    # 1024 ranks. gloo's mesh costs each rank 1 set, N waits and N gets (counted above: 2N^2 + N ops);
    # the handshake a few ops per rank.
    largest = max(m["sizes"])
    shake = m["sizes"][largest]["handshake_ops"] / largest * WORLD
    form = 2 * WORLD * WORLD + WORLD + shake
    before = WORLD / 1.0 + NODES / PERIOD  # a position each second, a node record twice a second
    after = WORLD / heartbeat_period(WORLD, 30.0) + NODES / node_beat_period(NODES)
    rows += [
        _row(f"{WORLD} ranks: store ops to form the group (gloo + handshake)", form, "ops"),
        _row(f"{WORLD} ranks: ... store time at the measured get rate", form / gets, "s"),
        _row(f"{WORLD} ranks: ... sockets each rank opens", WORLD - largest + m["sizes"][largest]["fds"], "fds"),
        _row(f"{WORLD} ranks: heartbeat + node records, writes/s (ref: fixed)", after, "ops/s", reference=before),
        _row(f"{WORLD} ranks: ... share of the store's write rate (ref: fixed)", after / writes, "x",
             reference=before / writes),
        _row(f"{WORLD} ranks: all wait for one: keys read per round", (WORLD - 1) * WORLD, "keys"),
        _row(f"{WORLD} ranks: ... store time per round", (WORLD - 1) * read["seconds"], "s"),
        _row(f"{WORLD} ranks: ... bytes the store sends per round", (WORLD - 1) * read["bytes"] / 1e6, "MB"),
        _row("checked collective: see the README's Performance section (--only collectives)", None, ""),
    ]  # fmt: skip
    return rows


def main(argv: list[str]) -> int:
    """``[--quick]``: the table; ``MODE GATE ARGS... INDEX OUT``: one child of :func:`_spawn`."""
    if not argv or argv[0] == "--quick":
        from run import print_table

        print_table(run(bool(argv)))
        return 0
    mode, gate, *args, index, out = argv
    if mode == "--worker":  # WORLD PORT,PORT,... SECONDS
        result = _worker(int(index), int(args[0]), int(gate), [int(p) for p in args[1].split(",")], float(args[2]))
    elif mode == "--client":  # PORT SECONDS OP
        result = _client(int(args[0]), int(gate), int(index), float(args[1]), args[2])
    else:  # --reader PORT KEYS REPEATS
        result = _reader(int(args[0]), int(gate), int(args[1]), int(args[2]))
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
