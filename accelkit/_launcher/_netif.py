"""Which network interface reaches the main process: what gloo and NCCL should bind to.

Left alone, gloo binds to the address this machine's hostname resolves to, and torch's c10d
rendezvous decides from that hostname whether this node hosts the store. On clusters the
hostname often resolves elsewhere (127.0.1.1 from Debian's /etc/hosts, a container's
address, a second NIC): the other nodes cannot connect, and the job waits for the collective
timeout. The kernel knows better: the route to the main process's address names the
interface and the local address to use. Torch-free; Linux (``/proc``, ``ioctl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from .. import _env
from ..errors import ConfigurationError

__all__ = [
    "SOCKET_IFNAME_VARIABLES",
    "Interface",
    "Route",
    "describe_interfaces",
    "interfaces",
    "route_to",
    "socket_ifname_env",
]

SOCKET_IFNAME_VARIABLES = (_env.GLOO_SOCKET_IFNAME, _env.NCCL_SOCKET_IFNAME)
_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


@dataclass(frozen=True)
class Interface:
    """A network interface of this machine: its name, addresses, and whether it is up / loopback."""

    name: str
    addrs: tuple[str, ...]
    up: bool
    loopback: bool

    def describe(self) -> str:
        state = "" if self.up else ", down"
        return f"{self.name} ({', '.join(self.addrs) or 'no address'}{state})"


@dataclass(frozen=True)
class Route:
    """How this machine reaches ``target``: through ``ifname``, from ``local_addr``."""

    target: str  # the address the main process's name resolved to
    ifname: str
    local_addr: str
    own: bool  # target is an address of this machine (node 0 hosts the store)

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.target).is_loopback


def interfaces() -> list[Interface]:
    """This machine's interfaces (in this network namespace), with their IPv4 and IPv6 addresses.

    Example:
        >>> any(i.loopback for i in interfaces())
        True
    """
    v6: dict[str, list[str]] = {}
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            hexaddr, *_, name = line.split()
            v6.setdefault(name, []).append(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            flags = _ioctl(sock, _SIOCGIFFLAGS, name)
            bits = struct.unpack("H", flags[16:18])[0] if flags else 0
            v4 = _ioctl(sock, _SIOCGIFADDR, name)
            addrs = ([socket.inet_ntoa(v4[20:24])] if v4 else []) + v6.get(name, [])
            found.append(Interface(name, tuple(addrs), bool(bits & _IFF_UP), bool(bits & _IFF_LOOPBACK)))
    return found


def route_to(host: str, port: int | None = None) -> Route:
    """The interface and local address this machine reaches ``host`` (a name or an address) through.

    A UDP socket's connect() asks the kernel's routing table and sends nothing. Raises
    :class:`ConfigurationError` naming this machine's interfaces when ``host`` does not resolve
    or no interface reaches it.

    Example:
        >>> route_to("127.0.0.1").ifname
        'lo'
    """
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigurationError(
            f"the main process address {host!r} does not resolve ({exc}); give node 0's IP address, "
            f"one of this machine's: {describe_interfaces()}"
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as gloo prefers
    family, _, _, _, sockaddr = infos[0]
    target = str(sockaddr[0])
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            local = str(sock.getsockname()[0])
    except OSError as exc:
        raise ConfigurationError(
            f"no network interface of this machine reaches the main process at {host!r} ({target}: "
            f"{exc.strerror or exc}). This machine has {describe_interfaces()}; give node 0's address on a "
            f"network they share (--main-process-ip / master_addr)."
        ) from None
    known = interfaces()
    ifname = next((i.name for i in known if local in i.addrs), "")
    if not ifname:
        raise ConfigurationError(
            f"the route to the main process at {target} leaves from {local}, which none of this machine's "
            f"interfaces holds ({describe_interfaces(known)}); set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
            f"to the interface that reaches node 0"
        )
    own = any(target in i.addrs for i in known) or ipaddress.ip_address(target).is_loopback
    return Route(target, ifname, local, own)


def socket_ifname_env(route: Route, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for the workers: those the user left unset.

    A user's setting is kept, but checked: an interface this machine lacks, one without an
    address, or a loopback one for a main process elsewhere would fail only after the collective
    timeout, so it raises :class:`ConfigurationError` naming the interfaces now.

    Example:
        >>> socket_ifname_env(Route("10.0.0.1", "eth0", "10.0.0.2", False), {})
        {'GLOO_SOCKET_IFNAME': 'eth0', 'NCCL_SOCKET_IFNAME': 'eth0'}
    """
    env = os.environ if env is None else env
    chosen = {}
    for name in SOCKET_IFNAME_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            _check_user_setting(name, value, route)
        else:
            chosen[name] = route.ifname
    return chosen


def describe_interfaces(known: list[Interface] | None = None) -> str:
    """``lo (127.0.0.1, ::1), eth0 (10.0.0.2)``: each interface with its addresses."""
    return ", ".join(i.describe() for i in (interfaces() if known is None else known)) or "no interfaces"


def _check_user_setting(variable: str, value: str, route: Route) -> None:
    known = {i.name: i for i in interfaces()}
    remote = not route.loopback
    for entry in value.split(","):
        if variable == _env.NCCL_SOCKET_IFNAME and entry.startswith("^"):
            continue  # NCCL's "all but these"
        exact = variable == _env.GLOO_SOCKET_IFNAME or entry.startswith("=")
        wanted = entry.lstrip("=")
        # NCCL matches names by prefix unless the entry starts with "="; gloo takes exact names.
        matches = [i for n, i in known.items() if n == wanted or (not exact and n.startswith(wanted))]
        usable = [i for i in matches if i.up and i.addrs and not (remote and i.loopback)]
        if usable:
            continue
        if not matches:
            problem = "this machine has no such interface"
        elif remote and all(i.loopback for i in matches):
            problem = f"it is the loopback interface, which cannot reach the main process at {route.target}"
        else:
            problem = f"it is down or has no address ({', '.join(i.describe() for i in matches)})"
        raise ConfigurationError(
            f"{variable}={value!r}: {entry!r} cannot carry this job: {problem}. This machine has "
            f"{describe_interfaces(list(known.values()))}; {route.ifname} ({route.local_addr}) reaches the main "
            f"process at {route.target}. Set {variable}={route.ifname}, or unset it and accelkit chooses."
        )


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    try:
        return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:  # no IPv4 address, or the interface went away
        return b""
