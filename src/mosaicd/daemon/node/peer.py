"""`Peer`: Mosaic gossip for any training loop. The built-in node daemon is one user of it.

    async with Peer(options, model) as peer:             # serve, register: rank, members and the run
        for t in range(peer.run.rounds):
            train(model)
            await peer.gossip(model)                      # send fragments, barrier, aggregate
        await peer.finish()                               # let the barrier collect the final models

`options` says how this process listens and reaches the others (`DaemonOptions`, or a whole `Settings`);
the run itself (K, s, sampler, seed, round deadline, ...) comes from the barrier at registration: `peer.run`.
A peer that registers during a run (it restarted, or joins late) starts at `peer.round` > 0, with
`peer.download_model()` or its own checkpoint.

`Peer` is the node's decision runner, as `DecisionRunner` is the barrier's: `mosaic_proto.NodeState` decides
(phases, rounds, membership, reports, and what a release, a drop or a leave means for this node), `Inbox` serves it
to the node's HTTP API, and this class feeds the state its inputs (with the clock: `now`) and carries out what it
decided, in one order (`_applied`): serving, registering, sending, arriving, and the errors a training loop hears.
Rank 0 of a --peer-list also serves the run's barrier, which its `host` builds (`daemon/hosting.py`): this class
knows it only as a `HostedBarrier`; `mosaicd.Peer` (`daemon/embedded.py`) hosts the real one.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from aiohttp import web

from mosaic_proto import Advance, BarrierReason, Fragmentation, Layout, NodeOutcome, NodeState, PeerSampler, TaskClaim
from mosaicd.daemon.errors import PeerDropped, RunEnded, run_ended
from mosaicd.daemon.hosting import BarrierHost, HostedBarrier
from mosaicd.daemon.http.auth import REGISTER_RUN, Secret, check_listen, signer
from mosaicd.daemon.http.client import Client, HttpError, Refused
from mosaicd.daemon.http.membership import embedded_barrier_url, listed_addresses, own_address
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.http.tls import client_context, scheme
from mosaicd.daemon.loop import loop_name
from mosaicd.daemon.node.inbox import Inbox
from mosaicd.daemon.node.outbound import Link, arrival, arrive, leave, live_model, read_release, send_all
from mosaicd.daemon.node.routes import node_app
from mosaicd.logs import get_logger
from mosaicd.outputs import higher_is_better_by_name, is_eval_round
from mosaicd.protocol import aggregator_rule, attack_of, compressor_of, profile_spec
from mosaicd.settings import DaemonOptions, RunConfig, SettingsError

__all__ = ["Peer", "PeerDropped", "RunEnded"]


class Peer:
    def __init__(self, options: DaemonOptions, model: Layout | Any = None, *, run: RunConfig | None = None,
                 host: BarrierHost | None = None, rejoining: bool = False, resume_rank: int | None = None,
                 secret: Secret | None = None, checkpoints: Sequence[int] | None = None,
                 runs_task: bool = False) -> None:
        """`model`: the model's Layout, or a torch module whose float state is the gossiped vector; None to
        give it after registration (`set_model`). `run` and `host` are needed only where this peer hosts the
        barrier (rank 0 of a --peer-list): `host` builds it (`mosaicd.Peer` gives `mosaicd.daemon.embedded`'s,
        with the network evaluation it was given). `rejoining`: this process takes over from an earlier one (its
        checkpoint, or its note of being a member: `checkpoint.was_member`): fragments of the round it lost are
        refused at once instead of held until it is ready. `resume_rank`: the rank this process takes back in a resumed
        run (`--resume-round`), wherever it listens now. `secret`: the run's (a `mosaicd.Barrier`'s of the same
        program: `barrier.secret`); none given: --secret-file's, read here. `checkpoints`: the rounds of this
        member's checkpoints of the run (a peer list's member started again): where rank 0 resumes the run, it goes
        on at one of them, said by `resumed_at`. `runs_task`: this peer builds the run's task (`mosaicd node`); else
        it is a training loop of its own, and its registration says so (a barrier with a task refuses it)."""
        self.options, self._model, self._host, self._hosted_run = options, model, host, run
        self._resume_rank, self._checkpoints = resume_rank, checkpoints
        self._runs = TaskClaim(False) if runs_task else TaskClaim(True, own_loop_name(options), values_of(model))
        self.resumed_at: int | None = None  # the round a resumed run goes on at, from this member's checkpoint of it
        self._paced: tuple[int, Link] | None = None  # (rank, its link) under --node-profile
        self._aggregate_s = 0.0  # how long the last release's aggregation took, for the next round's report
        self.state = NodeState(max_bytes=options.max_body_bytes, max_norm=options.max_norm, rejoining=rejoining,
                               on_refused=lambda why, n: self.metrics.counted(why, n))
        self.secret = secret if secret is not None else Secret.of(options)  # resolved once, handed down
        self.inbox = Inbox(self.state, options, self.secret.keyring())
        self.log = get_logger(role="node")
        self.barrier: HostedBarrier | None = None  # the one this peer hosts (rank 0 of a --peer-list)
        self._runner: web.AppRunner | None = None
        keyring = self.inbox.keyring
        self._client = Client(options.request_timeout, options.retries, signer=signer(
            lambda: keyring.credentials(self.run.run_id if self.rank >= 0 else REGISTER_RUN),
            lambda: str(self.rank) if self.rank >= 0 else self.address) if keyring else None,
            ssl_context=client_context(options))

    # -- what a training loop reads --------------------------------------------------------------------
    @property
    def run(self) -> RunConfig:
        assert self.inbox.run is not None, "the run is known once the peer is registered"
        return self.inbox.run

    rank = property(lambda self: self.state.rank, doc="this node's rank (-1 before registration)")
    round = property(lambda self: self.state.round, doc="the round this node is in")
    members = property(lambda self: list(self.state.members), doc="the ranks of the open round")
    vector = property(lambda self: self.state.vector, doc="the newest model (the last aggregate)")
    phase = property(lambda self: self.state.phase)
    last_report = property(lambda self: self.state.last_report, doc="the last finished round's NodeReport")
    address = property(lambda self: self.inbox.address)
    metrics = property(lambda self: self.inbox.metrics)

    @staticmethod
    def now() -> float:
        """The clock the state is fed (seconds, the event loop's: monotonic)."""
        return asyncio.get_running_loop().time()

    # -- lifecycle -----------------------------------------------------------------------------------
    async def __aenter__(self) -> Peer:
        await self._client.__aenter__()
        try:
            await self._serve()
            await self._register()
            if self._model is not None:
                self.set_model(self._model)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """A loop that fails (not Ctrl-C) inside `async with` leaves the run, saying why: nobody waits for it."""
        try:
            if isinstance(exc, Exception) and not isinstance(exc, PeerDropped | RunEnded) and self.barrier is None:
                await self.leave(f"its training loop ended with {type(exc).__name__}: {exc}")
        finally:
            await self.close()

    async def close(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None
        await self._client.__aexit__()

    async def _serve(self) -> None:
        options, inbox = self.options, self.inbox
        app = node_app(inbox)
        check_listen(options, inbox.keyring)
        if options.peer_list is not None:
            inbox.registers_with(inbox.barrier_url or embedded_barrier_url(options))
            self.barrier = hosted_barrier(options, self._hosted_run, self._host, self.secret)
            if self.barrier is not None:
                app.add_subapp("/barrier", self.barrier.app())
        if not inbox.barrier_url:
            raise ValueError("--barrier-url or --peer-list is needed to find the other nodes")
        self._runner, port = await serve(app, options)
        inbox.listening(own_address(options, port))
        self.log = self.log.bind(address=inbox.address)

    async def _registration_seen(self) -> str:
        """What the barrier's open /v1/status says of the registration this node gave up on (for its error)."""
        try:
            _, body, _ = await self._client.request("GET", f"{self.inbox.barrier_url}/v1/status", timeout=3,
                                                    retries=0)
            status = json.loads(body)
        except (HttpError, OSError, ValueError, TimeoutError):
            return " (the barrier did not answer /v1/status either: is --barrier-url right, is it up?)"
        if status.get("phase") != "registering":
            return f" (the barrier answers: its run is {status.get('phase')})"
        expected = status.get("expected") or "?"
        return (f" (the barrier answers: {status.get('registered')} of {expected} nodes registered; it holds each "
                "registration until all have come, then the run starts: start the others, or give a longer "
                "--register-deadline)")

    async def _register(self) -> None:
        body = {"address": self.address, "task": self._runs.to_json(),
                **({"rank": self._resume_rank} if self._resume_rank is not None else {}),
                **({"checkpoints": list(self._checkpoints)} if self._checkpoints is not None else {})}
        try:
            reply = await self._ask_place(body)
        except asyncio.CancelledError:  # told to stop while waiting for the roster: not counted in it
            await self.withdraw("it was told to stop while it waited for the other nodes to register")
            raise
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}{await self._registration_seen()}") from None
        run = RunConfig.model_validate(reply["run"])
        differ = settings_differ(self._hosted_run, run)
        self._checkpoints = None  # a registration after a drop (`rejoin`) is not a resume
        self.resumed_at = int(reply.get("round", 0)) if reply.get("resumed") else None
        self.state.registered(int(reply["rank"]), list(reply["members"]), reply.get("live", range(len(
            reply["members"]))), int(reply.get("round", 0)), run.run_id, self.now())
        self.log = self.log.bind(node=self.rank, run=run.run_id)
        self.inbox.registered_for(run)
        self.log.info("registered", rank=self.rank, members=len(self.members), round=self.round,
                      event_loop=loop_name())
        if differ:  # a peer list's member started with other run settings than rank 0's: it cannot take part
            reason = f"its run settings differ from rank 0's: {differ}"
            await self.leave(reason)
            raise SettingsError(f"--peer-list: {reason} (give every member the same run settings)")

    async def _ask_place(self, body: dict[str, Any]) -> dict[str, Any]:
        """The barrier's answer to this node's registration (a long poll). Where it answers that this node is a
        member started again (`joining`: it sits out the open round), the node says so to its peers from now on
        (`NodeState.sitting_out`) and asks again for its place, which comes with the open round's release."""
        url = f"{self.inbox.barrier_url}/v1/register"
        while True:
            try:
                return await self._client.post_json_until(url, body, self.options.register_deadline,
                                                          "--register-deadline", self.log)
            except Refused as exc:
                if exc.reason != BarrierReason.JOINING:
                    raise
                self.state.sitting_out()
                self.log.info("sitting_out", detail=exc.detail)

    async def withdraw(self, reason: str) -> None:
        """Withdraw this node's registration (one try); once the roster is made, leave as the member it is."""
        if self.rank >= 0:
            await self.leave(reason)
            return
        try:
            await self._client.request("DELETE", f"{self.inbox.barrier_url}/v1/register", json_body={
                "address": self.address, "reason": reason}, timeout=min(self.options.request_timeout, 5.0), retries=0)
            self.log.warning("withdrew", reason=reason)
        except HttpError as exc:
            self.log.warning("withdraw_unheard", error=exc.detail)

    async def rejoin(self) -> None:
        """Register again after a drop: a member from the next round boundary on, with that round's membership."""
        self.state.rejoining()  # it registers as its address again, signed as one that registers
        await self._register()

    async def download_model(self) -> np.ndarray:
        """The newest model of a live peer, for a peer that starts after round 0 without a fresh checkpoint."""
        return await live_model(self._client, self.options, self.state.addresses,
                                [m for m in self.members if m != self.rank], self.inbox.layout, self.log)

    def set_model(self, model: Layout | Any, vector: np.ndarray | None = None) -> None:
        """The model's layout, once the run is known; from now on fragments are taken. `vector`: the model this
        peer starts from, where known (served to the barrier and to peers that rejoin)."""
        if not isinstance(model, Layout):
            from mosaicd.learning.tasks.torch_util import layout_of
            model = layout_of(model)
        run = self.run
        fragmentation = Fragmentation.build(model, run.fragments, run.seed, run.strategy)
        self.state.start(fragmentation, PeerSampler(run.sampler, run.fanout, run.seed), vector,
                         aggregator=aggregator_rule(run), attack=attack_of(run, self.rank),
                         compressor=compressor_of(run, self.rank), evaluated=partial(is_eval_round, run=run))
        self.inbox.model_known(model)
        self.log.info("ready", dim=model.dim, fingerprint=fragmentation.fingerprint.hex())

    def compression_state(self) -> dict[str, np.ndarray]:
        """What this node's error feedback carries (--compress), for its checkpoint."""
        compressor = self.state.compressor
        return {} if compressor is None else compressor.state()

    def restore_compression(self, carried: Mapping[str, np.ndarray]) -> None:
        """Go on with a checkpoint's error feedback (after `set_model`)."""
        if self.state.compressor is not None:
            self.state.compressor.restore(carried)

    def begin(self, vector: np.ndarray, kept_as: int | None = None, before: np.ndarray | None = None) -> None:
        """The model this peer starts from (its round's model until the first aggregate); `kept_as`: the round it
        is the model after, where it is this node's own (a resumed run); `before`: its model after the round
        before that one (a resumed run's earlier checkpoint), which the barrier may still have to evaluate."""
        self.state.begin(vector, kept_as, before)

    # -- one round: train (the caller) -> fragment -> send -> barrier -> aggregate ------------------
    async def gossip(self, local: np.ndarray | Any, *, loss: float = math.nan, train_s: float = 0.0,
                     metrics: Mapping[str, float] | None = None, higher_is_better: bool | None = None,
                     before_arrival: Callable[[], Awaitable[object]] | None = None) -> np.ndarray:
        """Send this round's fragments of `local`, wait at the barrier, and return the aggregated vector.

        `local` is a flat float32 vector, or a torch module: then its state is gossiped and overwritten in place.
        `metrics`: your own metrics of this round (name -> number): kept with the round's snapshot, the barrier
        collects them at evaluation rounds into rounds.csv (`metric`: the first name; all of them under `reported`).
        `higher_is_better`: whether the first is better higher (None: as its name says, a loss or error lower).
        `before_arrival`: awaited once the fragments are sent and before this node arrives at the barrier: what
        must be done before the round can be released (the node daemon's checkpoint being written, whose disk
        writes then overlap the sends instead of delaying them).
        """
        if not isinstance(local, np.ndarray) and hasattr(local, "state_dict"):
            return await _gossip_module(self, local, loss, train_s, metrics, higher_is_better, before_arrival)
        state, t = self.state, self.state.round
        kept = reported(metrics, higher_is_better) if metrics is not None else None
        sending = state.outgoing(local, self.now())
        if sending.outcome is NodeOutcome.REFUSED:
            raise RuntimeError(f"gossip() needs a registered peer with a model (set_model): {sending.why}")
        if kept is not None:
            self.inbox.evaluated(t, kept)
        urls = [f"{scheme(self.options)}://{state.addresses[m.peer]}/v1/fragments" for m in sending.messages]
        delivered, unsent = await send_all(self._client, t, sending.messages, urls, self.log,
                                           state.send_budget(self.run.round_deadline, self.now()), self._link(),
                                           starting=state.starting)
        report = state.sent(delivered, unsent, self.now(), loss, train_s, self._aggregate_s)
        if before_arrival is not None:
            await before_arrival()
        release, joined, failure = read_release(await self._arrive(arrival(state, report)))
        started = self.now()
        advance = state.released(release.members, joined, release.stragglers, started, failure)
        self._aggregate_s = self.now() - started
        return self._applied(advance, t, loss)

    def _applied(self, advance: Advance, t: int, loss: float) -> np.ndarray:
        """The one place a release's decision is run, in one order: the round's traffic counted, then what the state
        decided: the next round's counts and the aggregate (AGGREGATED), or the error the loop hears (LEFT_OUT:
        PeerDropped; FAILED: RunEnded)."""
        self.metrics.sent(advance.sent)
        if advance.outcome is NodeOutcome.LEFT_OUT:
            raise PeerDropped(f"node {self.rank} was dropped from the run after round {t}")
        if advance.outcome is NodeOutcome.FAILED:
            raise run_ended(advance.failure, f" after round {t}")
        self.metrics.taken(advance.taken)
        self.metrics.round_done(t + 1, loss, advance.report)
        return advance.vector

    def _link(self) -> Link | None:
        """This node's link as --node-profile describes it (latency, bandwidth), or None."""
        if self.run.node_profile is None:
            return None
        if self._paced is None or self._paced[0] != self.rank:  # the profile is read once per rank, not per round
            spec = profile_spec(self.run)
            assert spec is not None
            self._paced = (self.rank, Link(spec.of(self.rank, self.run.seed, self.run.nodes)))
        return self._paced[1]

    def evaluating(self, round: int) -> None:
        """This node computes its metrics of `round` (the model after it): the barrier's collection waits for them."""
        self.inbox.evaluating(round)

    def evaluated(self, round: int, metrics: dict[str, Any] | None) -> None:
        """This node's metrics of `round` (`model_codec`'s `metrics`), kept and served with its snapshot."""
        self.inbox.evaluated(round, metrics)

    async def _arrive(self, body: dict[str, Any], final: bool = False) -> dict[str, Any]:
        try:
            rank = self.rank
            others = [a for m, a in enumerate(self.state.addresses) if m != rank and a]
            return await arrive(self._client, self.inbox.barrier_url or "", body, final, self.run.round_deadline,
                                self.options, self.log, peers=others)
        except PeerDropped:
            self.state.dropped()  # DROPPED, or IGNORED where it left meanwhile: the loop hears it either way
            raise

    async def leave(self, reason: str, ends_run: bool = False, within: float | None = None,
                    stopped: bool = False) -> None:
        """Leave the run (told to stop, or failing): the barrier stops waiting for this node at once. `ends_run`:
        the run cannot go on without this node (its checkpoint could not be written): it ends, failed, resumable.
        `within`: how long the barrier has to answer (a process told to stop has 2 s in all). `stopped`: it was
        told to stop (a signal), which the barrier weighs with the others' (a whole run stopped is interrupted)."""
        if self.state.leaving() is NodeOutcome.IGNORED:  # never registered, or its run is over: nobody to tell
            return
        await leave(self._client, self.inbox.barrier_url or "", {"rank": self.rank, "reason": reason[:2000],
                                                                   "ends_run": ends_run, "stopped": stopped},
                    min(self.options.request_timeout, 5.0) if within is None else within / 2, self.log)  # 2 tries
        self.state.left()

    async def finish(self) -> None:
        """Tell the barrier this node is done; returns once the barrier has collected the final models."""
        self.state.finishing()
        await self._arrive(arrival(self.state, None), final=True)
        self.state.finished()


def reported(metrics: Mapping[str, float], higher_is_better: bool | None = None) -> dict[str, Any]:
    """A training loop's own metrics of a round as a snapshot keeps them (`model_codec`); the first one leads,
    better higher or lower as given, else as its name says (`outputs.higher_is_better_by_name`)."""
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"gossip(metrics=...): a metric's name must be a non-empty string, not {name!r}")
        try:
            values[name] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"gossip(metrics=...): {name} is not a number: {value!r}") from None
    lead = next(iter(values), None)
    better = higher_is_better if higher_is_better is not None or lead is None else higher_is_better_by_name(lead)
    return {"values": values, "metric": lead, "higher_is_better": better, "source": "reported"}


