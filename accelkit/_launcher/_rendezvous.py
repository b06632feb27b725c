"""The rendezvous store of a launch, hosted (node 0) or joined before torch's agent starts.

A single-node store listens on its master address only (127.0.0.1 by default), and the
nodes of a multi-node job check in with a finite timeout, so that a node that never comes
is named instead of waited for.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ._netif import SOCKET_IFNAME_VARIABLES, Route, route_to, socket_ifname_env

if TYPE_CHECKING:
    from .._options import LaunchSettings


def _listen_fd_backend() -> dict[str, bool]:
    """TCPStore's keyword for a server on a socket we bound: before torch 2.8 only the legacy backend takes one.

    From torch 2.4 libuv is the default server, and until 2.7 it refuses ``master_listen_fd``
    (NotImplementedError; the ``USE_LIBUV=0`` variable it suggests is read by torch's own
    rendezvous helpers, not by a TCPStore made directly). TCPStore's public ``use_libuv=False``
    picks the legacy server, which listens on the socket as given, so the store still listens
    on master_addr only. libuv takes the socket from 2.8 on (pytorch#150215): the default there.
    """
    import torch

    return {"use_libuv": False} if torch.__version__ < "2.8" else {}


@contextlib.contextmanager
def rendezvous_store(config: LaunchSettings, route: Route | None = None) -> Iterator[tuple[str, int, str]]:
    """Host or join the rendezvous store before the agent does; yields (address, port, run id).

    torch's rendezvous creates its TCPStore with ``multi_tenant=True``, so the agent shares the
    server this process already runs on that port (kept alive until it is done, so that this
    launcher can still read the nodes' beats after its agent gave up).
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=config.rdzv_timeout)
    if config.num_nodes == 1:
        # Bind the store to master_addr (127.0.0.1 unless told otherwise) ourselves: TCPStore would
        # listen on every interface, open to the network for a job that never leaves this machine.
        addr = config.master_addr
        sock = _listen(addr, config.master_port)
        port = int(sock.getsockname()[1])
        run_id = f"accelkit-{uuid.uuid4().hex[:12]}"
        store = dist.TCPStore(  # type: ignore[attr-defined]
            addr,
            port,
            None,
            True,
            timeout,
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
            **_listen_fd_backend(),
        )
        yield addr, port, run_id  # the store (and its server) lives until the agent is done
        del store
        return
    if config.master_port is None:
        raise ConfigurationError(
            f"a {config.num_nodes}-node run needs master_port: every node must meet at the same address and port"
        )
    addr, port = config.master_addr, config.master_port
    # Every node's agent keys the rendezvous by run id: the nodes of one job must agree on it.
    run_id = f"accelkit-{port}"
    where = f"{addr}:{port}"
    print(f"accelkit: waiting up to {config.rdzv_timeout:g} s for {config.num_nodes} nodes at {where}", file=sys.stderr)
    if config.rdzv_backend != "static":  # torch's c10d rendezvous has its own join timeout
        if route is not None and hosts_c10d_store(config, route):
            store = _host(addr, port, timeout, config)
            yield addr, port, run_id
            del store
        else:
            yield addr, port, run_id
        return
    deadline = time.monotonic() + config.rdzv_timeout
    if config.node_rank != 0:
        _wait_for_node0(addr, port, deadline, config)
    store = _host(addr, port, timeout, config)
    _check_in(store, config, where, run_id, deadline)
    yield addr, port, run_id


def hosts_c10d_store(config: LaunchSettings, route: Route) -> bool:
    """Whether this node hosts the c10d rendezvous's store: node 0, when the address is its own."""
    return route.own and config.node_rank == 0 and not route.loopback


def _host(addr: str, port: int, timeout: timedelta, config: LaunchSettings) -> Any:
    """Node 0: the store's server on ``port``; another node: a client of it."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            addr, port, None, config.node_rank == 0, timeout, wait_for_workers=False, multi_tenant=True
        )
    except Exception as exc:
        raise ConfigurationError(
            f"node {config.node_rank} could not {'host' if config.node_rank == 0 else 'join'} the rendezvous at "
            f"{addr}:{port}: {exc}. Is port {port} free on node 0? Choose another master port, the same on every "
            f"node."
        ) from None


def network_route(config: LaunchSettings) -> tuple[Route | None, dict[str, str]]:
    """A multi-node launch: the route to the main process, and the interface variables for the workers.

    Said on stderr, with the variables the user had set. One node: ``(None, {})``, nothing changes.
    """
    if config.num_nodes == 1:
        return None, {}
    route = route_to(config.master_addr, config.master_port)
    chosen = socket_ifname_env(route)
    kept = [f"{name}={os.environ[name]} (yours)" for name in SOCKET_IFNAME_VARIABLES if name not in chosen]
    binds = ", ".join([*(f"{name}={value}" for name, value in chosen.items()), *kept])
    print(
        f"accelkit: node {config.node_rank} reaches the main process at {route.target} through {route.ifname} "
        f"({route.local_addr}); the workers bind to {binds}",
        file=sys.stderr,
    )
    return route, chosen


def _wait_for_node0(addr: str, port: int, deadline: float, config: LaunchSettings) -> None:
    # Probing with a plain socket first: TCPStore's own retries print C++ stack traces on stderr.
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"node {config.node_rank}: node 0 at {addr}:{port} did not answer within "
                    f"{config.rdzv_timeout:g} s. Start node 0 (node rank 0) with the same master address and "
                    f"port, check that {addr}:{port} is reachable from this machine, or allow longer with a "
                    f"larger rendezvous timeout."
                ) from None
            time.sleep(0.2)


def _check_in(store: Any, config: LaunchSettings, where: str, run_id: str, deadline: float) -> None:
    """Announce this node; wait until every node did, or name those that did not."""
    keys = [f"accelkit/{run_id}/node{k}" for k in range(config.num_nodes)]
    try:
        store.set(keys[config.node_rank], str(os.getpid()))
        while not store.check(keys):  # polled: a timed-out store.wait logs C++ warnings
            if time.monotonic() >= deadline:
                missing = [k for k, key in enumerate(keys) if not store.check([key])]
                break
            time.sleep(0.1)
        else:
            return
    except Exception as exc:
        raise TimeoutError(
            f"node {config.node_rank}: lost the rendezvous at {where} (node 0 gave up or stopped): {exc}"
        ) from None
    names = ", ".join(map(str, missing))
    raise TimeoutError(
        f"node {config.node_rank}: node rank(s) {names} of {config.num_nodes} did not join the rendezvous "
        f"at {where} within {config.rdzv_timeout:g} s. Start each missing node with its node rank and "
        f"the same master address and port, or allow longer with a larger rendezvous timeout."
    )


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``addr`` now (for a store another process will host).

    Args:
        addr: the address to bind.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _listen(addr: str, port: int | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port or 0))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"master_addr={addr!r}, master_port={port}: cannot listen there ({exc.strerror or exc}); choose a "
            f"free port (or leave it unset to pick one) and an address of this machine (127.0.0.1 by default)"
        ) from None
    return sock
