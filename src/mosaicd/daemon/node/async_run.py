"""An asynchronous node daemon (`mosaicd cluster --sync async`, `mosaicd node --peer-list --sync async`):
`AsyncNodeState` driven for real.

The state is the one `simulate --sync async` runs (`mosaic_proto.async_node`); this module only feeds it. Three
things run at once on the event loop, none waiting for another node:

- the training loop: H local steps of `state.start` in a worker thread (as slow as --node-profile's slowdown
  says), then `state.trained(...)`, which queues the step's sends (--async-send) and aggregates the inbox; then
  the next at once;
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

The roster comes from the launcher (`experiments/cluster_async.py`) or the --peer-list file: every member's
address, in rank order (the start's barrier: each node waits, up to --register-deadline, for the others to answer
/healthz). Every --checkpoint-every iterations the node checkpoints (`daemon/node/checkpoint.py`, in a worker
thread); started again with the same state directory, it goes on from its newest checkpoint (`restore`; not
bit-exact). When its --rounds iterations are done, or its --time-budget is spent (seconds from the start's
barrier, on this node's clock: it starts no iteration from then on), and its queue is sent, the node writes its
report (`async_end.write_report`: `async.json`, `model.npy`, `grid.npz`). In `cluster` it then serves until it
is stopped (at most `LINGER_S`): the launcher ends the run once every node has reported. In a peer list, rank 0
fetches every member's report (`collect`), writes the summary and tells them the run ended (`end_run`); the others
serve until then (`await_end`). Rank 0 told to stop records the run interrupted and tells them so at once
(`tell_interrupted`); a member that hears it stops its run where it is (`RunStop`), as if it were told to stop
itself, and exits 130.
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
from mosaic_proto.barrier_rules import ended_status
from mosaic_proto.compression import Compression
from mosaic_proto.profiles import DEFAULT_COMPUTE_S
from mosaic_proto.wire import decode, encode_parts, max_message_bytes
from mosaicd.daemon.async_end import GRID, collect_reports, node_folder, summarize, write_report
from mosaicd.daemon.entry import exit_within, on_signals, told_to_stop
from mosaicd.daemon.http.auth import SENDER, Secret, check_listen, signer
from mosaicd.daemon.http.client import Client, HttpError, Refused
from mosaicd.daemon.http.endpoints import member_app
from mosaicd.daemon.http.limits import Limits
from mosaicd.daemon.http.pages import dashboard_routes
from mosaicd.daemon.http.tls import client_context, scheme, server_context
from mosaicd.daemon.loop import sleep_at_least
from mosaicd.daemon.node import checkpoint
from mosaicd.daemon.node.metrics import NodeMetrics
from mosaicd.daemon.node.outbound import Link
from mosaicd.daemon.node.routes import node_document, read_body
from mosaicd.logs import get_logger
from mosaicd.outputs import MODE_ENV, RunRecorder, clean_json, failure_text, remove_summary
from mosaicd.protocol import async_node_state, profile_spec
from mosaicd.settings import RunConfig, Settings

ROSTER_ENV = "MOSAICD_ASYNC_ROSTER"  # the launcher's roster file: {"addresses": [...]} in rank order
PAIR_STEP, PAIR_SENDER = "X-Mosaic-Pair-Step", "X-Mosaic-Pair-Sender"  # a pair's step (also the signed round)
LINGER_S = 600.0  # a finished node serves this long at most, waiting to be stopped
SILENCE_S, SILENCE_MAX_S = 1.0, 10.0  # how long a peer that gave no answer is not sent to: first, at most


class RunStop:
    """A member's run stopped by its collector: the collector, told to stop, said so (POST /v1/async/end
    {"interrupted": reason}); the run stops at once, as if this process were told to stop (`run_async_node` then
    says so and exits 130)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.task: asyncio.Task | None = None  # the run it cancels (`run_async_node`'s, in a command)

    def cancels(self, task: asyncio.Task) -> None:
        self.task = task

    def told(self, reason: str | None, ended: asyncio.Event) -> dict[str, bool]:
        """The collector said the run `ended` (no `reason`), or was interrupted: the run stops, unless it ended
        already or this node does not run it (`cluster`'s launcher ends those: it only notes it). The answer."""
        if reason is None:
            ended.set()
            return {"ended": True}
        if not ended.is_set() and self.reason is None:
            self.reason = reason
            if self.task is not None and not self.task.done() and not self.task.cancelling():  # not told already
                self.task.cancel()
                exit_within(lambda: 130)  # a worker thread in the middle of a step is not waited for
        return {"interrupted": True}


