"""`mosaicd simulate`: every node in this process, through the same `mosaic_proto` round states.

Same settings, same outputs and the same final models (bit for bit) as `mosaicd cluster`. With
`--batched` the nodes' training of a round runs together (`experiments/batched.py`): close to, not
bit-equal with, that reference.

Progress: `progress=True` shows the `ProgressPrinter` on stderr; `on_round`, when given, is called with a
`RoundProgress` after every round (its `row` is the evaluation row exactly at the evaluation rounds).

A run that fails (missing data, an exception in training or in `on_round`, Ctrl-C) leaves summary.json with
"status": "failed", the one-line error and the rounds evaluated until then, and the exception propagates.
"""

from __future__ import annotations

import math
import time

from mosaic_proto import BarrierState, Fragmentation, InMemoryNetwork, NodeReport, PeerSampler
from mosaic_proto.network import RoundRecord
from mosaicd.experiments.batched import BatchedTraining
from mosaicd.experiments.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import build_task
from mosaicd.outputs import RunRecorder, failure_text, honest_nodes, is_eval_round, robustness_summary
from mosaicd.settings import Settings


def run_simulation(settings: Settings, progress: bool = True, on_round: OnRound | None = None) -> dict:
    recorder = RunRecorder(settings.out, settings, mode="simulate")
    try:
        return _simulate(settings, recorder, progress, on_round)
    except BaseException as exc:
        recorder.fail(failure_text(exc))
        raise


def _simulate(settings: Settings, recorder: RunRecorder, progress: bool, on_round: OnRound | None) -> dict:
    task = build_task(settings)
    fragmentation = Fragmentation.build(task.layout, settings.fragments, settings.seed, settings.strategy)
    sampler = PeerSampler(settings.sampler, settings.fanout, settings.seed)
    vectors = [task.initial(i) for i in range(settings.nodes)]
    barrier = BarrierState(rounds=settings.rounds, round_deadline=settings.round_deadline,
                           drop_after=settings.drop_after, expected=settings.nodes,
                           min_members=settings.run_config().min_members)
    batched = BatchedTraining(task) if settings.batched and settings.train else None
    train = (batched or task.train) if settings.train else None
    run = settings.run_config()
    attacks = {i: run.attack_of(i) for i in run.byzantine_ranks()}
    network = InMemoryNetwork(vectors, fragmentation, sampler, train, run_id=settings.run_id, barrier=barrier,
                              aggregator=run.aggregator_rule(), attacks=attacks)
    with ProgressPrinter(enabled=progress) as printer:
        printer.start_run("", settings.rounds)
        for _ in range(settings.rounds):
            started = time.perf_counter()
            if batched is not None:
                batched.prepare(network)
            record: RoundRecord = network.step()
            elapsed = time.perf_counter() - started
            for node, loss, report in zip(record.nodes, record.losses, record.reports, strict=True):
                recorder.node_round(node, NodeReport.of_traffic(report, loss=loss,
                                                                train_s=elapsed / len(record.nodes)))
            row = None
            if is_eval_round(record.round, settings):
                taken_at = time.time()
                honest, says = honest_nodes(run, network.members)
                live = [network.vectors[i] for i in honest]
                row = recorder.network_round(record.round, {**network_metrics(task, live), "nodes": honest, **says},
                                             taken_at)
            losses = [x for x in record.losses if math.isfinite(x)]
            done = RoundProgress(record.round, settings.rounds, sum(losses) / len(losses) if losses else None, row)
            printer.on_round(done)
            if on_round is not None:
                on_round(done)
    final = network.finish()
    assert final is not None and final.finished
    return recorder.finish({i: network.vectors[i] for i in network.members}, members=network.members,
                           dropped=list(final.dropped), events=[e.to_json() for e in barrier.events],
                           **robustness_summary(run))
