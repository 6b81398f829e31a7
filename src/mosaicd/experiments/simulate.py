"""`mosaicd simulate`: every node in this process, through the same `mosaic_proto` round states.

Same settings, same outputs and the same final models (bit for bit) as `mosaicd cluster`.

Progress: `progress=True` shows the `ProgressPrinter` on stderr; `on_round`, when given, is called with a
`RoundProgress` after every round (its `row` is the evaluation row exactly at the evaluation rounds).
"""

from __future__ import annotations

import math
import time

from mosaic_proto import Fragmentation, InMemoryNetwork, PeerSampler
from mosaic_proto.network import RoundRecord
from mosaicd.experiments.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import build_task
from mosaicd.outputs import RunRecorder, is_eval_round
from mosaicd.settings import Settings


def run_simulation(settings: Settings, progress: bool = True, on_round: OnRound | None = None) -> dict:
    task = build_task(settings)
    fragmentation = Fragmentation.build(task.layout, settings.fragments, settings.seed, settings.strategy)
    sampler = PeerSampler(settings.sampler, settings.fanout, settings.seed)
    vectors = [task.initial(i) for i in range(settings.nodes)]
    network = InMemoryNetwork(vectors, fragmentation, sampler, task.train if settings.train else None,
                              run_id=settings.run_id)
    recorder = RunRecorder(settings.out, settings, mode="simulate")
    with ProgressPrinter(enabled=progress) as printer:
        printer.start_run("", settings.rounds)
        for _ in range(settings.rounds):
            started = time.perf_counter()
            record: RoundRecord = network.step()
            elapsed = time.perf_counter() - started
            for node, (loss, report) in enumerate(zip(record.losses, record.reports, strict=True)):
                recorder.node_round({**report.to_json(), "node": node, "loss": loss,
                                     "train_s": elapsed / settings.nodes})
            row = None
            if is_eval_round(record.round, settings):
                taken_at = time.time()
                row = recorder.network_round(record.round, {**network_metrics(task, network.vectors),
                                                            "nodes": network.members}, taken_at)
            losses = [x for x in record.losses if math.isfinite(x)]
            done = RoundProgress(record.round, settings.rounds, sum(losses) / len(losses) if losses else None, row)
            printer.on_round(done)
            if on_round is not None:
                on_round(done)
    return recorder.finish(dict(enumerate(network.vectors)), members=network.members, dropped=[])
