"""An asynchronous node's member object (`AsyncNode`): its `AsyncNodeState` driven for real, the training loop, the
link, checkpoints and the report; `async_routes.py` is its HTTP face, `async_run.py` runs it (`run_async_node`)."""


from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from mosaic_proto import CONTENT_TYPE, Reason, WireError
from mosaic_proto.async_node import AsyncOutcome, Exchange, SyncMode
from mosaic_proto.compression import Compression
from mosaic_proto.profiles import DEFAULT_COMPUTE_S
from mosaic_proto.wire import decode, encode_parts, max_message_bytes
from mosaicd.daemon.async_end import GRID, write_report
from mosaicd.daemon.entry import exit_within
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.http.client import Client, HttpError, Refused
from mosaicd.daemon.http.tls import scheme
from mosaicd.daemon.loop import sleep_at_least
from mosaicd.daemon.node import checkpoint
from mosaicd.daemon.node.inbox import oversized
from mosaicd.daemon.node.metrics import NodeMetrics
from mosaicd.daemon.node.outbound import Link
from mosaicd.logs import get_logger
from mosaicd.outputs import clean_json
from mosaicd.protocol import async_node_state, profile_spec
from mosaicd.settings import Settings

PAIR_STEP, PAIR_SENDER = "X-Mosaic-Pair-Step", "X-Mosaic-Pair-Sender"  # a pair's step (also the signed round)
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
        self.state = async_node_state(self.run, task, rank, planned_only=True, max_norm=self.options.max_norm)
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

    def receive(self, body: bytes | memoryview, proved: int | str | None) -> tuple[dict[str, Any], int]:
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
        if outcome is AsyncOutcome.OUT_OF_RANGE:
            self.metrics.refused(Reason.OUT_OF_RANGE)
            return {"reason": Reason.OUT_OF_RANGE.value, "detail": f"a fragment's norm is over --max-norm "
                    f"{self.options.max_norm:g} times that of this node's model"}, 400
        if outcome in (AsyncOutcome.TAKEN, AsyncOutcome.STALE):
            self._newest[batch.sender] = batch.round
        return {"outcome": outcome.value}, 200

    def oversized(self, size: int) -> str | None:
        """Why a frame's body of `size` bytes (declared) cannot be a message of this run (413 before it is read), or
        None: as `Inbox.oversized` for a node of the barrier."""
        return oversized(size, self.max_bytes, self.metrics)

    async def received(self, body: memoryview, proved: str | None) -> tuple[int, dict[str, Any]]:
        """`receive` as a fragments stream takes it (`http.stream.Receive`: status first)."""
        answer, status = self.receive(body, proved)
        return status, answer

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
        note = checkpoint.member_note(self.state_dir)
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
                                         headers={"Content-Type": CONTENT_TYPE}, retries=0, stream=True)
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
                "refused": s.counts["refused"], "out_of_range": s.counts["out_of_range"],
                "ignored": s.counts["ignored"], "averaged": s.counts["averaged"]}
