"""The barrier's HTTP API (JSON): input checks and status codes; the decisions live in `Barrier`.

    POST /v1/register {"address", "task"}       -> long poll until every expected node registered:
                                                   {"rank", "members": [addresses], "run": {...}}; a member
                                                   started again says "checkpoints": [rounds] (a peer list's
                                                   run resumed: "resumed": true, at "round"); "task" says
                                                   what it runs ({"own_loop", "name", "values"}): one the
                                                   barrier's task does not fit is refused (422 task_differs)
    POST /v1/arrive {"rank", "round", "report"} -> long poll until the round is released:
                                                   {"round", "members", "stragglers", "dropped", "finished"}
    POST /v1/leave {"rank", "reason"}           -> this member leaves: not waited for, not sampled from the next
                                                   round ({"left", "round", "live"})
    DELETE /v1/register {"address", "reason"}   -> a node told to stop while it waits for the roster withdraws:
                                                   the roster is made without it ({"withdrawn", "registered"});
                                                   once made, it leaves as the member it is (as /v1/leave)
Arriving at round t means: done sending round t (and, for t = rounds, done with the run); the report
describes round t as the node saw it by then (null for the final arrival).

    GET /v1/status                              -> phase, round, members, the newest evaluation, the run
    GET /v1/history?since=R                     -> {"rounds": per released round >= R (durations, phases,
                                                   stragglers), "evaluations": evaluation rows >= R}, each
                                                   list at most the last HISTORY_KEPT entries
    GET /, GET /dashboard/{name}                -> the live dashboard (http/dashboard/index.html polls the two above)
"""

from __future__ import annotations

from bisect import bisect_left
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from mosaic_proto import BarrierError, BarrierReason, NodeReport, ReportError, TaskClaim
from mosaic_proto.barrier_rules import ended_status
from mosaicd.daemon.barrier.layouts import claimed_layout
from mosaicd.daemon.barrier.release_log import HISTORY_KEPT
from mosaicd.daemon.http.auth import REGISTER_RUN, SENDER
from mosaicd.daemon.http.endpoints import member_app
from mosaicd.daemon.http.errors import bad_request, read_json
from mosaicd.daemon.http.limits import Limits
from mosaicd.daemon.http.membership import same_host
from mosaicd.daemon.http.pages import dashboard_routes
from mosaicd.daemon.loop import loop_name
from mosaicd.outputs import clean_json

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier

STATUS_OF_REASON = {BarrierReason.BAD_ADDRESS: 400, BarrierReason.BAD_ROUND: 400, BarrierReason.UNKNOWN_RANK: 404,
                    BarrierReason.DROPPED: 410, BarrierReason.FUTURE_ROUND: 409, BarrierReason.STALE_ROUND: 409,
                    BarrierReason.REGISTRATION_CLOSED: 409, BarrierReason.BARRIER_TIMEOUT: 503,
                    BarrierReason.BARRIER_STOPPING: 503,
                    BarrierReason.JOINING: 409, BarrierReason.RUN_NOT_JOINABLE: 409, BarrierReason.LEFT: 410,
                    BarrierReason.RUN_FAILED: 410, BarrierReason.LAYOUT_CHANGED: 409,
                    BarrierReason.TASK_DIFFERS: 422, BarrierReason.NOT_FROM_MEMBER: 403}


CHECKPOINTS_SAID = 16  # the most checkpoint rounds a registration may name (a node keeps three)

# a registration refused for what the node is or brings (not one told to wait or retry): the barrier says so
REFUSED_REGISTRATIONS = {BarrierReason.BAD_ADDRESS, BarrierReason.REGISTRATION_CLOSED, BarrierReason.RUN_NOT_JOINABLE,
                         "registration_failed", BarrierReason.TASK_DIFFERS}


def source_of(request: web.Request) -> str:
    """Where a request came from, as the barrier names it: the peer's address (its claimed one is not proven)."""
    return request.remote or "?"


