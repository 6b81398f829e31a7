"""An asynchronous node daemon (`mosaicd cluster --sync async`): `AsyncNodeState` driven for real, on loopback.

The state is the one `simulate --sync async` runs (`mosaic_proto.async_node`); this module only feeds it. Three
things run at once on the event loop, none waiting for another node:

- the training loop: H local steps of `state.start` in a worker thread (as slow as --node-profile's slowdown
  says), then `state.trained(...)`, which aggregates the inbox and queues the step's sends; then the next at once;
- the sender: the node's link, as the simulator's: the oldest queued message goes (`state.next_send`), one at a
  time, paced by the profile's bandwidth and latency (`outbound.Link`), signed with the run's key, its step in the
  header's round; a message not taken (a peer down or finished) is dropped, never retried (a newer one follows);
- POST /v1/fragments: decoded (`wire.decode`) and fed to `state.receive` with the sender the signature proved;
  POST /v1/pair (--exchange pairwise, AD-PSGD): a peer's whole model, averaged at once (`state.paired`) and the
  average answered, which the asking node keeps too (`state.averaged`);
- GET /v1/status: the state's `AsyncNodeStatus` (steps, inbox and queue depths, staleness), what this module
  counted, and every member's address; GET / the dashboard, which reads every member's status.

Replays: the signature's nonce is taken once within its time window (`http.auth`), and beyond it a sender's message
whose step is not newer than the newest taken from it is refused (409 `replayed_step`): a sender's messages to one
receiver leave in step order, so an honest one never is.

The roster comes from the launcher (`experiments/cluster_async.py`): every member's address, in rank order (the
start's barrier: each node waits, up to --register-deadline, for the others to answer /healthz). When its
--rounds iterations are done and its queue is sent, the node writes `async.json` (its steps, its training's start
and end, what it counted) and its model `model.npy` in its --out, and serves until it is stopped (at most
--linger-async seconds, `LINGER_S`): the launcher ends the run once every node has reported.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from mosaic_proto import CONTENT_TYPE, WireError
from mosaic_proto.async_node import AsyncOutcome, Exchange, SyncMode
from mosaic_proto.compression import Compression
from mosaic_proto.profiles import DEFAULT_COMPUTE_S
from mosaic_proto.wire import decode, encode_parts, max_message_bytes
from mosaicd.daemon.http.auth import SENDER, Secret, signer
from mosaicd.daemon.http.client import Client, HttpError, Refused
from mosaicd.daemon.http.endpoints import member_app
from mosaicd.daemon.http.limits import Limits
from mosaicd.daemon.http.pages import dashboard_routes
from mosaicd.daemon.loop import sleep_at_least
from mosaicd.daemon.node.metrics import NodeMetrics
from mosaicd.daemon.node.outbound import Link
from mosaicd.daemon.node.routes import node_document, read_body
from mosaicd.files import replacing, write_whole
from mosaicd.logs import get_logger
from mosaicd.outputs import clean_json
from mosaicd.protocol import async_node_state, profile_spec
from mosaicd.settings import Settings

ROSTER_ENV = "MOSAICD_ASYNC_ROSTER"  # the launcher's roster file: {"addresses": [...]} in rank order
REPORT = "async.json"
MODEL = "model.npy"
GRID = "grid.npz"  # the node's models on the time grid: steps done and model at each point
PAIR_STEP, PAIR_SENDER = "X-Mosaic-Pair-Step", "X-Mosaic-Pair-Sender"  # a pair's step (also the signed round)
LINGER_S = 600.0  # a finished node serves this long at most, waiting to be stopped


class AsyncNode:
    """One node's asynchronous run: its state, its training loop, its link, its fragments route."""

    def __init__(self, settings: Settings, task: Any, rank: int, addresses: list[str], secret: Secret) -> None:
        self.settings, self.task, self.rank, self.addresses = settings, task, rank, addresses
        self.run = settings.run_config()
        self.options = settings.daemon_options()
        self.state = async_node_state(self.run, task, rank, planned_only=True)
        self.compression = Compression.parse(self.run.compress)
        self.max_bytes = max_message_bytes(self.state.fragmentation, self.compression)
        spec = profile_spec(self.run)
        self.compute_s = spec.compute_s if spec is not None else 0.0
        self.profile = spec.of(rank, self.run.seed, self.run.nodes) if spec is not None else None
        self.keyring = secret.keyring()
        self.log = get_logger(role="node", run=self.run.run_id, node=rank)
        self.metrics = NodeMetrics()
        self._newest: dict[int, int] = {}  # sender -> the newest step taken from it
        self._queued = asyncio.Event()
        # the time grid: every --eval-every x compute_s seconds of training, the model then (none: --eval-every 0)
        self.eval_period_s = settings.eval_every * (spec.compute_s if spec is not None else DEFAULT_COMPUTE_S)
        self.grid: list[tuple[int, np.ndarray]] = []  # (steps done, model) at each point of the grid
        self.sent = self.unsent = self.replays = 0
        self.sent_bytes, self.link_s = 0, 0.0  # what the taken messages counted (nbytes), the link's busy seconds
        self.started_at = self.finished_at = math.nan

    # -- what comes in ---------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        async def fragments(request: web.Request) -> web.Response:
            if request.content_type != CONTENT_TYPE:
                return web.json_response({"reason": "unsupported_media_type", "detail": f"expected {CONTENT_TYPE}, "
                                          f"got {request.content_type}"}, status=415)
            body = await read_body(request, self.max_bytes)
            answer, status = self.receive(body, request.get(SENDER))
            return web.json_response(answer, status=status)

        async def pair(request: web.Request) -> web.Response:
            body = await read_body(request, 4 * self.state.vector.size)
            said = request.headers.get(PAIR_SENDER, "")  # who it is, where no signature proves it (--insecure)
            proved = request.get(SENDER, int(said) if self.keyring is None and said.isdigit() else None)
            answer, status = self.pair(body, request.headers.get(PAIR_STEP, ""), proved)
            if isinstance(answer, bytes):
                return web.Response(body=answer, content_type="application/octet-stream")
            return web.json_response(answer, status=status)

        async def status(request: web.Request) -> web.Response:  # any origin may read it: the dashboard of a member
            return web.json_response(self.status(), headers={"Access-Control-Allow-Origin": "*"})

        async def run_of(request: web.Request) -> str | None:
            return self.run.run_id
        return member_app([web.post("/v1/fragments", fragments), web.post("/v1/pair", pair),
                           web.get("/v1/status", status), *dashboard_routes()],
                          options=self.options, keyring=self.keyring, run_of=run_of, registry=self.metrics.registry,
                          limits=Limits(self.options, self.metrics.registry), max_body=self.options.max_body_bytes,
                          openapi=node_document(SyncMode.ASYNC))

    def status(self) -> dict[str, Any]:
        """GET /v1/status: the state's `AsyncNodeStatus` and what the daemon counted; `addresses` (rank order) lets
        `mosaicd status` and the dashboard find every member from any one."""
        now = time.monotonic()
        end = self.finished_at if math.isfinite(self.finished_at) else now
        elapsed = end - self.started_at if math.isfinite(self.started_at) else None
        return clean_json({"role": "node", "sync": SyncMode.ASYNC.value, "run_id": self.run.run_id,
                           "exchange": self.run.exchange.value, "address": self.addresses[self.rank],
                           "addresses": self.addresses, **asdict(self.state.status(now)), "sent": self.sent,
                           "unsent": self.unsent, "replays_refused": self.replays, "elapsed_s": elapsed,
                           "steps_per_s": self.state.step / elapsed if elapsed else None,
                           "settings": self.run.model_dump(mode="json")})

    def receive(self, body: bytes, proved: int | str | None) -> tuple[dict[str, Any], int]:
        """One fragment message: (JSON answer, HTTP status)."""
        sender = None if proved is None else int(proved)
        try:
            batch = decode(body, self.state.fragmentation, run_id=self.run.run_id, max_bytes=self.max_bytes,
                           compression=self.compression)
        except WireError as exc:
            return {"reason": str(exc.reason), "detail": str(exc)}, 400
        if batch.round <= self._newest.get(batch.sender, -1) and not self.state.finished:
            self.replays += 1
            return {"reason": "replayed_step", "detail": f"step {batch.round} of node {batch.sender} is not newer "
                    f"than its step {self._newest[batch.sender]} taken already"}, 409
        outcome = self.state.receive(batch, time.monotonic(), sender)
        if outcome is AsyncOutcome.REFUSED:
            return {"reason": "refused", "detail": "not this run's, not from its proved sender, or not planned "
                    "for this node"}, 403
        if outcome in (AsyncOutcome.TAKEN, AsyncOutcome.STALE):
            self._newest[batch.sender] = batch.round
        return {"outcome": outcome.value}, 200

    def pair(self, body: bytes, step: str, proved: int | str | None) -> tuple[dict[str, Any] | bytes, int]:
        """--exchange pairwise: a peer's whole model (float32, little-endian) of its step `step`; this node keeps
        the pair's average and answers it (the peer keeps it too): (the average's bytes or a JSON refusal, status)."""
        sender = -1 if proved is None else int(proved)
        if sender == self.rank or sender not in range(self.run.nodes) or self.run.exchange is not Exchange.PAIRWISE:
            return {"reason": "refused", "detail": "not a pair this node takes (its sender proved by its signature "
                    "is no other member, or the run does not average pairwise)"}, 403
        if len(body) != 4 * self.state.vector.size or not step.isdigit():
            return {"reason": "malformed", "detail": f"expected {self.state.vector.size} float32 values and a "
                    "step"}, 400
        if int(step) <= self._newest.get(sender, -1):
            self.replays += 1
            return {"reason": "replayed_step", "detail": f"step {step} of node {sender} is not newer than its step "
                    f"{self._newest[sender]} taken already"}, 409
        self._newest[sender] = int(step)
        average = self.state.paired(np.frombuffer(body, "<f4"), time.monotonic())
        if average is None:
            return {"reason": "finished", "detail": "this node has done its iterations: the pair does not happen"}, 409
        return average.astype("<f4").tobytes(), 200

    # -- the node's own loop ---------------------------------------------------------------------------------
    async def train(self) -> None:
        """Every iteration, never waiting for another node."""
        state, data_rank = self.state, self.rank % self.run.nodes
        self.started_at = time.monotonic()
        while not state.finished:
            began = time.perf_counter()
            if self.run.train:
                local, loss = await asyncio.to_thread(self.task.train, data_rank, state.step, state.start)
            else:
                local, loss = state.start, math.nan
            if self.profile is not None:  # --node-profile: train as slowly as such a node would
                took = time.perf_counter() - began
                await sleep_at_least(self.profile.train_s(max(self.compute_s, took)) - took)
            iteration = state.trained(local, time.monotonic())
            self.log.debug("iteration", step=iteration.report.round, loss=loss, queue=len(state.queue))
            self._queued.set()
        self.finished_at = time.monotonic()

    async def send(self, client: Client) -> None:
        """The node's link: queued messages leave one at a time, oldest first, until the state is finished and
        its queue is empty."""
        link = Link(self.profile) if self.profile is not None else None
        while True:
            message = self.state.next_send(time.monotonic())
            if message is None:
                if self.state.finished:
                    return
                self._queued.clear()
                await self._queued.wait()
                continue
            took = time.perf_counter()
            if link is not None:
                await link(message.nbytes)
            route = "pair" if message.pair else "fragments"
            url = f"http://{self.addresses[message.peer]}/v1/{route}"
            try:
                if message.pair:  # AD-PSGD: the peer answers the pair's average, which this node keeps too
                    vector = np.asarray(message.batch.fragments[0], "<f4")
                    _, average, _ = await client.request("POST", url, data=vector.tobytes(), round=message.step,
                                                         headers={"Content-Type": "application/octet-stream",
                                                                  PAIR_STEP: str(message.step),
                                                                  PAIR_SENDER: str(self.rank)}, retries=0)
                    self.state.averaged(np.frombuffer(average, "<f4").astype(np.float32), time.monotonic())
                else:
                    await client.request("POST", url, data=tuple(encode_parts(message.batch)), round=message.step,
                                         headers={"Content-Type": CONTENT_TYPE}, retries=0)
                self.sent += 1
                self.sent_bytes += message.nbytes
            except (Refused, HttpError) as exc:
                self.unsent += 1
                self.log.info("send_failed", step=message.step, peer=message.peer, error=str(exc))
            self.link_s += time.perf_counter() - took

    async def snapshots(self) -> None:
        """The model at each point of the time grid (from the training's start), until the node is finished."""
        k = 1
        while self.eval_period_s > 0 and not self.state.finished:
            await sleep_at_least(self.started_at + k * self.eval_period_s - time.monotonic())
            if not self.state.finished:
                self.grid.append((self.state.step, self.state.vector.copy()))
            k += 1

    def save_grid(self, path: Path) -> None:
        models = np.stack([v for _, v in self.grid]) if self.grid else np.zeros((0, self.state.vector.size),
                                                                               np.float32)
        with replacing(path) as f:
            np.savez(f, steps=np.array([n for n, _ in self.grid], np.int64), models=models)

    def report(self) -> dict[str, Any]:
        s = self.state
        elapsed = self.finished_at - self.started_at
        return {"rank": self.rank, "steps": s.step, "elapsed_s": round(elapsed, 6),
                "steps_per_s": round(s.step / elapsed, 6) if elapsed > 0 else None,
                "sent": self.sent, "unsent": self.unsent, "replays_refused": self.replays,
                "sent_bytes": self.sent_bytes, "link_s": round(self.link_s, 6),
                "signed": self.keyring is not None, "eval_period_s": self.eval_period_s,
                "fragments_superseded": s.queue.superseded, "fragments_stale": s.counts["stale"],
                "refused": s.counts["refused"], "ignored": s.counts["ignored"], "averaged": s.counts["averaged"]}


