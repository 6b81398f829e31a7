"""A node's Prometheus metrics: what it sent, took and refused, and how its last round went."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from mosaic_proto import Reason, RoundReport

PHASES = ("train", "send", "wait", "aggregate")


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.round = Gauge("mosaic_round", "current round", registry=r)
        self.bytes_out = Counter("mosaic_bytes_sent", "fragment bytes sent", registry=r)
        self.bytes_in = Counter("mosaic_bytes_received", "fragment bytes accepted", registry=r)
        self.frags_out = Counter("mosaic_fragments_sent", "fragments sent", registry=r)
        self.frags_in = Counter("mosaic_fragments_received", "fragments accepted", registry=r)
        self.msgs_in = Counter("mosaic_messages_received", "messages accepted", registry=r)
        self.refusals = Counter("mosaic_messages_refused", "messages refused", ["reason"], registry=r)
        self.unsent = Counter("mosaic_fragments_unsent", "fragments the transport gave up on", registry=r)
        self.phase = Gauge("mosaic_round_phase_seconds", "time spent per phase in the last round", ["phase"],
                           registry=r)
        self.loss = Gauge("mosaic_train_loss", "training loss of the last round", registry=r)

    def taken(self, report: RoundReport) -> None:
        """A new round state took the messages buffered for it: count them like live ones."""
        self.msgs_in.inc(report.messages_in)
        self.bytes_in.inc(report.bytes_in)
        self.frags_in.inc(report.fragments_in)
        for reason, count in report.refused.items():
            self.refusals.labels(reason).inc(count)

    def accepted(self, nbytes: int, fragments: int) -> None:
        self.msgs_in.inc()
        self.bytes_in.inc(nbytes)
        self.frags_in.inc(fragments)

    def refused(self, reason: Reason) -> None:
        self.refusals.labels(reason.value).inc()

    def sent(self, report: RoundReport) -> None:
        self.bytes_out.inc(report.bytes_out)
        self.frags_out.inc(report.fragments_out)
        self.unsent.inc(report.fragments_unsent)

    def round_done(self, round: int, loss: float, report: dict[str, Any]) -> None:
        for phase in PHASES:
            self.phase.labels(phase).set(report.get(f"{phase}_s") or 0.0)
        if math.isfinite(loss):
            self.loss.set(loss)
        self.round.set(round)
