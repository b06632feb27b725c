"""Two machines for real: one `accelkit launch` (or `@ak.distributed`) per network namespace, joined by
a veth pair and nothing else, with the hostname resolving to the pair's address or elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from netns import Host, two_hosts, why_not
from processes import subprocess_env

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "ddp_train.py")
PORT = "29611"  # free in a fresh namespace

needs_namespaces = pytest.mark.skipif(bool(why_not()), reason=str(why_not()))
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _launch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "accelkit.cli", "launch", "--cpu", *argv]


def _node(k: int, main: Host, rdzv: str, *extra: str) -> list[str]:
    """Node ``k``'s command: `accelkit launch`, or the script's `@ak.distributed` with ``decorated``
    (whose rendezvous backend comes from the config file: see :func:`_env`)."""
    if "decorated" in extra:
        return [sys.executable, TRAIN, *extra, str(k), "2", main.addr, PORT]
    return _launch(
        "-n", "2", "--num-nodes", "2", "--node-rank", str(k), "--main-process-ip", main.addr,
        "--main-process-port", PORT, "--rdzv-backend", rdzv, "--rdzv-timeout", "120", TRAIN, *extra,
    )  # fmt: skip


def _env(tmp_path: Path, rdzv: str) -> dict[str, str]:
    """The nodes' environment: the report directory, a one-minute collective timeout, a config file."""
    config = tmp_path / "accelkit.yaml"
    config.write_text(f"rdzv_backend: {rdzv}\nrdzv_timeout: 120\n")
    return subprocess_env(REPORT_DIR=str(tmp_path), ACCELKIT_TIMEOUT="60", ACCELKIT_CONFIG_FILE=str(config))


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    done = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err += "\n<killed: the job did not end in time>"
        done.append((proc.returncode, err))
    return done


@pytest.fixture(scope="module")
def one_host_params(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The reference: the same job as one 4-process launch on this machine."""
    out = tmp_path_factory.mktemp("one-host")
    done = subprocess.run(
        _launch("-n", "4", TRAIN), env=subprocess_env(REPORT_DIR=str(out)), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "params.pt")


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Iterator[tuple[Host, Host]]:
    """Two namespaces on a veth pair; the hostname resolves as ``request.param`` says (default: the pair)."""
    with two_hosts(getattr(request, "param", (None, None))) as pair:
        yield pair


def _train_on_two_hosts(hosts: tuple[Host, Host], rdzv: str, how: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Node 0 and node 1 in their namespaces until both end; rank 0's trained parameters."""
    main = hosts[0]
    extra = ("decorated",) if how == "decorated" else ()
    procs = [host.start(_node(k, main, rdzv, *extra), _env(tmp_path, rdzv)) for k, host in enumerate(hosts)]
    for k, (code, err) in enumerate(_finish(procs)):
        assert code == 0, f"node {k}:\n{err[-4000:]}"
    return dict(torch.load(tmp_path / "params.pt"))


def _assert_same(trained: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert trained.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(trained[name], value), name


@needs_namespaces
@pytest.mark.parametrize("how", ["launch", "decorated"])
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_hosts_train_like_one_host(
    hosts: tuple[Host, Host], rdzv: str, how: str, one_host_params: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    assert hosts[0].run(["getent", "hosts", os.uname().nodename]).split()[0] == hosts[0].addr
    _assert_same(_train_on_two_hosts(hosts, rdzv, how, tmp_path), one_host_params)
