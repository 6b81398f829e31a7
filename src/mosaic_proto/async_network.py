"""`AsyncNetwork`: asynchronous nodes (`AsyncNodeState`) in one process, a discrete-event simulation on a virtual
clock driven by the node profiles (docs/spec.md, "Asynchronous mode").

Each node trains an iteration in slowdown x compute_s seconds, then its state aggregates and queues its sends and it
trains the next at once. Its uplink sends one queued message at a time, each for bytes / bandwidth seconds (all at
once where the bandwidth is unlimited), and a message arrives its sender's latency after it left. Events at the same
time run in a fixed order (training, then links, then arrivals, each by node, then by when they were scheduled), so
the same inputs give the same models, bit for bit, and no rank is favoured: nodes that end an iteration at the same
moment aggregate what arrived before it, none what another sent at that moment. With --exchange pairwise a request's
arrival is the pair's atomic event: both nodes keep the average of their models at that moment.

    network = AsyncNetwork(states, train, profiles, compute_s)
    network.run_until(t)        # every event up to virtual time t; `network.now`, `network.done`
    network.vectors             # each node's model now
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .async_node import AsyncMessage, AsyncNodeState, AsyncOutcome, Iteration
from .network import TrainFn
from .profiles import NodeProfile

__all__ = ["AsyncNetwork", "OnIteration"]

_TRAINED, _LINK, _ARRIVE = 0, 1, 2  # the order of events at the same time
_NOT_SAVED = ("train", "on_iteration")
OnIteration = Callable[[int, Iteration, float, float, float], None]  # node, iteration, loss, train_s, now


class AsyncNetwork:
    """`states[i]` is node i's state; `train(node, step, vector)` its H local steps (None: no training);
    `profiles[i % len(profiles)]` its hardware; `on_iteration` is told of every iteration as it ends."""

    def __init__(self, states: Sequence[AsyncNodeState], train: TrainFn | None, profiles: Sequence[NodeProfile],
                 compute_s: float, on_iteration: OnIteration | None = None) -> None:
        self.states, self.train, self.compute_s = list(states), train, compute_s
        self.profiles = [profiles[i % len(profiles)] if profiles else NodeProfile() for i in range(len(self.states))]
        self.on_iteration = on_iteration
        self.now = 0.0
        self.finished_at: dict[int, float] = {}  # node -> when its last iteration ended
        self._events: list[tuple] = []
        self._seq = 0
        self._link_free = [0.0] * len(self.states)
        self.delivered = self.superseded = 0
        for i in range(len(self.states)):
            self._push(self._train_s(i), _TRAINED, i, None)

    def saved(self) -> dict[str, Any]:
        """Everything the run goes on from between two events (the nodes' states, the pending events and messages,
        the links, the clock), without the training function and the listener: what `resumed` takes back. The
        caller serializes it (its nodes' training state apart: the task's)."""
        return {k: v for k, v in vars(self).items() if k not in _NOT_SAVED}

    @classmethod
    def resumed(cls, saved: dict[str, Any], train: TrainFn | None,
                on_iteration: OnIteration | None = None) -> AsyncNetwork:
        """The network `saved` was taken of, going on with `train` and `on_iteration`: the same events follow."""
        network = cls.__new__(cls)
        vars(network).update(saved)
        network.train, network.on_iteration = train, on_iteration
        return network

    @property
    def vectors(self) -> list[np.ndarray]:
        return [s.vector for s in self.states]

    @property
    def done(self) -> bool:
        """No event is left: every node finished and every message arrived."""
        return not self._events

    @property
    def next_time(self) -> float | None:
        return self._events[0][0] if self._events else None

    def _train_s(self, node: int) -> float:
        return self.profiles[node].train_s(self.compute_s)

    def _push(self, at: float, kind: int, node: int, payload: AsyncMessage | None) -> None:
        heapq.heappush(self._events, (at, kind, node, self._seq, payload))
        self._seq += 1

    def run_until(self, until: float) -> None:
        """Run every event at or before virtual time `until` (the clock stays at the last one run)."""
        events = self._events
        while events and events[0][0] <= until:
            at, kind, node, _, payload = heapq.heappop(events)
            self.now = at
            if kind == _ARRIVE:
                self._arrive(node, payload)
            elif kind == _LINK:
                self._send(node)
            else:
                self._trained(node)

    def run(self) -> None:
        """Every event, to the end of the run."""
        self.run_until(float("inf"))

    def _trained(self, node: int) -> None:
        state, now = self.states[node], self.now
        train_s = self._train_s(node)
        if self.train is not None:
            local, loss = self.train(node, state.step, state.start)
        else:
            local, loss = state.start, float("nan")
        iteration = state.trained(local, now)
        if self.on_iteration is not None:
            self.on_iteration(node, iteration, loss, train_s, now)
        if iteration.outcome is AsyncOutcome.DONE:
            self.finished_at[node] = now
        else:
            self._push(now + train_s, _TRAINED, node, None)
        if self._link_free[node] <= now:
            self._send(node)

    def _send(self, node: int) -> None:
        """The node's link is free: queued messages leave, one at a time over a link of limited bandwidth."""
        state, now, profile = self.states[node], self.now, self.profiles[node]
        while (message := state.next_send(now)) is not None:
            send_s = message.nbytes / profile.bandwidth if profile.bandwidth else 0.0
            self._push(now + send_s + profile.latency, _ARRIVE, message.peer, message)
            if send_s > 0:
                self._link_free[node] = now + send_s
                self._push(now + send_s, _LINK, node, None)
                return

    def _arrive(self, node: int, message: AsyncMessage | None) -> None:
        assert message is not None
        receiver, now = self.states[node], self.now
        self.delivered += 1
        if message.pair:
            sender = self.states[message.batch.sender]
            average = receiver.paired(sender.vector, now)
            if average is not None:
                sender.averaged(average, now)
        else:
            receiver.receive(message.batch, now)
