"""Two machines for real: one `accelkit launch` (or `@ak.distributed`) per network namespace, joined by
a veth pair and nothing else, with the hostname resolving to the pair's address or elsewhere."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from netns import Host, two_hosts, why_not
from processes import subprocess_env

import accelkit as ak
from accelkit._launcher._netif import Route, route_to, socket_ifname_env

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "ddp_train.py")
PORT = "29611"  # free in a fresh namespace
# Debian's /etc/hosts maps the hostname to 127.0.1.1: gloo binds there, where no other host can connect.
ELSEWHERE = ("127.0.1.1", "127.0.1.1")

_WHY_NOT = why_not()


def needs_namespaces(test: Any) -> Any:
    """Two machines of network namespaces: slow, distributed, skipped with the reason where they cannot be made."""
    return pytest.mark.slow(pytest.mark.distributed(pytest.mark.skipif(bool(_WHY_NOT), reason=str(_WHY_NOT))(test)))


def _launch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "accelkit", "launch", "--cpu", *argv]


def _node(k: int, main: Host, rdzv: str, *extra: str, flags: tuple[str, ...] = ()) -> list[str]:
    """Node ``k``'s command: `accelkit launch`, or the script's `@ak.distributed` with ``decorated``
    (whose rendezvous backend comes from the config file: see :func:`_env`)."""
    if "decorated" in extra:
        return [sys.executable, TRAIN, *extra, str(k), "2", main.addr, PORT]
    return _launch(
        "-n", "2", "--num-nodes", "2", "--node-rank", str(k), "--main-process-ip", main.addr,
        "--main-process-port", PORT, "--rdzv-backend", rdzv, "--rdzv-timeout", "120", *flags, TRAIN, *extra,
    )  # fmt: skip


def _env(tmp_path: Path, rdzv: str) -> dict[str, str]:
    """The nodes' environment: the report directory, a one-minute collective timeout, a config file, and
    a temporary directory of the test's own (a node a test kills leaves its launcher's run directory)."""
    config = tmp_path / "accelkit.yaml"
    config.write_text(f"rdzv_backend: {rdzv}\nrdzv_timeout: 120\n")
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    return subprocess_env(
        REPORT_DIR=str(tmp_path), ACCELKIT_TIMEOUT="60", ACCELKIT_CONFIG_FILE=str(config), TMPDIR=str(temp)
    )


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[tuple[int, str]]:
    """Each process's exit code and stderr, once all ended (killed after ``timeout`` s); stdout in ``outs``."""
    deadline = time.monotonic() + timeout
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n<killed: the job did not end in time>"
        outs[proc.pid] = out
        done.append((proc.returncode, err))
    return done


outs: dict[int, str] = {}  # what each finished process printed on stdout, by pid


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


