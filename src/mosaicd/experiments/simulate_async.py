"""`mosaicd simulate --sync async`: asynchronous nodes on a virtual clock (`mosaic_proto.async_network`).

Every node is an `AsyncNodeState`; `AsyncNetwork` runs them as discrete events timed by --node-profile (each
iteration takes slowdown x compute_s seconds; each node's link its bandwidth and latency; without a profile every
node is of slowdown 1 on an unlimited link, and compute_s is 1 s). The run ends when every node has done --rounds
iterations of its own, or has spent its --time-budget (virtual seconds: it starts no iteration from then on),
and every message has arrived.

Evaluation is on a grid of virtual time: every --eval-every x compute_s seconds (the time an unslowed node takes
for --eval-every iterations) up to the --time-budget, and at the end. A rounds.csv row's `virtual_s` is its time,
and its `round` the iterations an unslowed node has done by then, less one (so an unprofiled run's rows are
numbered as a barrier run's: its last is round --rounds - 1); nodes.csv holds one row per node and iteration
(`round`: the node's own step). The same seed and settings give the same models, bit for bit.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mosaic_proto import NodeReport
from mosaic_proto.async_network import AsyncNetwork
from mosaic_proto.async_node import AsyncNodeState, Iteration
from mosaic_proto.profiles import DEFAULT_COMPUTE_S
from mosaicd.experiments.resume import check_settings, cut_back
from mosaicd.files import replacing
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import Task, build_task
from mosaicd.outputs import (
    LISTED_NODES,
    NPZ_READ_ERRORS,
    RunRecorder,
    honest_nodes,
    robustness_summary,
    stopped_summary,
)
from mosaicd.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.protocol import async_node_state, node_profiles, nominal_iterations, profile_spec
from mosaicd.rundir import SIMULATE_CHECKPOINT, read_summary
from mosaicd.settings import Settings, SettingsError


def async_states(settings: Settings, task: Task) -> list[AsyncNodeState]:
    """Every node's state at the start of an asynchronous run (pairwise: one fragment, a sampler of fanout 1)."""
    run = settings.run_config()
    # the simulator's messages are all honest: none is refused as unplanned
    return [async_node_state(run, task, i, planned_only=False, max_norm=settings.max_norm) for i in range(run.nodes)]


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
                   task: Task | None, resumed: Resumed | None = None) -> dict[str, Any]:
    """The run from its start, or from `resumed` (`resume_point`: the checkpoint's network, grid point and the
    nodes' training state, the CSVs already cut back to it)."""
    if task is None or task.run != settings.run_config():
        task = build_task(settings)
    run = settings.run_config()
    spec = profile_spec(run)
    compute_s = spec.compute_s if spec is not None else DEFAULT_COMPUTE_S
    iterations = _Iterations()
    train = task.train if settings.train else None
    if resumed is not None and resumed.network is not None:
        network = AsyncNetwork.resumed(resumed.network, train, iterations)
        for node, state in resumed.trained.items():
            task.load_node_state(node, state)
        grid = resumed.grid
    else:
        network = AsyncNetwork(async_states(settings, task), train, node_profiles(run) or (), compute_s, iterations)
        grid = 0
    step = settings.eval_every * compute_s
    saver = _GridSaver(settings, grid)
    total = nominal_iterations(run)
    with ProgressPrinter(enabled=progress) as printer:
        printer.message(f"run folder {settings.out}")
        printer.start_run("", total)
        while True:
            until = (grid + 1) * step if step > 0 else math.inf
            if run.time_budget is not None and until > run.time_budget:  # the grid ends with the budget
                until = math.inf
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
            done = RoundProgress(min(nominal, total - 1), total, loss, row)
            printer.on_round(done)
            if on_round is not None:
                on_round(done)
            if network.done:
                break
            if saver.due(grid):
                save(Path(settings.out), network, grid, task, settings, recorder.started)
                saver.saved(grid)
    states = network.states
    steps = {str(i): s.step for i, s in enumerate(states)}
    listed = run.nodes <= LISTED_NODES
    (Path(settings.out) / SIMULATE_CHECKPOINT).unlink(missing_ok=True)  # a finished run is not continued
    return recorder.finish({i: s.vector for i, s in enumerate(states)}, members=list(range(run.nodes)),
                           dropped=[], events=[], virtual_s=round(network.now, 6),
                           asynchronous={"steps": steps if listed else {},
                                         "finished_at": {str(i): round(t, 6) for i, t in
                                                         sorted(network.finished_at.items())} if listed else {},
                                         **stopped_summary({i: s.stopped_by for i, s in enumerate(states)}, listed),
                                         "messages_delivered": network.delivered,
                                         "fragments_superseded": sum(s.queue.superseded for s in states),
                                         "fragments_stale": sum(s.counts["stale"] for s in states),
                                         "refused_out_of_range": sum(s.counts["out_of_range"] for s in states)},
                           **robustness_summary(run))


