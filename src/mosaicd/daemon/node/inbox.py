"""`Inbox`: what a node's HTTP API is served from. It feeds incoming fragment messages to the node's `NodeState`
(a message that comes before the node can take it waits up to a request timeout) and reads its models and
status; `Peer` drives the same state from the other side (registration, rounds, leaving).

A message of `OFF_LOOP_BYTES` or more is decoded and validated in a worker thread (`mosaic_proto.round.decoded`:
numpy and memcpy, which release the GIL), at most `DECODES_AT_ONCE` at a time and together at most
--max-body-bytes (one of any size when no other is decoding); its fragments then go to the round open on the
loop (`NodeState.take`). A smaller one is decoded on the loop, where a thread hop costs more than decoding it
(bench/codec.py; bench/README.md, "Figures behind design choices"). `wire.decode` checks a large body's CBOR
heads against what a message of the run holds before it builds anything (`wire.check_structure` applies the same
limits), so no body makes it build more than O(K) objects. A body that declares more bytes than any message of the
run is answered 413 before it is read (`oversized`), and a chunked one, whose size is not declared, as soon as
it passes that (`message_limit`)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from mosaic_proto import FragmentBatch, Layout, NodeRefused, NodeState, Reason, WireError
from mosaic_proto.compression import Compression
from mosaic_proto.round import decoded
from mosaic_proto.wire import max_message_bytes
from mosaicd.daemon.http.auth import Keyring
from mosaicd.daemon.http.body import OFF_LOOP_BYTES
from mosaicd.daemon.http.limits import BodySlots
from mosaicd.daemon.loop import loop_name
from mosaicd.daemon.node.metrics import NodeMetrics
from mosaicd.outputs import clean_json
from mosaicd.settings import DaemonOptions, RunConfig

STATUS_OF_REASON = {Reason.TOO_LARGE: 413, Reason.STALE_ROUND: 409, Reason.FUTURE_ROUND: 409,
                    Reason.DUPLICATE_FRAGMENT: 409, Reason.UNKNOWN_SENDER: 403, Reason.WRONG_RUN: 409,
                    Reason.ROUND_CLOSED: 409, Reason.SENDER_MISMATCH: 403, Reason.UNPLANNED_FRAGMENT: 403}
DECODES_AT_ONCE = 2  # large messages decoded in worker threads at once (the machine's cores serve the rounds too)


def oversized(size: int | None, limit: int | None, metrics: NodeMetrics, *, passed: bool = False) -> str | None:
    """Why a body of `size` bytes (declared; `passed`: read until it passed `size`) cannot be a message of a run
    whose messages are at most `limit` bytes (counted as refused `too_large`), or None (also where either is
    unknown): the one check of a node's routes and streams, of either kind."""
    if size is None or limit is None or (size <= limit and not passed):
        return None
    metrics.refused(Reason.TOO_LARGE)
    return f"{'more than ' if passed else ''}{size} bytes: no message of this run is over {limit} bytes"


