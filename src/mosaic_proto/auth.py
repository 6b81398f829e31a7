"""Request authentication with a cluster secret, with no I/O: HMAC-SHA256 tags, per-run keys, replay checks.

Every request between members carries, in headers, who sends it (a rank, or an address when registering),
the run, the round, a time, a nonce, the BLAKE3 digest of the body and a tag: HMAC-SHA256 under the run's key
over all of these plus the method and the path. The receiver checks the tag from the headers alone, before
it reads the body, then checks the body against its hash. A tag is good for `window` seconds around its
time, and once: the receiver remembers the nonces of that window.

The run's key is HMAC-SHA256(secret, "mosaic/v1/run/" + run_id): a tag made for one run is worthless in
another. Every member holds the same secret, so the tag proves membership, not which member: a member can
still speak for another (see docs/security.md); TLS client certificates bind a request to one host.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

__all__ = ["AuthError", "Credentials", "ReplayGuard", "SignedHeaders", "body_digest", "body_hasher", "check_digest",
           "run_key", "sign", "verify"]

SCHEME = "Mosaic-HMAC-SHA256"
HEADERS = ("x-mosaic-run", "x-mosaic-sender", "x-mosaic-round", "x-mosaic-time", "x-mosaic-nonce",
           "x-mosaic-body-blake3")
MIN_SECRET_BYTES = 16
REASONS = ("unsigned", "malformed_auth", "stale_tag", "replayed", "wrong_run", "bad_tag", "bad_body")
"""Every `AuthError.reason`: a receiver counts each from the start (a rate or an alert sees the first one)."""


class AuthError(Exception):
    """A request that does not prove membership; `reason` is machine-readable, the state is unchanged."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def run_key(secret: bytes, run_id: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret must hold at least {MIN_SECRET_BYTES} bytes")
    return hmac.new(secret, f"mosaic/v1/run/{run_id}".encode(), hashlib.sha256).digest()


def body_hasher() -> Any:
    """A fresh hasher of the body digest (`update`, `hexdigest`), for a body hashed piece by piece as it arrives.

    BLAKE3, chosen by measurement (one core, 4 MB buffers, bench/README.md): 2.4-4.1 GB/s (a freshly written
    buffer, a hot one), against 1.5-1.6 GB/s for hashlib's SHA-256 with the CPU's SHA extensions and 0.54 GB/s
    for BLAKE2b; every body is hashed by its sender and its receiver, so at d=1e6 SHA-256 was most of what the
    secret cost a round. Like hashlib, it releases the GIL while it hashes a large buffer."""
    return blake3()


def body_digest(body: bytes | bytearray | memoryview) -> str:
    """The hex digest (BLAKE3, 256 bits) a request signs its body with."""
    return blake3(body).hexdigest()


def parts_digest(parts: Iterable[bytes | bytearray | memoryview]) -> str:
    """`body_digest` of a body sent as pieces one after the other (the digest of them joined, without joining)."""
    hasher = blake3()
    for part in parts:
        hasher.update(memoryview(part).cast("B"))
    return hasher.hexdigest()


