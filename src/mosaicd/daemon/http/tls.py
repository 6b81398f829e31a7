"""TLS between the members: the server's and the client's `ssl.SSLContext`, and the URL scheme, from --tls-*.

Every member of a TLS cluster both serves (--tls-cert/--tls-key) and connects: its clients verify the servers
against --tls-ca (the cluster's CA; the system's trust store without it) and the host name or IP they dialled,
and present the member's own certificate, so that servers started with --tls-client-auth can require one
signed by --tls-ca (mutual TLS). TLS 1.2 at least; Python's default ciphers.
"""

from __future__ import annotations

import ssl
from functools import lru_cache
from pathlib import Path
from typing import Any


class TlsError(ValueError):
    """A certificate, key or CA file cannot be used; the message names the flag."""


def enabled(options: Any) -> bool:
    """Whether this member speaks TLS (it has a certificate): then every member does."""
    return getattr(options, "tls_cert", None) is not None


def scheme(options: Any) -> str:
    """The scheme of every URL between members: https with TLS, http without."""
    return "https" if enabled(options) else "http"


def server_context(options: Any) -> ssl.SSLContext | None:
    """The listening side's context (None without --tls-cert): its certificate, and with --tls-client-auth
    only clients whose certificate --tls-ca signed get past the handshake."""
    if not enabled(options):
        return None
    return _server(options.tls_cert, options.tls_key, options.tls_ca, bool(options.tls_client_auth))


def client_context(options: Any) -> ssl.SSLContext | None:
    """The connecting side's context (None when this process has no TLS setting): servers verified against
    --tls-ca (else the system's CAs) and the address dialled; its own certificate presented when it has one."""
    cert, key, ca = (getattr(options, name, None) for name in ("tls_cert", "tls_key", "tls_ca"))
    if cert is None and ca is None:
        return None
    return _client(cert, key, ca)


@lru_cache(maxsize=8)
def _server(cert: Path, key: Path, ca: Path | None, client_auth: bool) -> ssl.SSLContext:
    context = _context(ssl.Purpose.CLIENT_AUTH, ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, cert, key)
    if client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@lru_cache(maxsize=8)
def _client(cert: Path | None, key: Path | None, ca: Path | None) -> ssl.SSLContext:
    context = _context(ssl.Purpose.SERVER_AUTH, ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # create_default_context: CERT_REQUIRED, check_hostname
    if cert is not None:
        _load_chain(context, cert, key)
    return context


def _context(purpose: ssl.Purpose, ca: Path | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(purpose, cafile=_file(ca, "--tls-ca") if ca else None)
    except ssl.SSLError as exc:
        raise TlsError(f"--tls-ca {ca}: not a PEM CA certificate bundle ({exc.reason or exc})") from None


def _file(path: Path, flag: str) -> str:
    if not Path(path).is_file():
        raise TlsError(f"{flag} {path}: no such file")
    return str(path)


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path | None) -> None:
    try:
        context.load_cert_chain(_file(cert, "--tls-cert"), _file(key, "--tls-key") if key else None)
    except ssl.SSLError as exc:
        raise TlsError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its private key "
                       f"({exc.reason or exc})") from None
