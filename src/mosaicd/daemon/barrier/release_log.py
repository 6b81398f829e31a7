"""What the barrier writes down when it releases a round: the round's node rows, its history entry (for
/v1/history and the dashboard), its metrics and its log line."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from mosaic_proto import NodeReport, Release, received_counts
from mosaicd.daemon.barrier.metrics import BarrierMetrics
from mosaicd.outputs import SUMMARY_KEYS, RunRecorder

HISTORY_KEPT = 2000  # released rounds /v1/history serves (the newest), and so the dashboard
Arrivals = dict[int, tuple[float, NodeReport | None]]  # rank -> (seconds it waited, its report)


def refusals(closed: Arrivals) -> dict[str, int]:
    """The round's refusals by reason, summed over the members' reports (messages refused, fragments cut)."""
    total: Counter[str] = Counter()
    for _, report in closed.values():
        total.update(report.refused if report else {})
    return dict(sorted((+total).items()))


def phase_means(closed: Arrivals) -> dict[str, float]:
    """Mean seconds per phase over the members that arrived: train, send, aggregate (their reports), wait (the
    barrier's clock); and their mean training loss (the console's round line)."""
    seconds: dict[str, list[float]] = {"train": [], "send": [], "wait": [], "aggregate": []}
    for wait, report in closed.values():
        seconds["wait"].append(wait)
        if report is not None:
            for phase in ("train", "send", "aggregate"):
                seconds[phase].append(getattr(report, f"{phase}_s"))
    means = {f"{phase}_s": round(float(np.mean(v)), 6) for phase, v in seconds.items() if v}
    losses = [r.loss for _, r in closed.values() if r is not None and r.loss is not None and np.isfinite(r.loss)]
    return {**means, "loss": float(np.mean(losses))} if losses else means


class ReleaseLog:
    def __init__(self, recorder: RunRecorder, metrics: BarrierMetrics, log: Any) -> None:
        self.recorder, self.metrics, self.log = recorder, metrics, log
        self.history: list[dict[str, Any]] = []
        self._released_at: float | None = None
        self._logged_eval: int | None = None

    def record(self, release: Release, closed: Arrivals, now: float,
               latest: dict[str, Any] | None) -> None:
        """`closed`: the round's arrivals, rank -> (seconds waited, report); `latest`: the newest evaluation row."""
        received = received_counts({r: report for r, (_, report) in closed.items()})
        def row(rank: int, wait_s: float, report: NodeReport) -> tuple[int, NodeReport]:
            messages, fragments, nbytes = received.get(rank, (0, 0, 0))
            return rank, report.with_release(round(wait_s, 6), (), messages_in=messages, fragments_in=fragments,
                                             bytes_in=nbytes)
        if not release.finished:
            self.recorder.node_rounds(row(rank, wait_s, report) for rank, (wait_s, report) in closed.items()
                                      if report is not None)
        duration = now - self._released_at if self._released_at is not None else None
        self._released_at = now
        self.history.append({"round": release.round, "duration_s": None if duration is None else round(duration, 6),
                             **phase_means(closed), "members": len(release.members),
                             "stragglers": list(release.stragglers), "dropped": list(release.dropped),
                             "refused": refusals(closed),
                             **{k: list(v) for k, v in (("left", release.left), ("joined", release.joined)) if v}})
        if len(self.history) > 2 * HISTORY_KEPT:  # memory stays flat in long runs; /v1/history serves fewer
            del self.history[:-HISTORY_KEPT]
        self.metrics.released(release, now)
        news = {}
        if latest and latest.get("round") != self._logged_eval:
            self._logged_eval = latest.get("round")
            news = {"evaluated_round": self._logged_eval, **{k: latest.get(k) for k in SUMMARY_KEYS}}
        log = self.log.warning if release.stragglers else self.log.info
        log("released", round=release.round, duration_s=self.history[-1]["duration_s"], members=len(release.members),
            stragglers=list(release.stragglers), dropped=list(release.dropped), finished=release.finished,
            **({"joined": list(release.joined)} if release.joined else {}), **news)
