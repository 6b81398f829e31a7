"""Ranks from addresses: every host derives the same ranks from the same set of `host:port` addresses."""

from __future__ import annotations

import ipaddress

__all__ = ["MembershipError", "address_key", "parse_address", "rank_addresses"]


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
    """The addresses in rank order (rank = position); a MembershipError if one is listed twice."""
    unique = sorted(set(addresses), key=address_key)
    if len(unique) != len(addresses):
        raise MembershipError("the same address is listed twice")
    return unique
