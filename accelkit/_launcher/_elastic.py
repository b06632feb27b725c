"""torch's c10d rendezvous, made fit for replacing a lost node (``rdzv_backend="c10d"``).

When a node dies and is started again, the survivors restart their workers (their agents count
one restart) and meet the new node in the next round of the rendezvous. Two things then go wrong
with torch's handler as it is, and this wrapper mends both:

- torch remembers the workers' store address from the first round and publishes it in a round's
  key space only in the round that creates the store: the new node waits for it forever. Here the
  round's rank 0 publishes it every round, and the others take it from there.
- each agent counts its own restarts, so the survivors' workers are at attempt 1 while the new
  node's are at attempt 0, and their process groups use different keys. Here the rounds are
  counted in the rendezvous store, once per round, and the workers read that count
  (``ACCELKIT_ATTEMPT``) as the job's restart count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

__all__ = ["BACKEND", "ON_ROUND", "OnRound", "register"]

BACKEND = "accelkit-c10d"
_ROUNDS = "accelkit/rounds"

# The rendezvous setting that names what hears each round: this node's group rank and the attempt.
ON_ROUND = "accelkit_on_round"
OnRound = Callable[[int, int], None]


def register() -> None:
    """Make ``rdzv_backend=BACKEND`` available to torch's launcher (again: a no-op)."""
    rendezvous_handler_registry.register(BACKEND, _create)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    on_round = params.config.pop(ON_ROUND, None)
    backend, store = create_backend(params)
    return _Handler(create_handler(store, backend, params), store, on_round)


class _Handler(RendezvousHandler):
    """torch's dynamic handler, with the store address and the attempt agreed on every round."""

    def __init__(self, inner: RendezvousHandler, store: Any, on_round: OnRound | None) -> None:
        self._inner, self._store, self._on_round = inner, store, on_round

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        round_store, rank = info.store, info.rank
        boot = info.bootstrap_store_info
        if rank == 0:
            if boot is None:
                raise RuntimeError("torch's c10d rendezvous gave rank 0 no store address")
            attempt = self._store.add(_ROUNDS, 1) - 1  # the round's keys are fresh; this count is not
            round_store.set("accelkit/attempt", str(attempt))
            round_store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr)
            round_store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port))
        else:
            attempt = int(round_store.get("accelkit/attempt"))
            addr = round_store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
            port = int(round_store.get(RendezvousStoreInfo.MASTER_PORT_KEY))
            boot = RendezvousStoreInfo(addr, port)
        if self._on_round is not None:
            self._on_round(rank, attempt)
        return RendezvousInfo(round_store, rank, info.world_size, boot)

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()
