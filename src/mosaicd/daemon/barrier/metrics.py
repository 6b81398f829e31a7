"""The barrier's Prometheus metrics: the roster, releases, and the newest network evaluation.

One metric per quantity (`mosaic_node_average_metric`, `mosaic_consensus_distance`, ...); which task metric
(accuracy, rmse, loss, ...) the `_metric` gauges hold is `mosaic_run_info`'s `metric` label. The evaluation
gauges appear with the first evaluation. Round durations are a histogram (`mosaic_barrier_round_seconds`); the
registry also holds the `process_*` metrics (`daemon/http/metrics.py`) and serves no `_created` series
(`daemon/http/endpoints.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mosaic_proto import Release
from mosaicd.daemon.http.metrics import SECONDS_BUCKETS, member_registry
from mosaicd.settings import RunConfig

# evaluation row key -> (metric name, help)
EVALUATION_GAUGES = {
    "round": ("mosaic_evaluated_round", "round of the newest network evaluation"),
    "node_average": ("mosaic_node_average_metric", "mean over nodes of each node model's task metric "
                     "(mosaic_run_info's metric label names it)"),
    "average_model": ("mosaic_average_model_metric", "task metric of the average model mean_i x_i "
                      "(mosaic_run_info's metric label names it)"),
    "consensus_distance": ("mosaic_consensus_distance", "mean over nodes of ||x_i - mean_j x_j||"),
    "node_spread": ("mosaic_node_spread", "standard deviation over nodes of the node models' task metric"),
    "train_loss": ("mosaic_network_train_loss", "mean training loss of the nodes in the evaluated round"),
    "node_average_test_loss": ("mosaic_node_average_test_loss", "mean over nodes of each node model's test loss"),
    "average_model_test_loss": ("mosaic_average_model_test_loss", "test loss of the average model"),
}


class _Evaluation(Collector):
    """The newest evaluation row as gauges; nothing before the first one (no made-up zeros)."""

    def __init__(self) -> None:
        self.row: dict[str, Any] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        row = self.row
        for key, (name, help) in EVALUATION_GAUGES.items():
            value = row.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(name, help, value=float(value))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, help in EVALUATION_GAUGES.values():
            yield GaugeMetricFamily(name, help)


class BarrierMetrics:
    def __init__(self, run: RunConfig | None = None) -> None:
        r = self.registry = member_registry()
        self.round = Gauge("mosaic_barrier_round", "round the barrier waits on", registry=r)
        self.members = Gauge("mosaic_barrier_members", "live members", registry=r)
        self.registered = Gauge("mosaic_barrier_registered", "registered nodes", registry=r)
        self.expected = Gauge("mosaic_barrier_expected", "nodes expected", registry=r)
        self.stragglers = Counter("mosaic_barrier_stragglers", "straggler reports: members a round was released "
                                  "without (at its deadline)", registry=r)
        self.dropped = Counter("mosaic_barrier_dropped", "members dropped from the run", registry=r)
        self.left = Counter("mosaic_barrier_left", "members that said they leave (a signal, or an error they "
                            "could not go on after)", registry=r)
        self.joined = Counter("mosaic_barrier_joined", "members that joined during the run (came back after a "
                              "restart or a drop, or joined late)", registry=r)
        self.round_s = Histogram("mosaic_barrier_round_seconds", "seconds between consecutive round releases",
                                 buckets=SECONDS_BUCKETS, registry=r)
        self.info = Info("mosaic_run", "the run: its id, task and the task metric the _metric gauges hold",
                         registry=r)
        self._evaluation = _Evaluation()
        r.register(self._evaluation)
        self._run_info = {"run_id": run.run_id, "task": str(run.task)} if run is not None else {}
        self.info.info({**self._run_info, "metric": "", "higher_is_better": ""})
        self._last: float | None = None
        self._dropped: set[int] = set()

    def released(self, release: Release, now: float) -> None:
        if self._last is not None:
            self.round_s.observe(now - self._last)
        self._last = now
        self.round.set(release.round + 1)
        self.members.set(len(release.members))
        self.stragglers.inc(len(release.stragglers))
        self.dropped.inc(len(set(release.dropped) - self._dropped))  # a member can be dropped, come back, ...
        self._dropped = set(release.dropped)
        self.joined.inc(len(release.joined))

    def evaluated(self, row: dict[str, Any]) -> None:
        self._evaluation.row = dict(row)
        if isinstance(row.get("metric"), str):
            better = row.get("higher_is_better")
            self.info.info({**self._run_info, "metric": row["metric"],
                            "higher_is_better": "" if better is None else str(bool(better)).lower()})
