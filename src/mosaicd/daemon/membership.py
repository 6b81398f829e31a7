"""Who is in the run: a peer-list file, or registration with the barrier (counted by --nodes or by DNS).

Ranks are the positions of the node addresses in sorted order, so every host derives the same ranks
from the same file, and a registration run with the same addresses gets the same ranks.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path


class MembershipError(ValueError):
    pass


def parse_address(text: str, where: str = "address") -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise MembershipError(f"{where}: expected host:port, got {text.strip()!r}")
    return host.strip("[]"), int(port)


def address_key(address: str) -> tuple:
    """Sort key: numeric IPs in numeric order, then names; then port."""
    host, port = parse_address(address)
    try:
        ip = ipaddress.ip_address(host)
        return (0, ip.version, int(ip), "", port)
    except ValueError:
        return (1, 0, 0, host, port)


def rank_addresses(addresses: list[str]) -> list[str]:
    unique = sorted(set(addresses), key=address_key)
    if len(unique) != len(addresses):
        raise MembershipError("the same address is listed twice")
    return unique


def read_peer_list(path: Path) -> list[str]:
    """One host:port per line; '#' comments and blank lines are ignored. Returns addresses in rank order."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise MembershipError(f"--peer-list {path}: {exc.strerror}") from None
    addresses = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            parse_address(line, where=f"--peer-list {path} line {number}")
            addresses.append(line)
    if not addresses:
        raise MembershipError(f"--peer-list {path}: no host:port lines")
    try:
        return rank_addresses(addresses)
    except MembershipError as exc:
        raise MembershipError(f"--peer-list {path}: {exc}") from None


def resolve_all(name: str, port: int = 0) -> list[str]:
    """Every IPv4 address a DNS name answers (Docker's DNS gives one per replica of a scaled service)."""
    try:
        infos = socket.getaddrinfo(name, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos}, key=lambda a: int(ipaddress.ip_address(a)))


@dataclass(frozen=True)
class Roster:
    """The registered members of a run: rank -> address."""

    addresses: tuple[str, ...]

    @property
    def members(self) -> list[int]:
        return list(range(len(self.addresses)))

    def address(self, rank: int) -> str:
        return self.addresses[rank]

    def rank_of(self, address: str) -> int:
        try:
            return self.addresses.index(address)
        except ValueError:
            raise MembershipError(f"{address} is not in the member list") from None