@dataclass(frozen=True)
class SignedHeaders:
    run: str
    sender: str
    round: int
    time: float
    nonce: str
    body_blake3: str

    def message(self, method: str, path: str) -> bytes:
        return "\n".join([method.upper(), path, self.run, self.sender, str(self.round), f"{self.time:.6f}",
                          self.nonce, self.body_blake3]).encode()

    def to_headers(self, tag: str) -> dict[str, str]:
        return {"X-Mosaic-Run": self.run, "X-Mosaic-Sender": self.sender, "X-Mosaic-Round": str(self.round),
                "X-Mosaic-Time": f"{self.time:.6f}", "X-Mosaic-Nonce": self.nonce,
                "X-Mosaic-Body-BLAKE3": self.body_blake3, "Authorization": f"{SCHEME} {tag}"}

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> tuple[SignedHeaders, str]:
        """The signed fields and the tag; AuthError("unsigned" / "malformed_auth") if they are not all there."""
        fields: dict[str, str] = {}
        for name, value in headers.items():  # names in any case, the first of a name: as HTTP reads them (a
            fields.setdefault(name.lower(), value)  # fragments frame's head is a plain dict)
        auth = fields.get("authorization", "")
        if not auth.startswith(SCHEME + " "):
            raise AuthError("unsigned", f"no '{SCHEME}' Authorization header: this cluster needs its secret")
        missing = [h for h in HEADERS if h not in fields]
        if missing:
            raise AuthError("malformed_auth", f"missing headers: {', '.join(missing)}")
        try:
            signed = cls(fields["x-mosaic-run"], fields["x-mosaic-sender"], int(fields["x-mosaic-round"]),
                         float(fields["x-mosaic-time"]), fields["x-mosaic-nonce"], fields["x-mosaic-body-blake3"])
        except ValueError:
            raise AuthError("malformed_auth", "X-Mosaic-Round and X-Mosaic-Time must be numbers") from None
        if not (8 <= len(signed.nonce) <= 64 and len(signed.body_blake3) == 64):
            raise AuthError("malformed_auth", "nonce of 8-64 characters and a hex BLAKE3 digest of the body expected")
        return signed, auth[len(SCHEME) + 1:].strip()


def sign(key: bytes, method: str, path: str, signed: SignedHeaders) -> dict[str, str]:
    """The headers that authenticate this request."""
    return signed.to_headers(hmac.digest(key, signed.message(method, path), "sha256").hex())


class ReplayGuard:
    """Nonces seen within the window (bounded): a tag is accepted once."""

    def __init__(self, window: float, capacity: int = 200_000) -> None:
        self.window, self.capacity = window, capacity
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, nonce: str, at: float, now: float) -> None:
        if abs(now - at) > self.window:
            raise AuthError("stale_tag", f"the request's time is {now - at:+.1f}s from this host's clock "
                            f"(allowed: {self.window:g}s): replayed, or a clock is off")
        while self._seen and (next(iter(self._seen.values())) < now - 2 * self.window
                              or len(self._seen) >= self.capacity):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AuthError("replayed", "this request was already received (same nonce)")
        self._seen[nonce] = now


def verify(key: bytes, method: str, path: str, signed: SignedHeaders, tag: str, run_id: str, guard: ReplayGuard,
           now: float) -> SignedHeaders:
    """`signed` and `tag` (`SignedHeaders.from_headers`) checked for this request and run (its body is checked
    apart: `check_body`); AuthError if not."""
    if signed.run != run_id:
        raise AuthError("wrong_run", f"signed for run {signed.run!r}, this is run {run_id!r}")
    expected = hmac.digest(key, signed.message(method, path), "sha256").hex()  # one call into OpenSSL
    if not hmac.compare_digest(expected, tag):
        raise AuthError("bad_tag", "the tag does not match: not signed with this cluster's secret")
    guard.check(signed.nonce, signed.time, now)
    return signed


def check_body(signed: SignedHeaders, body: bytes | bytearray | memoryview) -> None:
    check_digest(signed, body_digest(body))


def check_digest(signed: SignedHeaders, digest: str) -> None:
    """The body's hex digest, computed as it was read, against the signed one; AuthError("bad_body") if not."""
    if not hmac.compare_digest(digest, signed.body_blake3):
        raise AuthError("bad_body", "the body does not match its signed BLAKE3 digest")


@dataclass(frozen=True)
class Credentials:
    """What one member signs with: the run's key and its own name (rank, or address while registering)."""

    key: bytes
    run: str

    def headers(self, method: str, path: str, sender: str, round: int, body: bytes, time: float,
                nonce: str, digest: str | None = None) -> dict[str, str]:
        """`digest`: the body's `body_digest`, when the caller has it already (a retry does not hash again)."""
        digest = body_digest(body) if digest is None else digest
        return sign(self.key, method, path, SignedHeaders(self.run, sender, round, time, nonce, digest))