async def _gossip_module(peer: Peer, module: Any, loss: float, train_s: float,
                         metrics: Mapping[str, float] | None, higher_is_better: bool | None,
                         before_arrival: Callable[[], Awaitable[object]] | None) -> np.ndarray:
    """`Peer.gossip` of a torch module: its state is gossiped, then overwritten in place by the aggregate."""
    from mosaicd.learning.tasks.torch_util import load_vector, to_vector

    vector = await peer.gossip(to_vector(module), loss=loss, train_s=train_s, metrics=metrics,
                               higher_is_better=higher_is_better, before_arrival=before_arrival)
    load_vector(module, vector)
    return vector


def settings_differ(ours: RunConfig | None, run: RunConfig) -> str:
    """The run settings a peer-list member was given that differ from the run's (rank 0's), as flags; "" if none."""
    if ours is None:
        return ""
    mine, theirs = ours.model_dump(mode="json"), run.model_dump(mode="json")
    return ", ".join(f"--{k.replace('_', '-')} {mine[k]} (the run's: {v})" for k, v in theirs.items()
                     if k != "nodes" and mine.get(k) != v)


def hosted_barrier(options: DaemonOptions, run: RunConfig | None, host: BarrierHost | None,
                   secret: Secret) -> HostedBarrier | None:
    """With --peer-list, rank 0 (the first address in sorted order) also serves the barrier, for as many nodes as
    the list names."""
    addresses = listed_addresses(options)
    if addresses[0] != own_address(options, options.port) or options.barrier_url:
        return None
    if run is None:
        raise ValueError("rank 0 of a --peer-list hosts the barrier: it needs the run's settings")
    if host is None:
        raise ValueError("rank 0 of a --peer-list hosts the barrier: it needs a host (mosaicd.Peer has one)")
    return host(run.with_nodes(len(addresses)), options, secret)


def own_loop_name(options: DaemonOptions) -> str:
    """What an own loop calls itself: its settings' task where they say --own-loop (a name, not a task), else none."""
    return str(getattr(options, "task", "")) if getattr(options, "own_loop", False) else ""


def values_of(model: Layout | Any) -> int | None:
    """The size of the model a peer was given (None: given later, `set_model`)."""
    if model is None:
        return None
    if isinstance(model, Layout):
        return model.dim
    from mosaicd.learning.tasks.torch_util import layout_of
    return layout_of(model).dim