async def wait_for_peers(client: Client, addresses: list[str], rank: int, deadline_s: float) -> None:
    """The start: every other member answers /healthz, within `deadline_s` (TimeoutError naming those that did
    not)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline_s
    waiting = [a for i, a in enumerate(addresses) if i != rank]
    while waiting:
        answers = await asyncio.gather(*(client.request("GET", f"http://{a}/healthz", retries=0, timeout=1.0)
                                         for a in waiting), return_exceptions=True)
        waiting = [a for a, r in zip(waiting, answers, strict=True) if isinstance(r, BaseException)]
        if waiting and loop.time() > until:
            raise TimeoutError(f"members {waiting} did not start within {deadline_s:g} s (--register-deadline)")
        if waiting:
            await asyncio.sleep(0.05)


async def run_async_node(settings: Settings, roster: Path) -> int:
    """Serve, wait for the others, train --rounds iterations, send what is queued, report; serve until stopped."""
    from mosaicd.learning.tasks import build_task

    run = settings.run_config()
    addresses = json.loads(roster.read_text())["addresses"]
    own = settings.advertise or f"{settings.host}:{settings.port}"
    rank = addresses.index(own)
    task = await asyncio.to_thread(build_task, run, settings.data_dir)
    node = AsyncNode(settings, task, rank, addresses, Secret.of(settings.daemon_options()))
    runner = web.AppRunner(node.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    out = Path(settings.out)
    try:
        sign = None if node.keyring is None else signer(lambda: node.keyring.credentials(run.run_id), lambda: str(rank))
        async with Client(settings.request_timeout, 0, signer=sign) as client:
            await wait_for_peers(client, addresses, rank, settings.register_deadline)
            sending = asyncio.ensure_future(node.send(client))
            training = asyncio.ensure_future(node.train())
            await asyncio.sleep(0)  # its start is set: the grid counts from it
            grid = asyncio.ensure_future(node.snapshots())
            await training
            grid.cancel()
            await sending
        out.mkdir(parents=True, exist_ok=True)
        with replacing(out / MODEL) as f:
            np.save(f, node.state.vector)
        node.save_grid(out / GRID)
        write_whole(out / REPORT, json.dumps(node.report()))  # last: the launcher reads the model once it is there
        await asyncio.sleep(LINGER_S)  # the others may still send; the launcher stops this process
    finally:
        await runner.cleanup()
    return 0


def main() -> None:
    from mosaicd.logs import configure_logging

    settings = Settings.load()
    configure_logging(settings.log_level, settings.log_json)
    try:
        code = asyncio.run(run_async_node(settings, Path(os.environ[ROSTER_ENV])))
    except TimeoutError as exc:
        print(f"mosaicd node: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main()
