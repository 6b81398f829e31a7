"""`mosaicd simulate`: every node in this process, through the same `mosaic_proto` round states.

Same settings, same outputs and the same final models (bit for bit) as `mosaicd cluster`. With
`--batched` the nodes' training of a round runs together (`experiments/batched.py`): close to, not
bit-equal with, that reference.

Progress: `progress=True` shows the `ProgressPrinter` on stderr; `on_round`, when given, is called with a
`RoundProgress` after every round (its `row` is the evaluation row exactly at the evaluation rounds).

A run that fails (missing data, an exception in training or in `on_round`, Ctrl-C) leaves summary.json with
"status": "failed", the one-line error and the rounds evaluated until then, and the exception propagates.

The run's folder is claimed first (`rundir.claim_out`: a fresh one without --out; another run's is refused unless
`resume` or `replace` says what to do with it). Every `--checkpoint-rounds` rounds (or `--checkpoint-seconds`) the
run saves what `resume` continues from (`experiments/resume.py`), so a stopped run loses at most those rounds and
a resumed one ends with the same models, bit for bit, as if it had never stopped.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mosaic_proto import BarrierState, Fragmentation, InMemoryNetwork, NodeReport, PeerSampler
from mosaic_proto.compression import Compression
from mosaic_proto.network import RoundRecord
from mosaic_proto.profiles import RoundPlan, VirtualClock
from mosaicd.experiments import resume as checkpoint
from mosaicd.experiments.batched import BatchedTraining
from mosaicd.experiments.simulate_async import resume_point as async_resume_point
from mosaicd.experiments.simulate_async import simulate_async
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import Task, build_task, check_requirements
from mosaicd.outputs import RunRecorder, failure_text, honest_nodes, is_eval_round, robustness_summary
from mosaicd.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.protocol import aggregator_rule, attack_of, byzantine_ranks, compressor_of, node_profiles, profile_spec
from mosaicd.rundir import SIMULATE_CHECKPOINT, claim_out, read_summary, release
from mosaicd.settings import RunConfig, Settings


def run_simulation(settings: Settings, progress: bool = True, on_round: OnRound | None = None, *,
                   resume: bool = False, replace: bool = False, advise: bool = True, task: Task | None = None) -> dict:
    """Run the simulation to its end; summary.json's content. `resume`: continue the unfinished run in --out;
    `replace`: remove the run that --out holds first (see `claim_out`: nothing is written before it agrees).
    `advise`: a run that stops says on stderr how to go on with it, --quiet or not (a sweep says it instead).
    `task`: the run's task already built (`check_task`'s: a user's data is not loaded twice), else built here."""
    if task is None:  # a run that cannot start leaves no folder, as `cluster`'s does not
        check_requirements(settings.task, settings.data_dir)
    given = settings.out if "out" in settings.model_fields_set else None
    out = claim_out(given, "simulate", resume=resume, replace=replace, run_id=settings.run_id)
    try:
        with _fewer_collections():
            return _run(settings.model_copy(update={"out": out}), progress, on_round, resume, advise, task)
    finally:
        release(out)


