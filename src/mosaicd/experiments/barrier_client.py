"""The launcher's requests to its barrier, through the one HTTP client of the daemons (`daemon/http/client.py`:
deadlines, TLS; requests signed by `daemon/http/auth.py`): the status it polls while the run goes on, and the
leave of a node whose process ended.

The launcher is not an event loop: each request runs in one of its own (`daemon.loop.run`, the run's
--event-loop), so that any thread may ask (a test or a bench script reads `Cluster.status` beside the run's loop).
"""

from __future__ import annotations

import json
from typing import Any

from mosaicd.daemon.http.auth import Keyring, signer
from mosaicd.daemon.http.client import Client, HttpError
from mosaicd.daemon.http.tls import client_context, scheme
from mosaicd.daemon.loop import run

STATUS_TIMEOUT_S = 2.0  # a status poll; the run's loop polls again 0.2 s later
LEAVE_TIMEOUT_S = 5.0  # telling the barrier that a node left: each of two tries


def barrier_url(settings: Any, port: int) -> str:
    """The barrier's base URL on loopback, as the nodes are given it."""
    return f"{scheme(settings)}://127.0.0.1:{port}"


def status(settings: Any, port: int) -> dict | None:
    """The barrier's /v1/status (an open view, unsigned); None while it does not answer."""
    async def get() -> bytes:
        async with Client(STATUS_TIMEOUT_S, retries=0, ssl_context=client_context(settings)) as client:
            _, body, _ = await client.request("GET", f"{barrier_url(settings, port)}/v1/status")
            return body

    try:
        return json.loads(run(get(), settings.event_loop))
    except (HttpError, OSError, ValueError):
        return None


def tell_left(url: str, settings: Any, secret: bytes | None, rank: int, reason: str) -> str | None:
    """POST /v1/leave for `rank` (signed as that member when the run has a secret); None once the barrier took
    it, else why it did not (its refusal, or the request's failure after two tries)."""
    sign = None
    if secret is not None:
        credentials = Keyring(secret).credentials(settings.run_id)
        sign = signer(lambda: credentials, lambda: str(rank))

    async def post() -> int:
        async with Client(LEAVE_TIMEOUT_S, retries=1, signer=sign, ssl_context=client_context(settings)) as client:
            answer, _, _ = await client.request("POST", f"{url}/v1/leave", json_body={"rank": rank, "reason": reason})
            return answer

    try:
        answer = run(post(), settings.event_loop)
    except HttpError as exc:
        return exc.detail
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if answer == 200 else f"it answered {answer}"
