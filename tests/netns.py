"""Two machines on one: network namespaces joined by a veth pair, each with its own /etc/hosts.

Each namespace has its loopback and one end of the pair (10.77.0.1 and 10.77.0.2, a /24): the two
reach each other only over the pair, as two hosts on a network do, never through a shared loopback.
``ip netns exec`` bind-mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts`` for what it runs, so
that the machine's hostname can resolve to another address in each namespace. Needs root and
``ip`` (Debian's iproute2); :func:`why_not` says why namespaces cannot be made here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUBNET = "10.77.0"
_made = 0


@dataclass
class Host:
    """One namespace: its name, its address on the pair, the pair's interface in it, what runs there."""

    netns: str
    addr: str
    ifname: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def start(self, argv: Sequence[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` in this namespace, in a session of its own (stopped with the namespace)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *argv],
            env=env,
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **kwargs,  # type: ignore[call-overload]
        )
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
        """Run ``argv`` here to its end; its output (raises on failure)."""
        command = ["ip", "netns", "exec", self.netns, *argv]
        return subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=timeout).stdout

    def stop(self) -> None:
        """SIGKILL every process group started here, and reap them."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=30)
        self.procs.clear()


def why_not() -> str | None:
    """Why two namespaces cannot be made on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need `ip` (Debian: apt-get install iproute2)"
    name = f"akprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@contextlib.contextmanager
def two_hosts(hostname_to: Sequence[str | None] = (None, None)) -> Iterator[tuple[Host, Host]]:
    """Two namespaces on a veth pair; yields them, then stops what runs there and removes them.

    ``hostname_to[k]``: the address this machine's hostname resolves to in namespace ``k``
    (None: its own address on the pair, as on a well-configured cluster).
    """
    global _made
    _made += 1
    tag = f"ak{os.getpid()}x{_made}"
    # Interface names (15 characters at most) are made in their namespaces: no clash with this one's.
    hosts = [Host(f"{tag}h{k}", f"{SUBNET}.{k + 1}", f"akveth{k}") for k in (0, 1)]
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
        a, b = hosts
        _ip("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname, "netns", b.netns)
        for k, host in enumerate(hosts):
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{host.netns}", exist_ok=True)
            resolved = hostname_to[k] or host.addr
            names = "".join(f"{h.addr}\takhost{j}\n" for j, h in enumerate(hosts))  # the peers, by name
            with open(f"/etc/netns/{host.netns}/hosts", "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n{names}{resolved}\t{socket.gethostname()}\n")
        yield a, b
    finally:
        for host in hosts:
            host.stop()
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{host.netns}", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # when no other namespace has a file there
        _wait_gone([h.netns for h in hosts])


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _wait_gone(names: list[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if not any(name in listed for name in names):
            return
        time.sleep(0.1)
