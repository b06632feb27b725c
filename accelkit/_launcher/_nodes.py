"""Which node of a multi-node job was lost: each launcher beats in the rendezvous store.

When a node dies (killed, its machine or network gone), the others' workers fail with
"Connection closed by peer" or time out, which names neither the node nor its ranks. Every
launcher of a multi-node job therefore writes a small record to the rendezvous store twice a
second (less often beyond 32 nodes: :func:`node_beat_period`): its node rank, host, address,
group rank and number of processes, and a beat count. After its workers failed, a launcher reads
the records twice, a few beats apart: a node whose count stood still is lost, and the failure
names it first, with its ranks and host.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from typing import Any

__all__ = ["NodeBeat", "lost_nodes", "node_beat_period", "nodes_seen"]

PERIOD = 0.5  # seconds between two beats: 2 store writes a second per node, up to 32 nodes
STORE_WRITES_PER_S = 64.0  # the records all nodes may write each second: beyond it, each beats less often
_STILL = 4  # beats without a change before a node counts as lost


def node_beat_period(num_nodes: int) -> float:
    """Seconds between two beats of each node of a ``num_nodes`` job.

    Example:
        >>> node_beat_period(2), node_beat_period(128)
        (0.5, 2.0)
    """
    return max(PERIOD, num_nodes / STORE_WRITES_PER_S)


def _key(run_id: str, node_rank: int) -> str:
    return f"accelkit/{run_id}/alive/{node_rank}"


class NodeBeat(threading.Thread):
    """Writes this node's record to the store at ``addr:port`` every ``period`` s until :meth:`stop`."""

    def __init__(
        self, addr: str, port: int, run_id: str, node_rank: int, num_nodes: int, nprocs: int, local_addr: str
    ) -> None:
        super().__init__(name=f"accelkit-node{node_rank}-beat", daemon=True)
        self.addr, self.port, self.key = addr, port, _key(run_id, node_rank)
        self.period = node_beat_period(num_nodes)
        self.record: dict[str, Any] = {
            "node_rank": node_rank, "group_rank": node_rank, "nprocs": nprocs,
            "host": socket.gethostname(), "addr": local_addr, "beat": 0,
        }  # fmt: skip
        self._stopped = threading.Event()

    def set_group_rank(self, group_rank: int) -> None:
        """The rendezvous placed this node at ``group_rank`` (c10d: not always its node rank)."""
        self.record["group_rank"] = group_rank

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=10)

    def run(self) -> None:
        store = None
        while not self._stopped.wait(self.period):
            try:
                store = store or _client(self.addr, self.port)
                self.record["beat"] += 1
                store.set(self.key, json.dumps(self.record))
            except Exception:  # the store is not up yet (c10d: node 0's agent starts it), or gone
                store = None


def lost_nodes(addr: str, port: int, run_id: str, num_nodes: int, node_rank: int) -> str:
    """The nodes whose beat stopped, as the first line of a failure report; "" when none was lost."""
    try:
        store = _client(addr, port)
        keys = [_key(run_id, k) for k in range(num_nodes)]
        before = _records(store, keys)
        time.sleep(_STILL * node_beat_period(num_nodes))
        after = _records(store, keys)
    except Exception:
        if node_rank == 0:
            return ""
        return (
            f"node 0, which holds the rendezvous store at {addr}:{port}, was lost: it no longer answers "
            f"(killed, or its machine or network went down); the failures below followed from it"
        )
    lost = [k for k, record in after.items() if k != node_rank and record["beat"] == before.get(k, {}).get("beat")]
    if not lost:
        return ""
    order = sorted(after.values(), key=lambda r: r["group_rank"])
    first, starts = 0, {}
    for record in order:
        starts[record["node_rank"]] = first
        first += record["nprocs"]
    parts = []
    for k in lost:
        record, start = after[k], starts[k]
        ranks = f"rank {start}" if record["nprocs"] == 1 else f"ranks {start}-{start + record['nprocs'] - 1}"
        parts.append(f"node {k} ({ranks}, host {record['host']} at {record['addr']})")
    were = "was" if len(parts) == 1 else "were"
    return (
        f"{' and '.join(parts)} {were} lost: its launcher stopped answering (killed, or its machine or network "
        f"went down); the failures below followed from it"
    )


def nodes_seen(addr: str, port: int, run_id: str, num_nodes: int) -> set[int] | None:
    """The node ranks whose launcher has beaten in the store; None when the store does not answer."""
    try:
        return set(_records(_client(addr, port), [_key(run_id, k) for k in range(num_nodes)]))
    except Exception:
        return None


def _records(store: Any, keys: list[str]) -> dict[int, dict[str, Any]]:
    found = {}
    for key in keys:
        if store.check([key]):
            record = json.loads(store.get(key))
            found[int(record["node_rank"])] = record
    return found


def _client(addr: str, port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, timedelta(seconds=5), wait_for_workers=False)  # type: ignore[attr-defined]