# new container objects between two young collections while a simulation runs (CPython's default is 700)
YOUNG_OBJECTS = 10_000


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """The cyclic collector's young threshold raised to YOUNG_OBJECTS for the run, then set back. Torch's import makes
    a few hundred thousand objects that live as long as the process, and with CPython's default each older collection
    scanned them again: several percent of a `--batched` run's CPU (bench/README.md, issue 59). A run's garbage is
    acyclic but for a few objects, which wait a little longer."""
    before = gc.get_threshold()
    gc.set_threshold(max(YOUNG_OBJECTS, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _run(settings: Settings, progress: bool, on_round: OnRound | None, resume: bool, advise: bool,
         task: Task | None) -> dict:
    out = settings.out
    asynchronous = settings.sync == "async"  # no rounds: a discrete-event simulation (docs/spec.md, Asynchronous mode)
    start = checkpoint.resume_point(out, settings) if resume and not asynchronous else None
    resumed = async_resume_point(out, settings) if resume and asynchronous else None
    def open_outputs() -> RunRecorder:
        began = start.started if start else resumed.started if resumed else None
        return RunRecorder(out, settings, mode="simulate", resume_from=began)

    recorder = None
    try:
        recorder = open_outputs()
        if asynchronous:
            return simulate_async(settings, recorder, progress, on_round, task, resumed)
        return _simulate(settings, recorder, progress, on_round, start, task)
    except BaseException as exc:
        if recorder is None and isinstance(exc, KeyboardInterrupt):  # Ctrl-C while its files were being made
            recorder = open_outputs()
        elif recorder is None:
            raise
        recorder.fail(failure_text(exc))
        # a run that got going, or was stopped by the user at any point; one that could not start says why instead
        if advise and (isinstance(exc, KeyboardInterrupt) or recorder.rounds_done > 0
                       or (out / SIMULATE_CHECKPOINT).exists()):
            _say_unfinished(out)
        raise


def _say_unfinished(out: Path) -> None:
    """The end of a run that stopped: how to go on with it."""
    summary = read_summary(out) or {}
    done = (summary.get("progress") or {}).get("rounds_done")
    saved = " from its last checkpoint" if (out / SIMULATE_CHECKPOINT).exists() else " from round 0"
    print(f"mosaicd simulate: {out}: the run stopped with {done} of {summary.get('settings', {}).get('rounds')} rounds "
          "done; "
          f"the same command with --resume continues it{saved} (--out {out})", file=sys.stderr)


def _planned_bytes(run: RunConfig, fragmentation: Fragmentation) -> int:
    """What a node sends a round, for the virtual clock: each fragment to s receivers, as --compress carries its
    values (float32 without it; message framing left out)."""
    codec = Compression.parse(run.compress)
    return run.fanout * sum(codec.compress(np.zeros(size, np.float32), seed=0, round=0, node=0, fragment=0).nbytes
                            for size in fragmentation.sizes)


def _timings(plan: RoundPlan | None, node: int, each_s: float, released: float) -> dict[str, float]:
    """A node's phase seconds in nodes.csv: on the virtual clock with --node-profile (train, send, and the wait
    until the release), else its share of the round's measured time as its training."""
    if plan is None:
        return {"train_s": each_s}
    timing = plan.nodes[node]
    return {"train_s": round(timing.train_s, 6), "send_s": round(timing.send_s, 6),
            "wait_s": round(released - timing.arrival, 6)}


class _Saver:
    """When to checkpoint: after every `checkpoint_rounds` rounds, or a round ending `checkpoint_seconds` after
    the last save, whichever comes first; never after the last round (the run is then finished)."""

    def __init__(self, settings: Settings, round: int) -> None:
        self.every, self.every_s, self.rounds = settings.checkpoint_rounds, settings.checkpoint_seconds, settings.rounds
        self.round, self.at = round, time.monotonic()

    def due(self, round: int) -> bool:
        if self.every == 0 or round >= self.rounds:
            return False
        return round - self.round >= self.every or (self.every_s > 0 and time.monotonic() - self.at >= self.every_s)

    def saved(self, round: int) -> None:
        self.round, self.at = round, time.monotonic()


def _simulate(settings: Settings, recorder: RunRecorder, progress: bool, on_round: OnRound | None,
              start: checkpoint.Resumed | None, task: Task | None) -> dict:
    if task is None or task.run != settings.run_config():
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
    attacks = {i: attack_of(run, i) for i in byzantine_ranks(run)}
    network = InMemoryNetwork(vectors, fragmentation, sampler, train, run_id=settings.run_id, barrier=barrier,
                              aggregator=aggregator_rule(run), attacks=attacks, max_norm=settings.max_norm,
                              compressors={i: compressor_of(run, i) for i in range(settings.nodes)})
    spec, profiles = profile_spec(run), node_profiles(run)
    clock = VirtualClock(profiles, spec.compute_s, settings.round_deadline) if spec and profiles else None
    planned = _planned_bytes(run, fragmentation) if clock is not None else 0
    if start is not None:
        start.apply(network, task)
        if clock is not None and start.ready:
            clock.restore(start.ready)
    saver = _Saver(settings, network.round)
    with ProgressPrinter(enabled=progress) as printer:
        printer.message(f"run folder {settings.out}")
        if start is not None:
            again = f"; {start.redone} round{'s' * (start.redone != 1)} after it run again" if start.redone else ""
            printer.message(f"resuming with {network.round} of {settings.rounds} rounds done (" + (
                "its checkpoint" if network.round else "no checkpoint was saved: from the start") + f"{again})")
        printer.start_run("", settings.rounds)
        for _ in range(network.round, settings.rounds):
            started = time.perf_counter()
            if batched is not None:
                batched.prepare(network)
            plan = clock.plan(network.clock, network.members, planned) if clock is not None else None
            record: RoundRecord = network.step(absent=plan.late, arrivals=plan.arrivals) if plan else network.step()
            if clock is not None and plan is not None:
                clock.released(plan, network.clock)
            elapsed = time.perf_counter() - started
            each_s = elapsed / len(record.nodes)
            rows = zip(record.nodes, record.losses, record.reports, strict=True)
            recorder.node_rounds((node, NodeReport.of_traffic(report, loss=loss, **_timings(plan, node, each_s,
                                                                                             network.clock)))
                                 for node, loss, report in rows)
            row = None
            if is_eval_round(record.round, settings):
                taken_at = time.time()
                honest, says = honest_nodes(run, network.members)
                live = [network.vectors[i] for i in honest]
                virtual = {"virtual_s": round(network.clock, 6)} if clock is not None else {}
                row = recorder.network_round(record.round, {**network_metrics(task, live), "nodes": honest, **says,
                                                            **virtual}, taken_at)
            if saver.due(network.round):
                checkpoint.save(settings.out, network, task, settings, recorder.started,
                                clock.to_json() if clock is not None else None)
                saver.saved(network.round)
            losses = [x for x in record.losses if math.isfinite(x)]
            done = RoundProgress(record.round, settings.rounds, sum(losses) / len(losses) if losses else None, row)
            printer.on_round(done)
            if on_round is not None:
                on_round(done)
    final = network.finish()
    assert final is not None and final.finished and network.barrier is not None
    summary = recorder.finish({i: network.vectors[i] for i in network.members}, members=network.members,
                              dropped=list(final.dropped), events=[e.to_json() for e in network.barrier.events],
                              **robustness_summary(run))
    (settings.out / SIMULATE_CHECKPOINT).unlink(missing_ok=True)  # a finished run is not continued
    return summary
