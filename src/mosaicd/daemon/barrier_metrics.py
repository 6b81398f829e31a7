"""The barrier's Prometheus metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from mosaic_proto import Release
from mosaicd.outputs import SUMMARY_KEYS


class BarrierMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.round = Gauge("mosaic_barrier_round", "round the barrier waits on", registry=r)
        self.members = Gauge("mosaic_barrier_members", "live members", registry=r)
        self.registered = Gauge("mosaic_barrier_registered", "registered nodes", registry=r)
        self.expected = Gauge("mosaic_barrier_expected", "nodes expected", registry=r)
        self.stragglers = Counter("mosaic_barrier_stragglers", "straggler reports", registry=r)
        self.dropped = Counter("mosaic_barrier_dropped", "members dropped", registry=r)
        self.round_s = Gauge("mosaic_barrier_round_seconds", "duration of the last released round", registry=r)
        self.metric = Gauge("mosaic_barrier_metric", "latest network metrics", ["name"], registry=r)
        self._last: float | None = None
        self._dropped = 0

    def released(self, release: Release, now: float) -> None:
        if self._last is not None:
            self.round_s.set(now - self._last)
        self._last = now
        self.round.set(release.round + 1)
        self.members.set(len(release.members))
        self.stragglers.inc(len(release.stragglers))
        self.dropped.inc(len(release.dropped) - self._dropped)
        self._dropped = len(release.dropped)

    def evaluated(self, row: dict[str, Any]) -> None:
        for key in SUMMARY_KEYS[1:]:
            if isinstance(row.get(key), float):
                self.metric.labels(key).set(row[key])
