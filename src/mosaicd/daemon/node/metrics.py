"""A node's Prometheus metrics: what it sent, took and refused, and how its rounds went.

Names follow Prometheus conventions: base units in the name (`_bytes`, `_seconds`), `_total` on counters, one
metric per quantity; round phase durations are a histogram (`mosaic_round_phase_seconds{phase}`); the
registry also holds the `process_*` metrics (`daemon/http/metrics.py`) and serves no `_created` series
(`daemon/http/endpoints.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from mosaic_proto import NodeReport, Reason, RoundReport
from mosaic_proto.rules import cut_labels
from mosaicd.daemon.http.metrics import SECONDS_BUCKETS, member_registry

PHASES = ("train", "send", "wait", "aggregate")
TRAFFIC_COUNTERS = {  # NodeMetrics' field -> (counter, help)
    "bytes_out": ("mosaic_sent_bytes", "fragment message bytes sent"),
    "raw_bytes_out": ("mosaic_sent_uncompressed_bytes", "the float32 bytes of the fragments sent, before --compress "
                      "(4 per coordinate)"),
    "bytes_in": ("mosaic_received_bytes", "fragment message bytes accepted"),
    "msgs_out": ("mosaic_sent_messages", "fragment messages sent"),
    "frags_out": ("mosaic_sent_fragments", "fragments sent"),
    "frags_in": ("mosaic_received_fragments", "fragments accepted"),
    "msgs_in": ("mosaic_received_messages", "fragment messages accepted"),
    "unsent": ("mosaic_unsent_fragments", "fragments the transport gave up on"),
}


class _Traffic(Collector):
    """The traffic counters, kept as plain numbers and read at each scrape: a `Counter.inc` is several Python calls
    and a lock, three per message received, which showed in a node's event loop (bench/README.md, issue 59)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(TRAFFIC_COUNTERS, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self.counts
        for field, (name, help) in TRAFFIC_COUNTERS.items():
            yield CounterMetricFamily(name, help, value=counts[field])

    def describe(self) -> Iterator[CounterMetricFamily]:
        for name, help in TRAFFIC_COUNTERS.values():
            yield CounterMetricFamily(name, help)


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = member_registry()
        self.round = Gauge("mosaic_round", "rounds this node has finished (the round it is in)", registry=r)
        self._traffic = _Traffic()
        r.register(self._traffic)
        self.refusals = Counter("mosaic_refused_messages", "fragment messages refused, by reason", ["reason"],
                                registry=r)
        self.cut = Counter("mosaic_aggregator_cut_fragments", "received fragments the aggregator's rule cut, by "
                           "what it counts (mosaic_proto.rules: clipped, trimmed in most coordinates)", ["rule"],
                           registry=r)
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
        self.accepted(report.bytes_in, report.fragments_in, report.messages_in)
        for reason, count in report.refused.items():
            self.refusals.labels(reason).inc(count)

    def accepted(self, nbytes: int, fragments: int, messages: int = 1) -> None:
        counts = self._traffic.counts
        counts["msgs_in"] += messages
        counts["bytes_in"] += nbytes
        counts["frags_in"] += fragments

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
        counts = self._traffic.counts
        counts["bytes_out"] += report.bytes_out
        counts["raw_bytes_out"] += report.raw_bytes_out
        counts["msgs_out"] += report.messages_out
        counts["frags_out"] += report.fragments_out
        counts["unsent"] += report.fragments_unsent

    def round_done(self, round: int, loss: float, report: NodeReport) -> None:
        """Round `round - 1` is over: one observation per phase from its report."""
        for phase in PHASES:
            seconds = getattr(report, f"{phase}_s")
            if isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0:
                self.phase.labels(phase).observe(seconds)
        if math.isfinite(loss):
            self.loss.set(loss)
        self.round.set(round)
