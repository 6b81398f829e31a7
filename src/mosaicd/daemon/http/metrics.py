"""What both roles' Prometheus registries have alike: the `process_*` metrics, the event loop's task count and the
seconds buckets of their histograms (the node's round phases, the barrier's rounds)."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector

__all__ = ["SECONDS_BUCKETS", "asyncio_tasks", "member_registry"]

# from a millisecond (protocol-only rounds on loopback) to minutes (a CIFAR epoch on CPU, a long barrier wait)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0, 600.0)


def asyncio_tasks() -> float:
    """Tasks of the event loop that serves the scrape (NaN off a loop): a leak of tasks shows as a count that
    rises with the rounds (bench/soak.py)."""
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:
        return math.nan


def member_registry() -> CollectorRegistry:
    """A new registry for one member's /metrics (`http/endpoints.py` serves it without `_created` series), holding
    the metrics every member has: the `process_*` ones and `mosaic_asyncio_tasks`."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    Gauge("mosaic_asyncio_tasks", "asyncio tasks of the daemon's event loop", registry=registry).set_function(
        asyncio_tasks)
    return registry