class Inbox:
    def __init__(self, state: NodeState, options: DaemonOptions, keyring: Keyring | None) -> None:
        self.state, self.options, self.keyring = state, options, keyring
        self.metrics = NodeMetrics()
        self._run: RunConfig | None = None
        self._layout: Layout | None = None
        self._address = ""
        self._barrier_url = options.barrier_url
        self.registered = asyncio.Event()  # the run (and its key) is known
        self.ready = asyncio.Event()  # the model is known: fragments are taken
        self.decoding = BodySlots(DECODES_AT_ONCE, DECODES_AT_ONCE, options.max_body_bytes)
        self._evaluating: dict[int, asyncio.Event] = {}  # rounds whose metrics the node is computing

    run = property(lambda self: self._run, doc="the run as the barrier handed it out (None before registration)")
    layout = property(lambda self: self._layout, doc="the model's layout, once known (None before)")
    address = property(lambda self: self._address, doc="where this node listens, as its peers reach it")
    barrier_url = property(lambda self: self._barrier_url, doc="the barrier this node registers with")

    def registers_with(self, barrier_url: str | None) -> None:
        """The barrier's URL: --barrier-url, or the one a peer list's rank 0 serves."""
        self._barrier_url = barrier_url

    def listening(self, address: str) -> None:
        """The node's server is up: peers reach it at `address`."""
        self._address = address

    def registered_for(self, run: RunConfig) -> None:
        """The barrier took the registration and handed out `run`: requests signed with its key are taken."""
        self._run = run
        self.registered.set()

    def model_known(self, layout: Layout) -> None:
        """The model's layout is known and the node's state started: fragments are taken."""
        self._layout = layout
        self.ready.set()

    def evaluating(self, round: int) -> None:
        """The node computes its metrics of `round`: the barrier's GET /v1/model of it waits for them."""
        self._evaluating[round] = asyncio.Event()

    def evaluated(self, round: int, metrics: dict[str, Any] | None) -> None:
        """The node's metrics of `round` (None: none after all): kept with its snapshot, served from now on."""
        if metrics is not None:
            self.state.keep_metrics(round, metrics)
        event = self._evaluating.pop(round, None)
        if event is not None:
            event.set()

    async def metrics_of(self, round: int) -> dict[str, Any] | None:
        """The node's metrics of `round`, once computed (waiting up to a request timeout where they are being)."""
        event = self._evaluating.get(round)
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), self.options.request_timeout)
            except TimeoutError:
                pass
        return self.state.metrics_of(round)

    async def run_of(self) -> str | None:
        """The run whose key signs requests to this node, once it knows it (waits up to a request timeout). A node
        that came back refuses at once (`rejoining`) instead: the barrier answers its registration only once the
        round it lost is released, and that round's senders must not wait for it (docs/spec.md, step 7)."""
        if not self.registered.is_set() and self.state.restarting:
            raise self.state.refusal
        if not self.registered.is_set():
            try:
                await asyncio.wait_for(self.registered.wait(), self.options.request_timeout)
            except TimeoutError:
                return None
        return self.run.run_id if self.run else None

    async def receive(self, body: bytes | memoryview, sender: str | None = None) -> tuple[int, dict[str, Any]]:
        """One fragment message: (HTTP status, JSON answer). `sender`: the member the request's signature proved
        (None without a cluster secret)."""
        state = self.state
        if state.waits_for_model and not self.ready.is_set():
            try:  # it registers: the model comes soon
                await asyncio.wait_for(self.ready.wait(), self.options.request_timeout)
            except TimeoutError:
                pass
        proved = None if sender is None else int(sender) if sender.isdigit() else -1
        try:
            if len(body) < OFF_LOOP_BYTES:
                receipt, fragments = state.receive(body, sender=proved)
            else:
                receipt, fragments = state.take(await self._decode(body), len(body), sender=proved)
        except WireError as exc:
            self.metrics.refused(exc.reason)
            return STATUS_OF_REASON.get(exc.reason, 400), exc.to_json()
        except NodeRefused as exc:
            return (503 if exc.retry else 409), {"reason": exc.reason, "detail": exc.detail}
        if receipt.value == "accepted":  # buffered ones are counted when their round's state takes them
            self.metrics.accepted(len(body), fragments)
        return 200, {"status": receipt.value, "round": state.round}

    def message_limit(self) -> int | None:
        """The most bytes a message of this run can be, once the run is known (None before): a body is read only
        up to it (a chunked one, whose size is not declared, is cut there with 413)."""
        fragmentation = self.state.fragmentation
        if fragmentation is None:
            return None
        compressor = self.state.compressor
        return max_message_bytes(fragmentation, compressor.compression if compressor is not None else Compression())

    def oversized(self, size: int | None, *, passed: bool = False) -> str | None:
        """Why a body of `size` bytes (declared; `passed`: read until it passed `size`) cannot be a message of this
        run (answered 413 before it is read whole: nothing more of it is held or decoded), or None."""
        return oversized(size, self.message_limit(), self.metrics, passed=passed)

    async def _decode(self, body: bytes | memoryview) -> FragmentBatch | WireError:
        """`body` decoded in a worker thread once a decoding slot is free, or why it is refused."""
        round_state = self.state.taking()
        if not await self.decoding.admit("decode", len(body), self.options.request_timeout):
            raise NodeRefused("busy", f"{self.decoding.count} large messages are being decoded; try again",
                              retry=True)
        try:
            return await asyncio.to_thread(decoded, round_state, body)
        finally:
            self.decoding.release("decode", len(body))

    def status(self) -> dict[str, Any]:
        """GET /v1/status: this node's phase, round and last round's report."""
        run, state = self.run, self.state
        last = state.last_report
        return {
            "node": state.rank, "rank": state.rank, "address": self.address, "run_id": run.run_id if run else None,
            "round": state.round, "rounds": run.rounds if run else None, "phase": state.phase.value,
            "members": state.members, "fragments": run.fragments if run else None,
            "fanout": run.fanout if run else None, "sampler": run.sampler.value if run else None,
            "dim": self.layout.dim if self.layout else None,
            "loss": state.loss if math.isfinite(state.loss) else None,
            "last_round": clean_json(last.to_json()) if last else None, "barrier_url": self.barrier_url,
            "event_loop": loop_name(),
        }
