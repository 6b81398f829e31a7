"""What a node asks of the others: its fragments to the sampled peers (within the round's budget), its arrival to
the barrier (a long poll), a live peer's newest model (a node that rejoins)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from mosaic_proto import (
    CONTENT_TYPE,
    BarrierReason,
    Layout,
    NodeReport,
    NodeState,
    OutgoingMessage,
    Reason,
    Release,
    parse_address,
)
from mosaic_proto.barrier_rules import ended_status
from mosaic_proto.node import REASON_FINISHED, REASON_REJOINING
from mosaic_proto.profiles import NodeProfile, TokenBucket
from mosaicd.daemon.deadlines import arrival_timeout
from mosaicd.daemon.errors import PeerDropped, RunEnded, run_ended
from mosaicd.daemon.http.client import Abandoned, Client, HttpError, Refused, digest_on_loop, hash_body
from mosaicd.daemon.http.model_codec import decode_model
from mosaicd.daemon.http.tls import scheme
from mosaicd.daemon.loop import sleep_at_least
from mosaicd.settings import DaemonOptions

# a peer list's run stopped at rank 0: how to go on, said on every member, as `mosaicd cluster` says "--resume"
# (`cluster_resume.next_step`)
SAME_COMMANDS = ("the same commands, started again on every member, resume it from the newest point every member "
                 "holds a checkpoint of")

STARTING_RETRY_S = 0.05  # the first pause before a starting member that answered `rejoining` is tried again (doubling)
REJOINING = frozenset({REASON_REJOINING})  # the refusal a sender decides on itself (`send_all`)
REASON_BUSY = "busy"  # a 503 of `http/limits.py` or the inbox's decoding slots: try again


class Link:
    """--node-profile's link, for real: each send waits the profile's latency, and the bytes of the node's sends go
    through a token bucket at its bandwidth, one after the other, before the request leaves."""

    def __init__(self, profile: NodeProfile) -> None:
        self.latency = profile.latency
        self.bucket = TokenBucket(profile.bandwidth) if profile.bandwidth else None

    async def __call__(self, nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        paced = self.bucket.take(nbytes, loop.time()) if self.bucket is not None else 0.0
        await sleep_at_least(self.latency + paced)


async def send_all(client: Client, round: int, messages: Sequence[OutgoingMessage], urls: list[str], log: Any,
                   budget: float = math.inf, pace: Callable[[int], Awaitable[None]] | None = None,
                   starting: Collection[int] = frozenset(),
                   ) -> tuple[dict[int, tuple[int, int]], list[OutgoingMessage]]:
    """POST every message concurrently, for at most `budget` seconds: (peer -> (fragments, bytes) of those taken,
    the messages not taken). A peer that does not take its fragments is not fatal. A send that takes over a
    quarter of the budget (and a second) is logged with its peer and time. `pace`: awaited with each message's
    size before it is sent (a profile's `Link`). A peer that answers `rejoining` came back and is no member of
    this round: its message is given up at once (one info line), unless it is among the round's `starting`
    members (`NodeState.starting`), which take part once up: those are tried again within the budget."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    digests: dict[int, str | asyncio.Future[str]] = {}  # by body: peers sent the same fragments share its bytes

    async def post(message: OutgoingMessage, url: str) -> None:
        """POST `message`, again while its peer is one of the `starting` that answers `rejoining`, or answers
        `busy` after the client's retries (its bodies' or decodes' budget is taken by other large messages: at a
        50M-value model, one 200 MB message at a time)."""
        digest = None
        if client.signer is not None:  # a small body hashed at once, a large one in a thread, each body once
            if (known := digests.get(id(message.body))) is None:
                parts = message.body.parts
                known = digests[id(message.body)] = digest_on_loop(parts) or asyncio.ensure_future(hash_body(parts))
            digest = known if isinstance(known, str) else await asyncio.shield(known)
        delay = STARTING_RETRY_S
        while True:
            try:
                await client.request("POST", url, data=message.body.parts, round=round,
                                     headers={"Content-Type": CONTENT_TYPE}, digest=digest,
                                     give_up=REJOINING, stream=True)
                return
            except Refused as exc:
                busy = exc.reason == REASON_BUSY  # the receiver takes no more large bodies now: later, it will
                starts = exc.reason == REASON_REJOINING and exc.status == 503 and message.peer in starting
                if not busy and not starts:
                    raise
            if delay == STARTING_RETRY_S:
                log.debug("receiver_busy" if busy else "receiver_starting", round=round, peer=message.peer)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def send(message: OutgoingMessage, url: str) -> bool:
        routine = False  # the peer is down, leaving or starting again: the barrier's round line says so, once
        try:
            if pace is not None:
                await pace(message.nbytes)
            await post(message, url)
            ok = True
        except Refused as exc:
            ok = exc.reason == Reason.DUPLICATE_FRAGMENT  # an earlier attempt got there
            if exc.reason == REASON_REJOINING:  # it came back, and is a member from a later round
                log.info("receiver_rejoining", round=round, peer=message.peer, undelivered="rejoining",
                         fragments=len(message.fragments))
                return False
            routine = exc.reason == REASON_FINISHED
            if not ok:
                (log.info if routine else log.warning)("send_failed", round=round, peer=message.peer,
                                                       status=exc.status, error=exc.detail)
        except HttpError as exc:
            ok, routine = False, exc.closed
            (log.info if routine else log.warning)("send_failed", round=round, peer=message.peer, status=exc.status,
                                                   error=exc.detail)
        took = loop.time() - started
        if took > max(budget / 4, 1.0) and not routine:
            log.warning("slow_send", round=round, peer=message.peer, url=url, seconds=round_(took),
                        bytes=message.nbytes, budget_s=round_(budget), taken=ok)
        return ok

    tasks = [asyncio.ensure_future(send(m, u)) for m, u in zip(messages, urls, strict=True)]
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=budget)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    delivered: dict[int, tuple[int, int]] = {}
    unsent = []
    for message, url, task in zip(messages, urls, tasks, strict=True):
        if not task.cancelled() and task.result():
            delivered[message.peer] = (len(message.fragments), message.nbytes)
            continue
        if task.cancelled():
            log.warning("send_abandoned", round=round, peer=message.peer, url=url, budget_s=round_(budget),
                        detail="the peer did not take its fragments within the round's budget (round_deadline)")
        unsent.append(message)
    return delivered, unsent


