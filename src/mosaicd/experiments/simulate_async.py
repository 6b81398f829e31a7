"""`mosaicd simulate --sync async`: asynchronous nodes on a virtual clock (`mosaic_proto.async_network`).

Every node is an `AsyncNodeState`; `AsyncNetwork` runs them as discrete events timed by --node-profile (each
iteration takes slowdown x compute_s seconds; each node's link its bandwidth and latency; without a profile every
node is of slowdown 1 on an unlimited link, and compute_s is 1 s). The run ends when every node has done --rounds
iterations of its own and every message has arrived.

Evaluation is on a grid of virtual time: every --eval-every x compute_s seconds (the time an unslowed node takes
for --eval-every iterations), and at the end. A rounds.csv row's `virtual_s` is its time, and its `round` the
iterations an unslowed node has done by then, less one (so an unprofiled run's rows are numbered as a barrier run's:
its last is round --rounds - 1); nodes.csv holds one row per node and iteration (`round`: the node's own step).
The same seed and settings give the same models, bit for bit.
"""

from __future__ import annotations

import math
import time
from typing import Any

from mosaic_proto import NodeReport
from mosaic_proto.async_network import AsyncNetwork
from mosaic_proto.async_node import AsyncNodeState, Iteration
from mosaic_proto.profiles import DEFAULT_COMPUTE_S
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import Task, build_task
from mosaicd.outputs import RunRecorder, honest_nodes, robustness_summary
from mosaicd.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.protocol import async_node_state, node_profiles, profile_spec
from mosaicd.settings import Settings


def async_states(settings: Settings, task: Task) -> list[AsyncNodeState]:
    """Every node's state at the start of an asynchronous run (pairwise: one fragment, a sampler of fanout 1)."""
    run = settings.run_config()
    return [async_node_state(run, task, i, planned_only=False) for i in range(run.nodes)]  # honest: none refused


class _Iterations:
    """The nodes' iterations as they end: nodes.csv rows, written at each evaluation."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, NodeReport]] = []
        self.losses: list[float] = []

    def __call__(self, node: int, iteration: Iteration, loss: float, train_s: float, now: float) -> None:
        self.rows.append((node, NodeReport.of_traffic(iteration.report, loss=loss, train_s=round(train_s, 6))))
        if math.isfinite(loss):
            self.losses.append(loss)

    def flush(self, recorder: RunRecorder) -> float | None:
        """Write the rows; the mean loss of the iterations since the last flush (None: none)."""
        recorder.node_rounds(self.rows)
        mean = sum(self.losses) / len(self.losses) if self.losses else None
        self.rows, self.losses = [], []
        return mean


def simulate_async(settings: Settings, recorder: RunRecorder, progress: bool, on_round: OnRound | None,
                   task: Task | None) -> dict[str, Any]:
    if task is None or task.run != settings.run_config():
        task = build_task(settings)
    run = settings.run_config()
    spec = profile_spec(run)
    compute_s = spec.compute_s if spec is not None else DEFAULT_COMPUTE_S
    iterations = _Iterations()
    train = task.train if settings.train else None
    network = AsyncNetwork(async_states(settings, task), train, node_profiles(run) or (), compute_s, iterations)
    step = settings.eval_every * compute_s
    grid = 0
    with ProgressPrinter(enabled=progress) as printer:
        printer.message(f"run folder {settings.out}")
        printer.start_run("", settings.rounds)
        while True:
            until = (grid + 1) * step if step > 0 else math.inf
            network.run_until(until)
            if network.done:  # the end: a row of its own (on the grid's point where it falls on one)
                at, nominal = network.now, max(math.ceil(network.now / compute_s - 1e-9) - 1, 0)
            else:
                at, nominal, grid = until, (grid + 1) * settings.eval_every - 1, grid + 1
            loss = iterations.flush(recorder)
            honest, says = honest_nodes(run, range(run.nodes))
            live = [network.vectors[i] for i in honest]
            row = recorder.network_round(nominal, {**network_metrics(task, live), "nodes": honest, **says,
                                                   "virtual_s": round(at, 6)}, time.time())
            done = RoundProgress(min(nominal, settings.rounds - 1), settings.rounds, loss, row)
            printer.on_round(done)
            if on_round is not None:
                on_round(done)
            if network.done:
                break
    states = network.states
    steps = {str(i): s.step for i, s in enumerate(states)}
    return recorder.finish({i: s.vector for i, s in enumerate(states)}, members=list(range(run.nodes)),
                           dropped=[], events=[], virtual_s=round(network.now, 6),
                           asynchronous={"steps": steps if run.nodes <= 1000 else {},
                                         "finished_at": {str(i): round(t, 6) for i, t in
                                                         sorted(network.finished_at.items())} if run.nodes <= 1000
                                         else {},
                                         "messages_delivered": network.delivered,
                                         "fragments_superseded": sum(s.queue.superseded for s in states),
                                         "fragments_stale": sum(s.counts["stale"] for s in states)},
                           **robustness_summary(run))