def sender_of(request: web.Request) -> str:
    """The host:port a request came from (its TCP peer), as a failure it caused names it."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else source_of(request)


def reason_of(body: dict[str, Any]) -> str:
    """Why a node leaves or withdraws, as it says (400 if not a string of at most 2000 characters)."""
    reason = body.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 2000:
        raise bad_request("bad_field", "field 'reason' must be a string of at most 2000 characters")
    return reason


def checkpoints_of(body: dict[str, Any]) -> list[int] | None:
    """The rounds of the checkpoints a registering member holds (a peer list's member started again), if it says;
    400 unless a list of at most `CHECKPOINTS_SAID` non-negative integers."""
    held = body.get("checkpoints")
    if held is None:
        return None
    if not isinstance(held, list) or len(held) > CHECKPOINTS_SAID or \
            not all(type(r) is int and r >= 0 for r in held):
        raise bad_request("bad_field", f"field 'checkpoints' must be a list of at most {CHECKPOINTS_SAID} "
                          "non-negative integers")
    return held


def task_of(body: dict[str, Any]) -> TaskClaim | None:
    """What a registering node says it runs ("task"); None where it says nothing (a node of an earlier version);
    400 naming the field where it is malformed."""
    if "task" not in body:
        return None
    try:
        return TaskClaim.from_json(body["task"])
    except ValueError as exc:
        raise bad_request("bad_field", str(exc)) from None


def checked_report(report: Any, round: int) -> NodeReport | None:
    """A node's report of round `round`, sent with its arrival; 400 (nothing recorded) if malformed."""
    if report is None:
        return None
    try:
        return NodeReport.from_json(report, round)
    except ReportError as exc:
        raise bad_request("bad_field", str(exc)) from None


def proven(request: web.Request, who: str) -> None:
    """With a cluster secret, a request may speak only for the member its signature names."""
    sender = request.get(SENDER)
    if sender is not None and sender != who:
        raise bad_request("sender_mismatch", f"signed by {sender!r}, but speaks for {who!r}", 403)


async def from_member(request: web.Request, address: str, signed: bool) -> None:
    """Under --insecure (`signed` False: no signature proves who speaks), a request that ends a member's part in the
    run (its leave, its withdrawal) is taken only from the host of that member's `address` (ports are not compared:
    a node's requests leave from ephemeral ports); 403 not_from_member otherwise, naming both. With a secret,
    `proven` checks the signer instead."""
    if signed or (request.remote and await same_host(request.remote, address)):
        return
    raise bad_request(BarrierReason.NOT_FROM_MEMBER, f"under --insecure, only the host of {address} may ask this "
                      f"for it; this request came from {sender_of(request)}", 403)


class BarrierRoutes:
    """The API's handlers: a request's checks and status codes; every decision is the `Barrier`'s."""

    def __init__(self, barrier: Barrier) -> None:
        self.barrier = barrier

    async def register(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"address": str})
        proven(request, body["address"])
        try:
            rank = body.get("rank")  # a member of a resumed run, back at a new address
            if rank is not None and (type(rank) is not int or rank < 0):
                raise bad_request("bad_field", "field 'rank' must be a non-negative integer")
            return web.json_response(await self.barrier.register(body["address"], rank, checkpoints_of(body),
                                                                 task_of(body)))
        except BarrierError as exc:
            status = (self.barrier.registration_status if exc.reason == "registration_failed"
                      else STATUS_OF_REASON[exc.reason])
            if exc.reason in REFUSED_REGISTRATIONS:
                self.barrier.refused(exc.reason, source_of(request), request.path)
            raise bad_request(exc.reason, exc.detail, status) from None

    async def arrive(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"rank": int, "round": int})
        proven(request, str(body["rank"]))
        told = False  # whether this answer says the run failed: only then has the member heard it (`answered`)
        try:
            self.barrier.check(body["rank"], body["round"])
            report = checked_report(body.get("report"), body["round"])
            self.barrier.check_layout(body["rank"], body["round"], claimed_layout(body), sender_of(request))
            answer = await self.barrier.arrive(body["rank"], body["round"], report)
            told = answer.get("failure") is not None
            return web.json_response(answer)
        except BarrierError as exc:
            told = exc.reason == BarrierReason.RUN_FAILED
            raise bad_request(exc.reason, exc.detail, STATUS_OF_REASON.get(exc.reason, 400)) from None
        finally:
            if told:
                self.barrier.answered(body["rank"])

    async def withdraw(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"address": str})
        proven(request, body["address"])
        await from_member(request, body["address"], bool(self.barrier.keyring))
        try:
            return web.json_response(await self.barrier.withdraw(body["address"], reason_of(body)))
        except BarrierError as exc:
            raise bad_request(exc.reason, exc.detail, STATUS_OF_REASON.get(exc.reason, 400)) from None

    async def leave(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"rank": int})
        proven(request, str(body["rank"]))
        reason = reason_of(body)
        for flag in ("ends_run", "stopped"):
            if not isinstance(body.get(flag, False), bool):
                raise bad_request("bad_field", f"field '{flag}' must be a boolean")
        if 0 <= body["rank"] < len(addresses := self.barrier.state.addresses):
            await from_member(request, addresses[body["rank"]], bool(self.barrier.keyring))
        try:
            return web.json_response(await self.barrier.leave(body["rank"], reason, body.get("ends_run", False),
                                                              body.get("stopped", False), sender_of(request)))
        except BarrierError as exc:
            raise bad_request(exc.reason, exc.detail, STATUS_OF_REASON.get(exc.reason, 400)) from None
        finally:
            self.barrier.answered(body["rank"])

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(barrier_status(self.barrier))

    async def history(self, request: web.Request) -> web.Response:
        raw = request.query.get("since", "0")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 12):
            raise bad_request("bad_since", f"since must be a non-negative integer (a round), got {raw!r}")
        return web.json_response(barrier_history(self.barrier, int(raw)))

    async def run_of(self, request: web.Request) -> str:
        """The run a request is signed for: registrations are signed with the registration key."""
        return REGISTER_RUN if request.path.endswith("/v1/register") else self.barrier.run.run_id

    async def on_startup(self, app: web.Application) -> None:
        await self.barrier.start()

    async def on_cleanup(self, app: web.Application) -> None:
        await self.barrier.stop()