def _train_on_two_hosts(
    hosts: tuple[Host, Host], rdzv: str, how: str, tmp_path: Path
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Node 0 and node 1 in their namespaces until both end; rank 0's trained parameters, each node's stderr."""
    main = hosts[0]
    extra = ("decorated",) if how == "decorated" else ()
    procs = [host.start(_node(k, main, rdzv, *extra), _env(tmp_path, rdzv)) for k, host in enumerate(hosts)]
    errs = []
    for k, (code, err) in enumerate(_finish(procs)):
        assert code == 0, f"node {k}:\n{err[-4000:]}"
        errs.append(err)
    return dict(torch.load(tmp_path / "params.pt")), errs


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
    _assert_same(_train_on_two_hosts(hosts, rdzv, how, tmp_path)[0], one_host_params)


@needs_namespaces
@pytest.mark.parametrize("hosts", [ELSEWHERE], indirect=True, ids=["hostname elsewhere"])
@pytest.mark.parametrize(("rdzv", "how"), [("static", "launch"), ("c10d", "launch"), ("c10d", "decorated")])
def test_a_hostname_that_resolves_elsewhere_changes_nothing(
    hosts: tuple[Host, Host], rdzv: str, how: str, one_host_params: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # Without the interface chosen for them, gloo's ranks advertise 127.0.1.1 to each other (static),
    # and with c10d no node hosts the store: each waited for the collective timeout.
    assert hosts[0].run(["getent", "hosts", os.uname().nodename]).split()[0] == "127.0.1.1"
    trained, errs = _train_on_two_hosts(hosts, rdzv, how, tmp_path)
    _assert_same(trained, one_host_params)
    for k, err in enumerate(errs):
        ifname, addr = hosts[k].ifname, hosts[k].addr
        expected = f"node {k} reaches the main process at {hosts[0].addr} through {ifname} ({addr}); "
        assert expected + f"the workers bind to GLOO_SOCKET_IFNAME={ifname}, NCCL_SOCKET_IFNAME={ifname}" in err


@needs_namespaces
def test_a_wrong_interface_or_address_fails_in_seconds_naming_the_interfaces(
    hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    main, other = hosts
    table = f"lo (127.0.0.1, ::1), {other.ifname} ({other.addr}"
    cases = {
        "loopback": ({"GLOO_SOCKET_IFNAME": "lo"}, main.addr, ["GLOO_SOCKET_IFNAME='lo': 'lo' cannot carry this job"]),
        "no such interface": ({"NCCL_SOCKET_IFNAME": "=ib0"}, main.addr, ["'=ib0'", "no such interface"]),
        "unreachable": ({}, "10.78.0.1", ["no network interface of this machine reaches", "10.78.0.1"]),
        "unresolvable": ({}, "node0.invalid", ["'node0.invalid' does not resolve"]),
    }
    for name, (variables, address, expected) in cases.items():
        started = time.monotonic()
        argv = _launch(
            "-n", "2", "--num-nodes", "2", "--node-rank", "1", "--main-process-ip", address,
            "--main-process-port", PORT, TRAIN,
        )  # fmt: skip
        proc = other.start(argv, subprocess_env(**variables))
        [(code, err)] = _finish([proc], timeout=60)
        assert time.monotonic() - started < 30, name
        assert code == 2 and "Traceback" not in err, (name, err[-3000:])
        assert all(part in err for part in [*expected, table]), (name, err[-3000:])
    # `accelkit env` shows the choice, for the main process of the config file.
    config = tmp_path / "accelkit.yaml"
    config.write_text(f"num_nodes: 2\nmain_process_ip: {main.addr}\nmain_process_port: {PORT}\n")
    out = other.run([sys.executable, "-m", "accelkit", "env", "--config-file", str(config)], subprocess_env())
    assert f"- main process: {main.addr}, reached through {other.ifname} ({other.addr})\n" in out
    assert f"- GLOO_SOCKET_IFNAME: {other.ifname} (set by a multi-node launch)\n" in out
    # The same through @ak.distributed: the error reaches the caller.
    code = "import accelkit as ak, os; ak.launch(os.getpid, num_processes=2, num_nodes=2, node_rank=1, "
    code += f"master_addr='{main.addr}', master_port={PORT}, cpu=True)"
    proc = other.start([sys.executable, "-c", code], subprocess_env(GLOO_SOCKET_IFNAME="lo"))
    [(status, err)] = _finish([proc], timeout=60)
    assert status == 1 and "ConfigurationError: GLOO_SOCKET_IFNAME='lo'" in err and table in err, err[-3000:]


def _kill_node_after_a_checkpoint(node: subprocess.Popen[str], ckpt: Path, timeout: float = 180) -> None:
    """SIGKILL every process of a node (its launcher's session) once a checkpoint was committed."""
    deadline = time.monotonic() + timeout
    while ak.latest_checkpoint(ckpt) is None:
        assert node.poll() is None and time.monotonic() < deadline, "the job never saved a checkpoint"
        time.sleep(0.1)
    os.killpg(node.pid, signal.SIGKILL)
    node.communicate()


@needs_namespaces
def test_a_lost_node_is_named_by_the_others_within_the_collective_timeout(
    hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    main, other = hosts
    ckpt = tmp_path / "ckpt"
    nodes = [h.start(_node(k, main, "static", "steps=20", "pause=1", f"ckpt={ckpt}"), _env(tmp_path, "static"))
             for k, h in enumerate(hosts)]  # fmt: skip
    _kill_node_after_a_checkpoint(nodes[1], ckpt)
    started = time.monotonic()
    [(code, err)] = _finish(nodes[:1], timeout=120)
    assert time.monotonic() - started < 60, "node 0 waited longer than the collective timeout"
    assert code == 1, err[-3000:]
    lost = f"accelkit: node 1 (ranks 2-3, host {socket.gethostname()} at {other.addr}) was lost: its launcher stopped"
    assert lost in err, err[-3000:]
    failed = re.search(r"rank [01] failed", err)  # either of node 0's ranks may have noticed first
    assert failed is not None, err[-3000:]
    assert err.index(lost) < failed.start() < err.index("Failures, root cause first"), err[-3000:]


@needs_namespaces
def test_a_node_started_again_resumes_the_job_bit_for_bit(
    hosts: tuple[Host, Host], one_host_params: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    main, other = hosts
    ckpt = tmp_path / "ckpt"
    env = _env(tmp_path, "c10d")
    argv = [_node(k, main, "c10d", "pause=1", f"ckpt={ckpt}", flags=("--max-restarts", "1")) for k in (0, 1)]
    nodes = [h.start(a, env) for h, a in zip(hosts, argv, strict=True)]
    _kill_node_after_a_checkpoint(nodes[1], ckpt)
    killed_at = int(str(ak.latest_checkpoint(ckpt)).rsplit("-", 1)[1])
    again = other.start(argv[1], env)
    results = _finish([nodes[0], again])
    for k, (code, err) in enumerate(results):
        assert code == 0, f"node {k}:\n{err[-4000:]}"
    assert killed_at < 6, "the job ended before node 1 was killed"
    assert f"resumed from step-{killed_at:03d} at step {killed_at}" in outs[nodes[0].pid], outs[nodes[0].pid]
    _assert_same(dict(torch.load(tmp_path / "params.pt")), one_host_params)


# --- the interface choice, on this machine's own interfaces (no namespaces) ---------------------


def test_the_route_to_loopback_is_lo_and_fills_both_variables() -> None:
    route = route_to("127.0.0.1", 29500)
    assert (route.ifname, route.local_addr, route.own, route.loopback) == ("lo", "127.0.0.1", True, True)
    assert socket_ifname_env(route, {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env(route, {"GLOO_SOCKET_IFNAME": "lo"}) == {"NCCL_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env(route, {"NCCL_SOCKET_IFNAME": "^docker,lo"}) == {"GLOO_SOCKET_IFNAME": "lo"}


def test_a_users_interface_that_cannot_carry_the_job_is_refused() -> None:
    remote = Route("10.77.0.1", "lo", "127.0.0.1", own=False)  # as a node elsewhere would see it
    with pytest.raises(ak.ConfigurationError, match=r"GLOO_SOCKET_IFNAME='lo': 'lo' cannot carry this job: it is the"):
        socket_ifname_env(remote, {"GLOO_SOCKET_IFNAME": "lo"})
    with pytest.raises(ak.ConfigurationError, match=r"'eth9' cannot carry this job: this machine has no such interf"):
        socket_ifname_env(route_to("127.0.0.1"), {"GLOO_SOCKET_IFNAME": "lo,eth9"})
    with pytest.raises(ak.ConfigurationError, match=r"This machine has lo \(127\.0\.0\.1"):
        socket_ifname_env(route_to("127.0.0.1"), {"NCCL_SOCKET_IFNAME": "=l"})  # "=": the exact name
    assert socket_ifname_env(route_to("127.0.0.1"), {"NCCL_SOCKET_IFNAME": "l"}) == {"GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.slow
def test_a_node_whose_beat_stopped_is_named_with_its_ranks_and_host() -> None:
    import torch.distributed as dist

    from accelkit._launcher._nodes import NodeBeat, lost_nodes
    from accelkit.testing import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    beats = [NodeBeat("127.0.0.1", port, "job", k, 3, 3, "127.0.0.1") for k in range(3)]
    beats[1].set_group_rank(2)  # c10d may place node 2 before node 1
    beats[2].set_group_rank(1)
    for beat in beats:
        beat.start()
    try:
        time.sleep(1.5)
        assert lost_nodes("127.0.0.1", port, "job", 3, 0) == ""
        beats[1].stop()
        host = socket.gethostname()
        assert lost_nodes("127.0.0.1", port, "job", 3, 0).startswith(
            f"node 1 (ranks 6-8, host {host} at 127.0.0.1) was lost: its launcher stopped answering"
        )
    finally:
        for beat in beats:
            beat.stop()
    del store
    # Node 0 held the store: without it, the others name node 0.
    assert lost_nodes("127.0.0.1", port, "job", 3, 2).startswith("node 0, which holds the rendezvous store at")
