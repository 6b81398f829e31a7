"""What `mosaicd simulate --resume` continues from: OUT/simulate-checkpoint.npz.

Every draw of a run is keyed by (seed, purpose, round, node, ...), so a simulation is a function of its settings
and of the state between two rounds: every node's model, the `InMemoryNetwork`'s round, members and virtual
clock, the `BarrierState`, with a lossy --compress what each node's error feedback carries, and what each node's
training carries across rounds (`Task.node_state`: its optimizer's state). The checkpoint
holds exactly that, the settings, the run's wall-clock start and the sizes of rounds.csv and nodes.csv when it was
taken; a resumed run cuts the CSVs back to those sizes (the rows of the rounds it runs again go, so none is written
twice) and goes on, and its final models equal the uninterrupted run's bit for bit.

The file is replaced atomically (written beside, fsync'd, renamed, the folder fsync'd), so a crash leaves the
previous checkpoint or the new one. A run stopped before its first checkpoint resumes from round 0, which is the
same thing: the run's start is a function of its settings.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mosaic_proto import BarrierState, InMemoryNetwork
from mosaicd.files import replacing
from mosaicd.learning.tasks import Task
from mosaicd.outputs import NPZ_READ_ERRORS
from mosaicd.rundir import SIMULATE_CHECKPOINT, read_summary
from mosaicd.settings import OPTION_TABLES, RunConfig, Settings, SettingsError

VERSION = 1
CSV_FILES = ("rounds.csv", "nodes.csv")
# the settings a resumed run must share with the run it continues: those that change its results (--max-norm: a
# node's option, not the run's, but the bound its messages are refused by)
RESULT_FIELDS = (*RunConfig.model_fields, "batched", "max_norm")


@dataclass(frozen=True)
class Resumed:
    """Where a resumed simulation starts: None of `vectors` means round 0 (no checkpoint was taken)."""

    round: int
    clock: float
    members: list[int]
    barrier: dict[str, Any] | None
    vectors: np.ndarray | None
    started: float  # the wall-clock start of the run it continues (`time.time()`)
    redone: int     # rounds the stopped run had done past this point, run again now
    carried: dict[int, dict[str, np.ndarray]] | None = None  # node -> its compressor's state (`Compressor.state`)
    ready: dict[str, float] | None = None  # --node-profile: the virtual clock's late nodes (`VirtualClock.to_json`)
    trained: dict[int, dict[str, np.ndarray]] | None = None  # node -> its training's state (`Task.node_state`)

    def apply(self, network: InMemoryNetwork, task: Task) -> None:
        """Put `network` (built from the settings, as at round 0) and the nodes' training where the checkpoint
        left the run."""
        if self.vectors is None:
            return
        barrier = BarrierState.from_json(self.barrier, self.clock) if self.barrier is not None else None
        network.restore(list(self.vectors), self.round, self.clock, self.members, barrier)
        for node, state in (self.carried or {}).items():
            network.compressors[node].restore(state)
        for node, state in (self.trained or {}).items():
            task.load_node_state(node, state)


def save(out: Path, network: InMemoryNetwork, task: Task, settings: Settings, started: float,
         ready: dict[str, float] | None = None) -> None:
    """Checkpoint the run between two rounds (after round `network.round - 1`'s rows were written); `ready`: the
    virtual clock's state, with --node-profile."""
    meta = {"ready": ready, "version": VERSION, "settings": settings.model_dump(mode="json"), "started": started,
            "round": network.round, "clock": network.clock, "members": list(network.members),
            "barrier": network.barrier.to_json() if network.barrier is not None else None,
            "sizes": {name: (out / name).stat().st_size for name in CSV_FILES}}
    carried = {node: c.state() for node, c in network.compressors.items()}
    meta["carried"] = {str(node): sorted(state) for node, state in carried.items() if state}
    arrays = {f"carried_{node}_{key}": np.asarray(values, dtype="<f4")
              for node, state in carried.items() for key, values in state.items()}
    trained = {node: task.node_state(node) for node in range(settings.nodes)} if settings.train else {}
    meta["trained"] = {str(node): sorted(state) for node, state in trained.items() if state}
    arrays |= {f"trained_{node}_{key}": np.asarray(values) for node, state in trained.items()
               for key, values in state.items()}
    with replacing(out / SIMULATE_CHECKPOINT, durable=True) as f:  # straight to disk: no copy of it in memory
        np.savez(f, vectors=np.stack([np.asarray(v, dtype="<f4") for v in network.vectors]),
                 meta=np.array(json.dumps(meta)), **arrays)


States = dict[int, dict[str, np.ndarray]]


def _load(out: Path) -> tuple[dict[str, Any], np.ndarray, States, States] | None:
    path = out / SIMULATE_CHECKPOINT
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            vectors = data["vectors"].astype(np.float32)
            carried = {int(node): {key: data[f"carried_{node}_{key}"].astype(np.float32) for key in keys}
                       for node, keys in meta.get("carried", {}).items()}
            trained = {int(node): {key: data[f"trained_{node}_{key}"] for key in keys}
                       for node, keys in meta.get("trained", {}).items()}
    except NPZ_READ_ERRORS as exc:
        raise ValueError(f"--resume: {path} cannot be read ({exc}): start afresh with --replace") from None
    if meta.get("version") != VERSION:
        raise ValueError(f"--resume: {path} was written by another version of mosaicd: start afresh with --replace")
    return meta, vectors, carried, trained


def _flag(name: str, value: Any) -> str:
    if name in OPTION_TABLES and isinstance(value, dict):  # as given: --task-option key=value, repeated
        given = OPTION_TABLES[name]
        return " ".join(f"{given} {k}={json.dumps(v)}" for k, v in value.items()) or f"no {given}"
    return f"--{name.replace('_', '-')} {json.dumps(value) if not isinstance(value, str) else value}"


def check_settings(out: Path, saved: dict[str, Any], settings: Settings) -> None:
    """SettingsError naming the flags whose values differ from the run in OUT (and that run's values)."""
    ours = settings.model_dump(mode="json")
    differ = [k for k in RESULT_FIELDS if k in saved and saved[k] != ours.get(k)]
    if differ:
        given = ", ".join(_flag(k, ours.get(k)) for k in differ)
        theirs = " ".join(_flag(k, saved[k]) for k in differ)
        raise SettingsError(f"--resume: {out} holds run {saved.get('run_id')!r} with other settings ({given}; the "
                            f"run has {theirs}): give that run's settings to resume it, or start afresh with --replace")


def _cut(path: Path, size: int | None) -> None:
    """Cut a CSV back to `size` bytes (None: to its header line)."""
    if not path.exists():
        return
    if size is None:
        with open(path, "rb") as f:
            size = len(f.readline())
    if path.stat().st_size > size:
        os.truncate(path, size)


def cut_back(out: Path, sizes: dict[str, int] | None) -> None:
    """Cut rounds.csv and nodes.csv back to `sizes` (a checkpoint's; None: to their header lines)."""
    for name in CSV_FILES:
        _cut(out / name, None if sizes is None else sizes[name])


def resume_point(out: Path, settings: Settings) -> Resumed:
    """Where `simulate --resume` goes on in OUT (claimed by `claim_out`): the checkpoint, its settings checked
    against `settings` (a refusal changes no file), then the CSVs cut back to what it had written."""
    loaded = _load(out)
    summary = read_summary(out) or {}
    saved = loaded[0]["settings"] if loaded else summary.get("settings") or {}
    check_settings(out, saved, settings)
    progress = summary.get("progress") or {}
    done = progress.get("rounds_done") if isinstance(progress.get("rounds_done"), int) else 0
    if loaded is None:
        for name in CSV_FILES:
            _cut(out / name, None)
        return Resumed(0, 0.0, list(range(settings.nodes)), None, None, time.time(), done)
    meta, vectors, carried, trained = loaded
    for name in CSV_FILES:
        _cut(out / name, int(meta["sizes"][name]))
    return Resumed(int(meta["round"]), float(meta["clock"]), [int(m) for m in meta["members"]], meta["barrier"],
                   vectors, float(meta["started"]), max(0, done - int(meta["round"])), carried,
                   meta.get("ready"), trained)