# -- checkpoints: Ctrl-C then --resume ends with the uninterrupted run's models, bit for bit ----------------------

VERSION = 4  # 2: a node keeps --async-send (`AsyncNodeState.send`); 3: its --time-budget and what stopped it;
# 4: its --max-norm and what it refused by it
CSV_FILES = ("rounds.csv", "nodes.csv")


class _GridSaver:
    """When to checkpoint, at a point of the evaluation grid (the only place the DES stops between events): after
    --checkpoint-rounds iterations of an unslowed node (grid points of --eval-every), or --checkpoint-seconds after
    the last save, whichever comes first; never with --checkpoint-rounds 0 or --eval-every 0."""

    def __init__(self, settings: Settings, grid: int) -> None:
        self.rounds, self.seconds, self.eval_every = settings.checkpoint_rounds, settings.checkpoint_seconds, \
            settings.eval_every
        self.last_grid, self.last_at = grid, time.monotonic()

    def due(self, grid: int) -> bool:
        if self.rounds == 0 or self.eval_every == 0:
            return False
        return (grid - self.last_grid) * self.eval_every >= self.rounds or \
            (self.seconds > 0 and time.monotonic() - self.last_at >= self.seconds)

    def saved(self, grid: int) -> None:
        self.last_grid, self.last_at = grid, time.monotonic()


@dataclass(frozen=True)
class Resumed:
    """Where a resumed asynchronous simulation goes on: `network` None means from the start (no checkpoint)."""

    started: float  # the wall-clock start of the run it continues
    grid: int = 0  # the grid points done
    network: dict[str, Any] | None = None  # `AsyncNetwork.saved()`
    trained: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # node -> `Task.node_state`


def save(out: Path, network: AsyncNetwork, grid: int, task: Task, settings: Settings, started: float) -> None:
    """Checkpoint the simulation at grid point `grid` (its rows written): OUT/simulate-checkpoint.npz, replaced
    atomically, the network's state pickled (`AsyncNetwork.saved`) and read back by `_Unpickler` alone."""
    meta = {"version": VERSION, "sync": "async", "settings": settings.model_dump(mode="json"), "started": started,
            "grid": grid, "sizes": {name: (out / name).stat().st_size for name in CSV_FILES}}
    trained = {node: task.node_state(node) for node in range(settings.nodes)} if settings.train else {}
    meta["trained"] = {str(node): sorted(state) for node, state in trained.items() if state}
    arrays = {f"trained_{node}_{key}": np.asarray(values) for node, state in trained.items()
              for key, values in state.items()}
    blob = np.frombuffer(pickle.dumps(network.saved(), protocol=5), np.uint8)
    with replacing(out / SIMULATE_CHECKPOINT, durable=True) as f:
        np.savez(f, meta=np.array(json.dumps(meta)), network=blob, **arrays)


class _Unpickler(pickle.Unpickler):
    """Only the classes an `AsyncNetwork` is made of: the protocol's, numpy's arrays, `collections.Counter`."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in ("mosaic_proto", "numpy") or (module, name) == ("collections", "Counter"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of an asynchronous simulation's state")


def resume_point(out: Path, settings: Settings) -> Resumed:
    """Where `simulate --sync async --resume` goes on in OUT: the checkpoint, its settings checked against
    `settings` (a refusal changes no file), then the CSVs cut back to what it had written."""
    path = out / SIMULATE_CHECKPOINT
    summary = read_summary(out) or {}
    if not path.exists():
        check_settings(out, summary.get("settings") or {}, settings)
        cut_back(out, None)
        return Resumed(time.time())
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("version") != VERSION or meta.get("sync") != "async":
                raise ValueError("not an asynchronous simulation's checkpoint of this version")
            network = _Unpickler(io.BytesIO(data["network"].tobytes())).load()
            trained = {int(node): {key: data[f"trained_{node}_{key}"] for key in keys}
                       for node, keys in meta.get("trained", {}).items()}
    except (*NPZ_READ_ERRORS, pickle.UnpicklingError) as exc:
        raise SettingsError(f"--resume: {path} cannot be read ({exc}): start afresh with --replace") from None
    check_settings(out, meta["settings"], settings)
    cut_back(out, {name: int(meta["sizes"][name]) for name in CSV_FILES})
    return Resumed(float(meta["started"]), int(meta["grid"]), network, trained)
