"""The cluster secret at the HTTP edge: sign outgoing requests, check incoming ones before their body is read.

`mosaic_proto.auth` holds the rules; this module reads the secret file, keeps the keys (one to register,
one per run after that), and adapts the checks to aiohttp: a middleware answers 401 with the reason to a
request without a valid tag, before its handler runs and before its body is parsed, and counts it. The body
is hashed while it is read (`body.read_body`), and the handler gets those bytes without another copy.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from mosaic_proto import NodeRefused
from mosaic_proto.auth import (
    REASONS,
    AuthError,
    Credentials,
    ReplayGuard,
    SignedHeaders,
    check_digest,
    run_key,
    verify,
)
from mosaic_proto.frames import STREAM_PATH
from mosaicd.daemon.http.body import body_digest_of, read_body, release_body
from mosaicd.daemon.http.errors import Handler, json_error
from mosaicd.logs import get_logger

REGISTER_RUN = "register"  # the key for registrations, before a node knows the run
SENDER = web.RequestKey("mosaic_sender", int)  # the member a request's valid tag proves sent it
OPEN = frozenset({"/healthz", "/metrics", "/v1/status", "/v1/history", "/", "/openapi.json"})  # read-only views
_OPEN_TAILS = tuple(OPEN - {"/"})  # the same views under a prefix (a node's embedded /barrier)
_READS = frozenset({"GET", "HEAD"})  # how the open views may be read (HEAD: GET's head, without the body)


class SecretError(ValueError):
    """The secret file cannot be used; the message names --secret-file."""


def make_secret_hint(path: Path | str = "secret") -> str:
    """The command that makes a secret file (docs/security.md's), for the errors that ask for one."""
    return f"make one with `head -c 32 /dev/urandom | base64 > {path}`"


def load_secret(path: Path | None) -> bytes | None:
    """The secret's bytes (surrounding whitespace dropped), or None without --secret-file: the one reader of a
    secret file (`Secret.of`, and `mosaicd cluster`'s for the user's file)."""
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        missing = f"; {make_secret_hint(path)}" if isinstance(exc, FileNotFoundError) else ""
        raise SecretError(f"--secret-file {path}: {exc.strerror}{missing}") from None
    if len(secret) < 16:
        raise SecretError(f"--secret-file {path}: a secret of at least 16 bytes is needed ({make_secret_hint(path)})")
    return secret


class Secret:
    """The run's secret as one value: resolved once where a role starts (`mosaicd node`, `barrier`, `cluster`, a
    `mosaicd.Peer` or `mosaicd.Barrier` of a program) and handed down to all that signs or checks requests; none
    (`value` None) under --insecure. Its repr never shows the bytes."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | None) -> None:
        self.value = value

    @classmethod
    def of(cls, options: Any) -> Secret:
        """--secret-file's secret (read here, once), or none."""
        return cls(load_secret(options.secret_file))

    @classmethod
    def new(cls) -> Secret:
        """A fresh random secret, in memory only: a `mosaicd.Barrier` given no --secret-file (nor --insecure), whose
        program hands it to its `mosaicd.Peer`s (`secret=barrier.secret`)."""
        return cls(secrets.token_urlsafe(32).encode())

    def keyring(self) -> Keyring | None:
        return Keyring(self.value) if self.value else None

    def __bool__(self) -> bool:
        return bool(self.value)

    def __repr__(self) -> str:
        return "Secret(...)" if self.value else "Secret(None)"


def write_new_secret(path: Path, secret: bytes | None = None) -> Path:
    """`secret` (default a fresh random one) in a new file only its owner can read (mode 600; an existing file is an
    error, never overwritten). The one way a secret file is made: the barrier's own (`own_secret_file`), a
    cluster's per run, a Slurm sweep's per cluster run."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write((secret or secrets.token_urlsafe(32).encode()) + b"\n")
    return path


def own_secret_file(out: Path) -> tuple[Path, bool]:
    """`mosaicd barrier` without --secret-file: its own secret, OUT.secret beside --out (mode 600, outside the
    results folder, which is served and copied), made once and reused by a barrier started again with the same
    --out. The path, and whether it was made now."""
    path = Path(out).absolute()
    path = path.parent / (path.name + ".secret")
    if path.exists():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_new_secret(path), True


class Keyring:
    """The keys derived from one secret: registration, and the run's once it is known."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._keys: dict[str, bytes] = {}
        self._credentials: dict[str, Credentials] = {}  # one per run: asked for at every request a member signs

    def key(self, run_id: str) -> bytes:
        if run_id not in self._keys:
            self._keys[run_id] = run_key(self.secret, run_id)
        return self._keys[run_id]

    def credentials(self, run_id: str) -> Credentials:
        if (known := self._credentials.get(run_id)) is None:
            known = self._credentials[run_id] = Credentials(self.key(run_id), run_id)
        return known


def signer(credentials: Callable[[], Credentials], sender: Callable[[], str]) -> Callable[..., dict[str, str]]:
    """`Client`'s signer: the headers of one attempt (a fresh time and nonce each time; `digest`, the body's,
    computed once per request by the client, off the event loop when the body is large)."""
    def sign(method: str, url: str, body: bytes, round: int, digest: str | None = None) -> dict[str, str]:
        return credentials().headers(method, _path(url), sender(), round, body, time.time(), os.urandom(12).hex(),
                                     digest)
    return sign


@functools.lru_cache(maxsize=1024)
def _path(url: str) -> str:
    """The path a request to `url` signs (parsed once per URL: a node posts to the same few every round)."""
    return urlsplit(url).path or "/"


def auth_window(options: Any) -> float:
    """How far a request's signed time may be from this host's clock: a retry must still pass."""
    return max(60.0, 2 * options.request_timeout)


def check_listen(options: Any, keyring: Keyring | None, barrier: bool = False) -> None:
    """Refuse to listen beyond loopback without a secret, unless the user says --insecure; a node (a peer-list
    member, a `mosaicd.Peer`) without one is refused on loopback too. Without a secret (--insecure), a barrier (or a
    --peer-list node, whose rank 0 hosts one) says once, in a warning, what that allows."""
    host = options.host
    loopback = host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")
    if not loopback and keyring is None and not options.insecure:
        raise SecretError(f"--host {host}: listening beyond loopback needs --secret-file (MOSAIC_SECRET_FILE), so "
                          f"that only members can join and send models ({make_secret_hint()}); --insecure listens "
                          "without one")
    if keyring is None and not options.insecure and not barrier:  # loopback is not private on a shared machine
        raise SecretError(f"--host {host}: a node needs --secret-file (MOSAIC_SECRET_FILE; the barrier's, e.g. the "
                          "OUT.secret that `mosaicd barrier` made and printed; in a program, "
                          "mosaicd.Peer(..., secret=barrier.secret) of its mosaicd.Barrier; for a peer list, "
                          f"{make_secret_hint()} and give every member the same file) even on loopback, where "
                          "any local user could join and send models; --insecure runs without one")
    if keyring is None and (barrier or getattr(options, "peer_list", None) is not None):
        get_logger(role="barrier" if barrier else "node").warning(
            "no_secret", host=host, detail="no cluster secret: any process on this host can register, arrive and "
            "send fragments for this run; give --secret-file (MOSAIC_SECRET_FILE), as `mosaicd cluster` does")


class Refusal(Exception):
    """A request the cluster secret's check refuses: its status, reason and detail (the JSON error's)."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"{status} {reason}: {detail}")
        self.status, self.reason, self.detail = status, reason, detail


class Authenticator:
    """The cluster secret's check of one request by its method, path and headers, against one replay guard: a
    request's (`auth_middleware`) or a fragments frame's (`http/stream.py`), so that a nonce taken by one is
    refused to the other. `run_of(request)` says which run's key applies (None: the app is not ready to tell, 503;
    it may raise `NodeRefused` to answer at once why not, 503 where the sender may try again, else 409);
    `on_refused(reason, request)` hears of each request refused."""

    def __init__(self, keyring: Keyring, run_of: Callable[[web.Request], Awaitable[str | None]], window: float,
                 registry: CollectorRegistry, on_refused: Callable[[str, web.Request], None] | None = None) -> None:
        self.keyring, self.run_of, self.on_refused = keyring, run_of, on_refused
        self.guard = ReplayGuard(window)
        self.refused = Counter("mosaic_auth_refused", "requests refused for want of a valid tag", ["reason"],
                               registry=registry)
        for reason in REASONS:  # every series from the start, as the refused messages'
            self.refused.labels(reason)

    async def check(self, request: web.Request, method: str, path: str,
                    headers: Mapping[str, str]) -> SignedHeaders:
        """The signed fields of a request with these headers, checked but for its body (`check_digest`, once it
        is read); `Refusal` if it is refused."""
        try:
            signed, tag = SignedHeaders.from_headers(headers)  # unsigned: refused before the run is known
            try:
                run_id = await self.run_of(request)
            except NodeRefused as exc:
                raise Refusal(503 if exc.retry else 409, exc.reason, exc.detail) from None
            if run_id is None:
                raise Refusal(503, "not_ready", "this peer does not know its run yet")
            return verify(self.keyring.key(run_id), method, path, signed, tag, run_id, self.guard, time.time())
        except AuthError as exc:
            raise self.refusal(exc, request) from None

    def refusal(self, exc: AuthError, request: web.Request) -> Refusal:
        """`exc` counted and told, as the 401 it is answered with."""
        self.refused.labels(exc.reason).inc()
        if self.on_refused is not None:
            self.on_refused(exc.reason, request)
        return Refusal(401, exc.reason, exc.detail)


AUTHENTICATOR = web.AppKey("mosaic_authenticator", Authenticator)  # a member app's, where it has a secret


def auth_middleware(authenticator: Authenticator) -> Any:
    """Check every request but the read-only views (GET or HEAD), those the router answers itself (a path or a
    method the app does not have: 404, 405, as without a secret) and the upgrade to a fragments stream (each of
    its frames is checked as the POST it stands for: `http/stream.py`), before its handler runs and its body is
    read whole; the body is hashed as it is read and checked against its signed digest."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if request.match_info.http_exception is not None:  # no such path (404) or method (405): the router's answer
            return await handler(request)
        if request.method in _READS and (path in OPEN or path.startswith("/dashboard/")
                                         or path.endswith(_OPEN_TAILS)):
            return await handler(request)
        if request.method == "GET" and path == STREAM_PATH:
            return await handler(request)
        try:
            signed = await authenticator.check(request, request.method, path, request.headers)
            if request.body_exists:  # hashed while it is read, once; the handler gets the same bytes
                await read_body(request, digest=True)
                try:
                    check_digest(signed, body_digest_of(request))
                except AuthError as exc:
                    raise authenticator.refusal(exc, request) from None
        except Refusal as exc:
            return json_error(exc.status, exc.reason, exc.detail)
        request[SENDER] = signed.sender
        try:
            return await handler(request)
        finally:
            release_body(request)

    return middleware
