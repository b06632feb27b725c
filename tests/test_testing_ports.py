"""accelkit.testing.free_port(): a port kept from every other process until the test's own server binds it.

A port that was only free when asked (bound, then let go) could be given to another process in the
seconds a busy machine takes to start a launch: that launch then fails, or, worse, a rank told the
port joins another job's store, where it takes a rank's place (every accelkit group of a first
attempt keys its store alike), and that job waits for its own rank until the timeout.
"""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch.distributed as dist
from processes import subprocess_env

from accelkit.testing import free_port

BIND = "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))"


def test_no_other_process_can_take_the_port() -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-c", BIND, str(port)], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "Address already in use" in done.stderr, done.stderr


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv store", "legacy store"])
def test_the_store_the_test_starts_binds_it_all_the_same(libuv: bool) -> None:
    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout, wait_for_workers=False, use_libuv=libuv)  # type: ignore[attr-defined]
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout, wait_for_workers=False)  # type: ignore[attr-defined]
    client.set("key", "value")
    assert server.get("key") == b"value"


def test_each_port_is_another() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