def interruption_of(body: bytes) -> str | None:
    """POST /v1/async/end's body: none (the run ended), or {"interrupted": reason} (ValueError: anything else)."""
    try:
        told = json.loads(body) if body else {}
    except ValueError:
        told = None
    if told == {}:
        return None
    reason = told.get("interrupted") if isinstance(told, dict) and set(told) == {"interrupted"} else None
    if not (isinstance(reason, str) and ended_status(reason) == "interrupted"):
        raise ValueError('expected no body, or {"interrupted": "interrupted (...)"}')
    return reason


class AsyncNode:
    """One node's asynchronous run: its state, its training loop, its link, its fragments route."""

    def __init__(self, settings: Settings, task: Any, rank: int, addresses: list[str], secret: Secret,
                 barrier_url: str | None = None) -> None:
        """`barrier_url`: the barrier this node registered with (compose), which collects the reports and ends the
        run; none: rank 0 does (a peer list)."""
        self.settings, self.task, self.rank, self.addresses = settings, task, rank, addresses
        self.barrier_url = barrier_url
        self.collector = "0" if barrier_url is None else "barrier"  # the signed sender that fetches and ends
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
        self.result: bytes | None = None  # the report, once written (`save_report`): what rank 0 of a peer list fetches
        self.state_dir = checkpoint.state_dir(self.options)  # its checkpoints (--state-dir; none with --port 0)
        self.resumed_from: int | None = None  # started again: the step it went on from (0: it had no checkpoint)
        self.run_started: float | None = None  # when this member passed the run's start (wall clock), once known
        self._saving: asyncio.Future | None = None  # the checkpoint being written, in a worker thread
        # a peer that gave no answer is not sent to for a while (SILENCE_S, doubling up to SILENCE_MAX_S while it
        # stays silent): a frozen peer would otherwise hold this node's link for --request-timeout at every message
        self._silence: dict[int, float] = {}
        self._silent_until: dict[int, float] = {}
        self.ended = asyncio.Event()  # rank 0 of a peer list said the run's summary is written
        self.stop = RunStop()  # the collector, told to stop, said so: the node's run stops
        self.scheme = scheme(self.options)  # https with --tls-cert: every member speaks TLS

    def url(self, rank: int, path: str) -> str:
        return f"{self.scheme}://{self.addresses[rank]}{path}"

    @property
    def collector_name(self) -> str:
        return "rank 0" if self.barrier_url is None else "the barrier"

    @property
    def collector_url(self) -> str:
        """Where the collector answers /healthz: rank 0, or the barrier."""
        return self.url(0, "") if self.barrier_url is None else self.barrier_url.rstrip("/")

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

        async def result(request: web.Request) -> web.Response:
            """The collector (rank 0 of a peer list, or the barrier) fetches the node's report (POST: signed, only
            it may read its model)."""
            if self.keyring is not None and str(request.get(SENDER)) != self.collector:
                return web.json_response({"reason": "refused", "detail": f"only {self.collector_name} collects "
                                          "reports"}, status=403)
            if self.result is None:
                return web.json_response({"reason": "running", "detail": f"{self.state.step} of "
                                          f"{self.run.rounds} iterations done"}, status=409)
            return web.Response(body=self.result, content_type="application/octet-stream")

        async def end(request: web.Request) -> web.Response:
            """The collector wrote the run's summary, or ({"interrupted": reason}) was told to stop (`RunStop`)."""
            if self.keyring is not None and str(request.get(SENDER)) != self.collector:
                return web.json_response({"reason": "refused", "detail": f"only {self.collector_name} ends the "
                                          "run"}, status=403)
            try:
                reason = interruption_of(await request.read())
            except ValueError as exc:
                return web.json_response({"reason": "malformed", "detail": str(exc)}, status=400)
            return web.json_response(self.stop.told(reason, self.ended))

        async def run_of(request: web.Request) -> str | None:
            return self.run.run_id
        return member_app([web.post("/v1/fragments", fragments), web.post("/v1/pair", pair),
                           web.get("/v1/status", status), web.post("/v1/async/result", result),
                           web.post("/v1/async/end", end), *dashboard_routes()],
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
        self.started_at = time.monotonic()  # the start's barrier is behind
        if self.run.time_budget is not None:  # from the run's start: started again, as its first process passed it
            self.run_started = await asyncio.to_thread(checkpoint.noted_start, self.state_dir, self.run.run_id,
                                                       self.rank, self.addresses[self.rank], self.run_started)
            state.started(self.started_at - max(0.0, time.time() - self.run_started))
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
            every = self.options.checkpoint_every
            if every and not state.finished and state.step % every == 0:
                self.checkpoint()
        self.finished_at = time.monotonic()
        if self._saving is not None:
            await self._saving

    # -- checkpoints: a node started again goes on from its newest ---------------------------------------------
    def restore(self) -> None:
        """Started with the state directory of an earlier process of this run and rank: go on from its newest
        checkpoint (its model, step, optimizer and compressor state). Not bit-exact: what its inbox and queue held
        died with the process, and the others went on meanwhile. Then note this process as the run's member."""
        if self.state_dir is None:
            return
        address, run_id = self.addresses[self.rank], self.run.run_id
        member = self.state_dir / checkpoint.MEMBER
        note = json.loads(member.read_text()) if member.is_file() else {}
        came_back = note.get("run_id") == run_id
        self.run_started = note.get("started") if came_back and note.get("rank") == self.rank else None
        saved = next((c for c in checkpoint.kept(self.state_dir) if c.run_id == run_id and c.rank == self.rank
                      and c.round < self.run.rounds), None)
        if saved is not None:
            self.state.resumed(saved.round, saved.vector)
            if saved.carried and self.state.compressor is not None:
                self.state.compressor.restore(saved.carried)
            if saved.trained:
                self.task.load_node_state(self.rank, saved.trained)
        self.resumed_from = saved.round if saved is not None else 0 if came_back else None
        if self.resumed_from is not None:
            self.log.warning("async_resumed", step=self.resumed_from, detail="started again: it goes on from its "
                             "checkpoint (not bit-exact: what it had received or queued since was lost)")
        checkpoint.note_member(self.state_dir, run_id, self.rank, address, self.run_started)

    def checkpoint(self) -> None:
        """Save the node's model, step, optimizer and compressor state, in a worker thread (training never waits
        for it; a checkpoint still being written when the next is due: the next is skipped)."""
        if self.state_dir is None or (self._saving is not None and not self._saving.done()):
            return
        s = self.state
        point = checkpoint.Checkpoint(self.run.run_id, self.rank, self.addresses[self.rank], s.step, s.vector.copy(),
                                      s.compressor.state() if s.compressor is not None else {},
                                      self.task.node_state(self.rank) if self.run.train else {})

        async def save() -> None:
            try:
                await asyncio.to_thread(checkpoint.save, self.state_dir, point)
            except OSError as exc:  # it only makes a restart go on from an older one
                self.log.warning("checkpoint_unwritten", state_dir=str(self.state_dir), error=str(exc))
        self._saving = asyncio.ensure_future(save())

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
            if time.monotonic() < self._silent_until.get(message.peer, -math.inf):
                self.unsent += 1  # it did not answer lately: dropped unsent, and the link takes the next one
                continue
            took = time.perf_counter()
            if link is not None:
                await link(message.nbytes)
            route = "pair" if message.pair else "fragments"
            url = self.url(message.peer, f"/v1/{route}")
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
                self._silence.pop(message.peer, None)
                self._silent_until.pop(message.peer, None)
            except (Refused, HttpError) as exc:
                self.unsent += 1
                self.log.info("send_failed", step=message.step, peer=message.peer, error=str(exc))
                if exc.status is None:  # no answer at all (down, frozen, unreachable): not tried for a while
                    silence = min(2 * self._silence.get(message.peer, SILENCE_S / 2), SILENCE_MAX_S)
                    self._silence[message.peer] = silence
                    self._silent_until[message.peer] = time.monotonic() + silence
            self.link_s += time.perf_counter() - took

    async def snapshots(self) -> None:
        """The model at each point of the time grid (from the training's start, up to --time-budget's end)."""
        k, budget = 1, self.run.time_budget or math.inf
        while self.eval_period_s > 0 and not self.state.finished and k * self.eval_period_s <= budget + 1e-9:
            await sleep_at_least(self.started_at + k * self.eval_period_s - time.monotonic())
            if not self.state.finished:
                self.grid.append((self.state.step, self.state.vector.copy()))
            k += 1

    def save_report(self, folder: Path) -> None:
        """The node's report (`async_end.write_report`) in `folder`; its grid.npz, which holds it all, is what rank 0
        of a peer list fetches."""
        models = np.stack([v for _, v in self.grid]) if self.grid else np.zeros((0, self.state.vector.size),
                                                                               np.float32)
        steps = np.array([n for n, _ in self.grid], np.int64)
        write_report(folder, self.report(), self.state.vector, steps, models)
        self.result = (folder / GRID).read_bytes()

    def report(self) -> dict[str, Any]:
        s = self.state
        elapsed = self.finished_at - self.started_at
        done = s.step - (self.resumed_from or 0)  # by this process
        return {"rank": self.rank, "steps": s.step, "elapsed_s": round(elapsed, 6), "resumed": self.resumed_from,
                "stopped_by": s.stopped_by, "steps_per_s": round(done / elapsed, 6) if elapsed > 0 else None,
                "sent": self.sent, "unsent": self.unsent, "replays_refused": self.replays,
                "sent_bytes": self.sent_bytes, "link_s": round(self.link_s, 6),
                "signed": self.keyring is not None, "eval_period_s": self.eval_period_s,
                "fragments_superseded": s.queue.superseded, "fragments_stale": s.counts["stale"],
                "refused": s.counts["refused"], "ignored": s.counts["ignored"], "averaged": s.counts["averaged"]}


async def wait_for_peers(client: Client, addresses: list[str], rank: int, deadline_s: float) -> None:
    """The start: every other member (`addresses`: their base URLs) answers /healthz, within `deadline_s`
    (TimeoutError naming those that did not)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline_s
    waiting = [a for i, a in enumerate(addresses) if i != rank]
    while waiting:
        answers = await asyncio.gather(*(client.request("GET", f"{a}/healthz", retries=0, timeout=1.0)
                                         for a in waiting), return_exceptions=True)
        waiting = [a for a, r in zip(waiting, answers, strict=True) if isinstance(r, BaseException)]
        if waiting and loop.time() > until:
            raise TimeoutError(f"members {waiting} did not start within {deadline_s:g} s (--register-deadline)")
        if waiting:
            await asyncio.sleep(0.05)


async def run_async_node(settings: Settings, addresses: list[str], rank: int, folder: Path,
                         peer_list: bool = False, barrier_url: str | None = None) -> int:
    """Serve, wait for the others, train --rounds iterations (or until --time-budget), send what is queued, report
    into `folder`. Then, in `cluster`, serve until the launcher stops the process; in a peer list, rank 0 collects
    the others' reports and writes the summary (`end_run`), and every other member serves until rank 0 says the run
    ended (`await_end`); registered with a barrier (`barrier_url`), every member serves until the barrier, which
    collects, says so."""
    from mosaicd.learning.tasks import build_task

    run = settings.run_config()
    secret = Secret.of(settings.daemon_options())
    check_listen(settings.daemon_options(), secret.keyring())
    task = await asyncio.to_thread(build_task, run, settings.data_dir)
    node = AsyncNode(settings, task, rank, addresses, secret, barrier_url)
    await asyncio.to_thread(node.restore)
    recorder = open_recorder(settings) if peer_list and rank == 0 and barrier_url is None else None
    runner = web.AppRunner(node.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port, ssl_context=server_context(node.options)).start()
    code = 0
    # a command's member told to stop (SIGTERM, as `scancel` and `docker stop` send; Ctrl-C) leaves at once, its run
    # record saying so, and its process ends within `entry.EXIT_WITHIN_S` whatever it still waits for
    task = asyncio.current_task()
    stopped = on_signals(task, 130) if task is not None and (peer_list or barrier_url is not None) else None
    if stopped is not None:  # ... and so when its collector, told to stop, says so
        node.stop.cancels(task)
    sign = None if node.keyring is None else signer(lambda: node.keyring.credentials(run.run_id), lambda: str(rank))
    try:
        async with Client(settings.request_timeout, 0, signer=sign, ssl_context=client_context(node.options)) as client:
            await wait_for_peers(client, [node.url(r, "") for r in range(len(addresses))], rank,
                                 settings.register_deadline)
            sending = asyncio.ensure_future(node.send(client))
            training = asyncio.ensure_future(node.train())
            await asyncio.sleep(0)  # its start is set: the grid counts from it
            grid = asyncio.ensure_future(node.snapshots())
            await training
            grid.cancel()
            await sending
            node.save_report(folder)  # the launcher reads the model once the report is there
            if recorder is not None:
                await end_run(node, client, settings, recorder)
            elif peer_list or barrier_url is not None:
                code = await await_end(node, client, settings)
            else:
                await asyncio.sleep(LINGER_S)  # the others may still send; the launcher stops this process
    except BaseException as exc:
        interrupted = isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)
        if recorder is not None:  # interrupted: the process was told to stop (a signal), a person stopped the run
            reason = (f"interrupted (rank 0 at {addresses[rank]}, which collects the run, was told to stop with "
                      f"{node.state.step} of {run.rounds} iterations done)")
            recorder.fail(reason if interrupted else failure_text(exc))
            if interrupted:  # every member stops too, at once; one that does not hear it keeps waiting for rank 0
                await tell_interrupted(node, sign, [r for r in range(len(addresses)) if r != rank], reason)
        if interrupted and node.stop.reason is not None and not stopped:
            print(f"mosaicd node: {node.stop.reason}; this member (rank {rank}) stopped with {node.state.step} of "
                  f"{run.rounds} iterations done; {how_to_resume(node)}", file=sys.stderr, flush=True)
        elif not (interrupted and stopped):
            raise
        code = 130
    finally:
        await runner.cleanup()
    return told_to_stop(code) if stopped is not None and (stopped or node.stop.reason is not None) else code


TELL_WITHIN_S = 0.5  # the collector told to stop tells its members in parallel, within this: it ends within 1.5 s


async def tell_interrupted(node: AsyncNode, sign: Any, ranks: list[int], reason: str) -> None:
    """The collector (rank 0 of a peer list) told to stop: POST /v1/async/end {"interrupted": reason} to every
    member of `ranks` at once, each given `TELL_WITHIN_S`; one that does not answer is not waited for."""
    async with Client(TELL_WITHIN_S, 0, signer=sign, ssl_context=client_context(node.options)) as client:
        await asyncio.gather(*(client.request("POST", node.url(r, "/v1/async/end"), json_body={"interrupted": reason},
                                              retries=0) for r in ranks), return_exceptions=True)


def how_to_resume(node: AsyncNode) -> str:
    """What a member interrupted with its collector says of going on: from its checkpoints, where it keeps them."""
    if node.state_dir is None or not node.options.checkpoint_every:
        return ("start the same commands again, on every member, to run it again (this member keeps no checkpoint: "
                "--checkpoint-every 0 or --port 0; it starts over)")
    return (f"start the same commands again, on every member, to resume it: each goes on from its newest checkpoint "
            f"(this member's in {node.state_dir}; not bit-exact)")


def open_recorder(settings: Settings) -> RunRecorder:
    """Rank 0 of a peer list's run record in its --out (summary.json says "running" from the first row on)."""
    out = Path(settings.out)
    remove_summary(out)
    return RunRecorder(out, settings, mode=os.environ.get(MODE_ENV, "node"))


async def end_run(node: AsyncNode, client: Client, settings: Settings, recorder: RunRecorder) -> None:
    """Rank 0 of a peer list: every member's report fetched into OUT/nodes/<rank> (`collect`), the summary written
    (`async_end.summarize`), then each member told that the run ended."""
    out = Path(settings.out)
    reports, lost = await collect(node, client, out, settings)
    summary = await asyncio.to_thread(summarize, out, settings, recorder, reports, lost,
                                      addresses=node.addresses)
    node.log.info("async_run_ended", members=sorted(reports), dropped=lost, status=summary.get("status"))
    await asyncio.gather(*(client.request("POST", node.url(r, "/v1/async/end"), retries=1,
                                          timeout=5.0) for r in sorted(reports) if r != node.rank),
                         return_exceptions=True)


async def collect(node: AsyncNode, client: Client, out: Path, settings: Settings,
                  poll_s: float = 0.2) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Rank 0 of a peer list: its own report and every other member's (`async_end.collect_reports`)."""
    others = [r for r in range(len(node.addresses)) if r != node.rank]
    reports, lost = await collect_reports(client, node.url, others, out, settings, node.log, poll_s)
    return {node.rank: node.report(), **reports}, lost


async def await_end(node: AsyncNode, client: Client, settings: Settings, poll_s: float = 1.0) -> int:
    """A member, reported, that does not collect: serve until the collector (rank 0 of a peer list, or the
    barrier) says the run ended (0), or until it has not answered for --register-deadline seconds in a row (1: the
    summary will not come from it)."""
    loop = asyncio.get_running_loop()
    heard = loop.time()
    while not node.ended.is_set():
        try:
            await client.request("GET", f"{node.collector_url}/healthz", retries=0, timeout=2.0)
            heard = loop.time()
        except HttpError:
            if loop.time() - heard > settings.register_deadline:
                print(f"mosaicd node: error: {node.collector_name} ({node.collector_url}) did not answer for "
                      f"{settings.register_deadline:g} s (--register-deadline): no summary will come from it; this "
                      f"node's report is in {node_folder(Path(settings.out), node.rank)}", file=sys.stderr, flush=True)
                return 1
        try:
            await asyncio.wait_for(node.ended.wait(), poll_s)
        except TimeoutError:
            pass
    return 0


async def run_registered_node(settings: Settings, run: RunConfig, addresses: list[str], rank: int, port: int
                              ) -> int:
    """`mosaicd node --barrier-url URL` whose barrier runs --sync async (compose): registered as rank `rank` of
    `addresses` (the barrier's roster) with the barrier's run, this node runs what a peer list's member runs, on
    the same port; its report goes into OUT/nodes/<rank>, and the barrier collects it and ends the run."""
    settings = settings.model_copy(update={**{k: getattr(run, k) for k in RunConfig.model_fields}, "port": port})
    return await run_async_node(settings, addresses, rank, node_folder(Path(settings.out), rank),
                                barrier_url=settings.barrier_url)


async def run_peer_list_node(settings: Settings) -> int:
    """`mosaicd node --peer-list FILE --sync async`: this node is the member the file lists at its address (rank:
    the file's order, as in --sync barrier); its report goes into OUT/nodes/<rank>, and rank 0 writes the run's
    summary into its OUT."""
    from mosaicd.daemon.http.membership import listed_addresses, own_address

    options = settings.daemon_options()
    addresses = listed_addresses(options)
    rank = addresses.index(own_address(options, options.port))
    settings = settings.model_copy(update={"nodes": len(addresses)})
    return await run_async_node(settings, addresses, rank, node_folder(Path(settings.out), rank), peer_list=True)


def main() -> None:
    from mosaicd.logs import configure_logging

    settings = Settings.load()
    configure_logging(settings.log_level, settings.log_json)
    try:
        roster = json.loads(Path(os.environ[ROSTER_ENV]).read_text())["addresses"]
        rank = roster.index(settings.advertise or f"{settings.host}:{settings.port}")
        code = asyncio.run(run_async_node(settings, roster, rank, Path(settings.out)))
    except TimeoutError as exc:
        print(f"mosaicd node: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main()
