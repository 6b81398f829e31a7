"""A node's Prometheus metrics: what it sent, took and refused, and how its rounds went.

Names follow Prometheus conventions: base units in the name (`_bytes`, `_seconds`), `_total` on counters, one
metric per quantity; round phase durations are a histogram (`mosaic_round_phase_seconds{phase}`); the
registry also holds the `process_*` metrics (`daemon/http/metrics.py`) and serves no `_created` series
(`daemon/http/endpoints.py`).
"""

from __future__ import annotations

import math

from prometheus_client import Counter, Gauge, Histogram

from mosaic_proto import NodeReport, Reason, RoundReport
from mosaic_proto.rules import cut_labels
from mosaicd.daemon.http.metrics import SECONDS_BUCKETS, member_registry

PHASES = ("train", "send", "wait", "aggregate")


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = member_registry()
        self.round = Gauge("mosaic_round", "rounds this node has finished (the round it is in)", registry=r)
        self.bytes_out = Counter("mosaic_sent_bytes", "fragment message bytes sent", registry=r)
        self.raw_bytes_out = Counter("mosaic_sent_uncompressed_bytes", "the float32 bytes of the fragments sent, "
                                     "before --compress (4 per coordinate)", registry=r)
        self.bytes_in = Counter("mosaic_received_bytes", "fragment message bytes accepted", registry=r)
        self.msgs_out = Counter("mosaic_sent_messages", "fragment messages sent", registry=r)
        self.frags_out = Counter("mosaic_sent_fragments", "fragments sent", registry=r)
        self.frags_in = Counter("mosaic_received_fragments", "fragments accepted", registry=r)
        self.msgs_in = Counter("mosaic_received_messages", "fragment messages accepted", registry=r)
        self.refusals = Counter("mosaic_refused_messages", "fragment messages refused, by reason", ["reason"],
                                registry=r)
        self.cut = Counter("mosaic_aggregator_cut_fragments", "received fragments the aggregator's rule cut, by "
                           "what it counts (mosaic_proto.rules: clipped, trimmed in most coordinates)", ["rule"],
                           registry=r)
        self.unsent = Counter("mosaic_unsent_fragments", "fragments the transport gave up on", registry=r)
        self.phase = Histogram("mosaic_round_phase_seconds", "seconds per round phase: train, send (fragments), "
                               "wait (at the barrier), aggregate", ["phase"], buckets=SECONDS_BUCKETS, registry=r)
        self.loss = Gauge("mosaic_train_loss", "training loss of the last round (NaN before the first)", registry=r)
        self.loss.set(math.nan)
        for reason in Reason:  # every series from the start, so that rates and sums see the first refusal
            self.refusals.labels(reason.value)
        for phase in PHASES:
            self.phase.labels(phase)
        for rule in cut_labels():
            self.cut.labels(rule)

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

    def counted(self, reason: str, count: int) -> None:
        """What a round state refused on its own: messages refused by --max-norm once the node's norms were
        known, fragments its aggregator cut."""
        if reason in cut_labels():
            self.cut.labels(reason).inc(count)
        else:
            self.refusals.labels(reason).inc(count)

    def sent(self, report: RoundReport) -> None:
        self.bytes_out.inc(report.bytes_out)
        self.raw_bytes_out.inc(report.raw_bytes_out)
        self.msgs_out.inc(report.messages_out)
        self.frags_out.inc(report.fragments_out)
        self.unsent.inc(report.fragments_unsent)

    def round_done(self, round: int, loss: float, report: NodeReport) -> None:
        """Round `round - 1` is over: one observation per phase from its report."""
        for phase in PHASES:
            seconds = getattr(report, f"{phase}_s")
            if isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0:
                self.phase.labels(phase).observe(seconds)
        if math.isfinite(loss):
            self.loss.set(loss)
        self.round.set(round)