def barrier_app(barrier: Barrier) -> web.Application:
    """The barrier's app: its routes, the shared endpoints and limits (`member_app`), and its start and stop."""
    routes = BarrierRoutes(barrier)
    limits = Limits(barrier.options, barrier.metrics.registry, registration=lambda: barrier.run.nodes + 10
                    if barrier.state.phases.registering else 0)  # http/limits.py
    app = member_app([
        web.post("/v1/register", routes.register),
        web.post("/v1/arrive", routes.arrive),
        web.post("/v1/leave", routes.leave),
        web.delete("/v1/register", routes.withdraw),
        web.get("/v1/status", routes.status),
        web.get("/v1/history", routes.history),
        *dashboard_routes(),
    ], options=barrier.options, keyring=barrier.keyring, run_of=routes.run_of, registry=barrier.metrics.registry,
        limits=limits, max_body=1024 * 1024, openapi=Path(__file__).parent / "openapi.json",
        on_refused=lambda reason, request: barrier.refused(reason, source_of(request), request.path))
    app.on_startup.append(routes.on_startup)
    app.on_cleanup.append(routes.on_cleanup)
    return app


def barrier_status(barrier: Barrier) -> dict[str, Any]:
    state, now = barrier.state, barrier.now()
    last = state.released[max(state.released)] if state.released else None
    return {
        "role": "barrier", "run_id": barrier.run.run_id, "phase": status_phase(barrier), "round": state.round,
        "rounds": barrier.run.rounds, "expected": state.expected, "registered": len(state.pending),
        "live": state.live, "dropped": state.dropped, "left": state.left, "failure": barrier.failure,
        "stragglers": list(last.stragglers) if last else [],
        "members": [{"rank": r, "address": m.address, "missed": m.missed, "last_round": m.last_round,
                     "last_contact_s": round(now - m.last_contact, 3)} for r, m in state.members.items()],
        "metrics": clean_json(barrier.evaluator.last_metrics), "latest": latest_per_node(barrier.recorder.rounds),
        "settings": barrier.run.model_dump(mode="json"), "event_loop": loop_name(),
        "refused": barrier.refusals.as_json(),
    }


def status_phase(barrier: Barrier) -> str:
    """The run's phase as /v1/status says it: finished only once its last row and summary.json are written;
    interrupted where a person stopped it (its members, or the rank 0 hosting it, told to stop), as summary.json
    says (`ended_status`)."""
    if barrier.state.phases.failed and ended_status(str(barrier.failure)) == "interrupted":
        return "interrupted"
    return barrier.state.phases.said(barrier.done.is_set()).value


def latest_per_node(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """rank -> that node's metric in the newest evaluation."""
    if not rounds or not rounds[-1].get("per_node"):
        return {}
    return {str(r): v for r, v in zip(rounds[-1].get("nodes") or [], rounds[-1]["per_node"], strict=False)}


def barrier_history(barrier: Barrier, since: int) -> dict[str, Any]:
    """Released rounds and evaluation rows from round `since` on (both lists are in round order), the newest
    HISTORY_KEPT of each. NaN is null (a browser's JSON parser refuses NaN)."""
    def tail(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        start = max(bisect_left(rows, since, key=lambda row: row["round"]), len(rows) - HISTORY_KEPT)
        return rows[start:]

    return clean_json({"rounds": tail(barrier.history), "evaluations": tail(barrier.recorder.rounds)})