def arrival(state: NodeState, report: NodeReport | None) -> dict[str, Any]:
    """The body of an arrival at the barrier: with the layout this node fragments, which every member must share
    (barrier/layouts.py)."""
    f = state.fragmentation
    layout = {"layout": {"values": f.layout.dim, "fingerprint": f.fingerprint.hex()}} if f is not None else {}
    return {"rank": state.rank, "round": state.round, "report": report and report.to_json(), **layout}


async def arrive(client: Client, barrier_url: str, body: dict[str, Any], final: bool, round_deadline: float,
                 options: DaemonOptions, log: Any, peers: list[str] | None = None) -> dict[str, Any]:
    """Long poll at the barrier until the round is released; while the barrier is unreachable (restarting), retry
    for --barrier-grace seconds, unless the barrier and every one of `peers` (host:port) refuse connections: then
    the run is over without this node (one stopped past its end), RunEnded. PeerDropped if the barrier dropped this
    node or it fell too far behind."""
    rank, t = body["rank"], body["round"]
    try:
        return await client.post_json_within(f"{barrier_url}/v1/arrive", body,
                                              timeout=arrival_timeout(round_deadline, options.request_timeout, final),
                                              grace=options.barrier_grace, flag="--barrier-grace", log=log, round=t,
                                              hopeless=None if peers is None else lambda: everyone_gone(
                                                  [address_of(barrier_url), *peers]))
    except Abandoned as exc:
        raise RunEnded(f"the run ended without this node: {exc.detail}{resume_hint(options)}") from None
    except Refused as exc:
        if exc.reason == BarrierReason.DROPPED:
            raise PeerDropped(f"node {rank} was dropped from the run: {exc.detail}") from None
        if exc.reason == BarrierReason.STALE_ROUND:  # it fell behind further than the barrier keeps
            raise PeerDropped(f"node {rank} fell behind the run: {exc.detail}") from None
        if exc.reason in (BarrierReason.RUN_FAILED, BarrierReason.LEFT):  # interrupted: told its reason (`ended_line`)
            raise (run_ended(exc.told) if ended_status(exc.told) == "interrupted" else RunEnded(exc.detail)) from None
        raise
    except HttpError as exc:  # rank 0 of a peer list, which hosts the barrier, is gone: how to go on
        if exc.status is None and options.peer_list is not None:
            raise HttpError(None, f"{exc.detail}{resume_hint(options)}", exc.closed) from None
        raise


