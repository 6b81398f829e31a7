"""Who is in the run: a peer-list file, or registration with the barrier (counted by --nodes or by DNS).

Ranks are the positions of the node addresses in sorted order, so every host derives the same ranks
from the same file, and a registration run with the same addresses gets the same ranks.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import urlsplit

from mosaic_proto.membership import MembershipError, address_key, parse_address, rank_addresses
from mosaicd.daemon.http.tls import enabled, scheme
from mosaicd.settings import DaemonOptions

__all__ = ["MembershipError", "address_key", "parse_address", "rank_addresses", "read_peer_list",
           "resolve_all", "same_host", "embedded_barrier_url", "own_address", "listed_addresses", "route_ip"]


def read_peer_list(path: Path, tls: bool | None = None) -> list[str]:
    """One host:port per line, or http://host:port or https://host:port; '#' comments and blank lines are
    ignored. Returns the host:port addresses in rank order. `tls`: whether this node speaks TLS; a line whose
    scheme says otherwise is an error (None: not checked)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise MembershipError(f"--peer-list {path}: {exc.strerror}") from None
    addresses = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            where = f"--peer-list {path} line {number}"
            line = _strip_scheme(line, tls, where)
            parse_address(line, where=where)
            addresses.append(line)
    if not addresses:
        raise MembershipError(f"--peer-list {path}: no host:port lines")
    try:
        return rank_addresses(addresses)
    except MembershipError as exc:
        raise MembershipError(f"--peer-list {path}: {exc}") from None


def _strip_scheme(line: str, tls: bool | None, where: str) -> str:
    if "://" not in line:
        return line
    given, _, rest = line.partition("://")
    given = given.lower()
    if given not in ("http", "https") or "/" in rest.rstrip("/"):
        raise MembershipError(f"{where}: expected host:port, http://host:port or https://host:port, got {line!r}")
    if tls is not None and (given == "https") != tls:
        need = ("is https://, but this node has no --tls-cert and --tls-key (every member of a TLS cluster "
                "serves TLS)" if given == "https" else
                "is http://, but this node speaks TLS (--tls-cert): write https://host:port or host:port")
        raise MembershipError(f"{where}: {line!r} {need}")
    return rest.rstrip("/")


def resolve_all(name: str, port: int = 0) -> list[str]:
    """Every IPv4 address a DNS name answers (Docker's DNS gives one per replica of a scaled service)."""
    try:
        infos = socket.getaddrinfo(name, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos}, key=lambda a: int(ipaddress.ip_address(a)))


async def same_host(remote: str, address: str, limit: float = 2.0) -> bool:
    """Whether a request from the IP `remote` comes from the host of the member at `address` (host:port; its host an
    IP or a name, resolved within `limit` seconds). Ports are not compared: a node's requests leave from ephemeral
    ports, never from the one it listens at."""
    import asyncio

    try:
        host = parse_address(address)[0]
        ip = _plain_ip(remote)
    except (MembershipError, ValueError):
        return False
    try:
        return _plain_ip(host) == ip
    except ValueError:  # a name: the addresses it resolves to
        pass
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                       limit)
    except (OSError, TimeoutError):
        return False
    return any(_plain_ip(info[4][0]) == ip for info in infos)


def _plain_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IP as compared: an IPv4-mapped IPv6 address is its IPv4 one (a dual-stack socket's peer)."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def embedded_barrier_url(options: DaemonOptions) -> str:
    """With --peer-list, rank 0 (the first address in sorted order) also serves the barrier under /barrier."""
    assert options.peer_list is not None
    return f"{scheme(options)}://{read_peer_list(options.peer_list, enabled(options))[0]}/barrier"


def is_wildcard(host: str) -> bool:
    """Whether a listening host means every interface (no address a peer could use as it is)."""
    return host in ("0.0.0.0", "::", "")


def own_address(options: DaemonOptions, port: int) -> str:
    """The address peers use to reach this node: --advertise, else the listening host, else (when listening
    on every interface) the local IP of the route towards the barrier."""
    if options.advertise:
        return options.advertise
    host = options.host
    if is_wildcard(host):
        host = route_ip(options.barrier_url or (f"http://{read_peer_list(options.peer_list)[0]}"
                                                 if options.peer_list else None))
    return f"{host}:{port}"


def listed_addresses(options: DaemonOptions) -> list[str]:
    """The --peer-list addresses in rank order; a ValueError naming --peer-list if this node is not among them."""
    assert options.peer_list is not None
    addresses = read_peer_list(options.peer_list, enabled(options))
    me = own_address(options, options.port)
    if me not in addresses:
        raise ValueError(f"--peer-list {options.peer_list}: this node's address {me} is not listed "
                         f"(set --advertise host:port to the line that names this node)")
    return addresses


def route_ip(url: str | None) -> str:
    """The local IP the kernel would use to reach `url`'s host (a UDP connect sends nothing)."""
    target = urlsplit(url).hostname if url else None
    if not target:
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(target), 9))
        return sock.getsockname()[0]
