"""Errors as JSON at the HTTP edge: every refusal leaves as {"reason", "detail"} with its status."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"reason": reason, "detail": detail}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON with a machine-readable reason, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        reason = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status, "bad_request")
        resp = json_error(exc.status, reason, exc.text or exc.reason)
        if "Allow" in exc.headers:  # a 405 names the methods the resource has (RFC 9110)
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp


async def read_json(request: web.Request, required: dict[str, type]) -> dict[str, Any]:
    """Parse a JSON object body and check the named fields' types; 4xx JSON errors otherwise."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(
            text=json.dumps({"reason": "unsupported_media_type", "detail": "expected application/json"}),
            content_type="application/json")
    raw = await request.read()  # JSON is UTF-8 (or 16/32, which json.loads detects): a charset parameter is not
    try:                        # looked up (an unknown one would raise LookupError)
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise bad_request("malformed", "body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("malformed", "body must be a JSON object")
    for name, kind in required.items():
        value = body.get(name)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            wanted = "non-negative integer" if kind is int else kind.__name__
            raise bad_request("bad_field", f"field {name!r} must be a {wanted}")
    return body


_ERRORS: dict[int, type[web.HTTPError]] = {
    cls.status_code: cls for cls in vars(web).values()
    if isinstance(cls, type) and issubclass(cls, web.HTTPError) and cls.status_code >= 400}


def bad_request(reason: str, detail: str, status: int = 400) -> web.HTTPException:
    cls = _ERRORS[status]
    return cls(text=json.dumps({"reason": reason, "detail": detail}), content_type="application/json")