def resume_hint(options: DaemonOptions) -> str:
    """What a peer list's member says where rank 0 is gone without a word (stopped at once, or unreachable)."""
    return f"; if rank 0 was stopped, {SAME_COMMANDS}" if options.peer_list is not None else ""


def address_of(url: str) -> str:
    """`host:port` of an http(s) URL (the port its scheme implies where none is given)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


async def everyone_gone(addresses: list[str], timeout: float = 1.0) -> str | None:
    """Why the run must be over, if nothing listens at any of `addresses` any more (every connection refused:
    the processes are gone, not cut off, which would time out); None if any listens or cannot be told."""
    async def refused(address: str) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*parse_address(address)), timeout)
        except ConnectionRefusedError:
            return True
        except (OSError, TimeoutError, ValueError):
            return False
        writer.close()
        return False

    gone = await asyncio.gather(*(refused(a) for a in addresses))
    if all(gone):
        return f"neither the barrier nor any of the {len(addresses) - 1} other members listens any more"
    return None


def read_release(body: dict[str, Any]) -> tuple[Release, dict[int, str], str | None]:
    """The barrier's answer to an arrival: the release, rank -> address of the members it names that join, and why
    the run failed where this release ends it so (else None). The one place that reads a release's extra keys."""
    joined = {int(rank): address for rank, address in (body.get("addresses") or {}).items()}
    return Release.from_json(body), joined, body.get("failure") or None


async def leave(client: Client, barrier_url: str, body: dict[str, Any], timeout: float, log: Any) -> bool:
    """Tell the barrier this node leaves (one quick try: a node that stops does not wait for an absent
    barrier); whether the barrier heard it."""
    reason = body.get("reason", "")
    try:
        await client.post_json(f"{barrier_url}/v1/leave", body, timeout=timeout, retries=1)
    except HttpError as exc:
        log.warning("leave_unheard", error=exc.detail)
        return False
    log.info("left", reason=reason)
    return True


async def live_model(client: Client, options: DaemonOptions, addresses: list[str], peers: list[int],
                     layout: Layout | None, log: Any) -> np.ndarray:
    """The newest model (GET /v1/model) of the first of `peers` that gives one of this `layout`."""
    for rank in peers:
        url = f"{scheme(options)}://{addresses[rank]}/v1/model"
        try:
            _, body, _ = await client.request("GET", url)
            model = decode_model(body)
        except (HttpError, ValueError) as exc:
            log.warning("model_download_failed", peer=rank, error=str(exc))
            continue
        if layout is not None and model["layout"] != layout:
            log.warning("model_download_failed", peer=rank, error="another model layout")
            continue
        log.info("model_downloaded", peer=rank, round=model["round"])
        return model["vector"]
    raise RuntimeError(f"no live peer of {peers} gave its model")


def round_(seconds: float) -> float:
    return round(seconds, 3)
