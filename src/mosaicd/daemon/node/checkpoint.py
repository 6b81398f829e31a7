"""A node's checkpoint: its model after a round, and which round it goes on with, so that a node started again
with the same state directory rejoins the run where it left off.

STATE_DIR/checkpoint-{0,1,2}.npz: three slots, each rewritten in place in turn (the one written longest ago, or one
that cannot be read), fsync'd. The two written last are whole whatever a crash cuts (a torn slot fails the zip's
CRC and is passed over), so a whole cluster resumed exactly can go on from the newest round every node has
(`mosaicd cluster --resume`), which can be the one before a node's newest. Rewriting a file in place keeps its
blocks and cached pages, which a new file renamed over the old one gives up (bench/README.md, Speed 4, measures
both). Each slot's meta says its round and when it was written (`written`, counting up).
With a lossy --compress it also holds what the node's error feedback carries (`carried`, `Compressor.state`), so
that a resumed node sends what it would have sent, and what its training carries across rounds (`trained`,
`Task.node_state`: an optimizer's moments), so that it steps as it would have stepped. The single files of earlier
versions (checkpoint.npz, checkpoint-previous.npz) are still read, as older than any slot.

STATE_DIR/member.json: the run and rank the node registered as (`note_member`), written at registration even
without checkpoints (--checkpoint-every 0, or a node killed in round 0): started again, a node that finds it knows
it came back (`was_member`), so it refuses its peers' fragments at once instead of holding them. An asynchronous
node with a --time-budget notes there too when it passed the start's barrier (`started`, the wall clock): started
again, it counts its budget from the run's start, not from its own.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npy

from mosaicd.daemon.http.membership import own_address
from mosaicd.files import write_whole
from mosaicd.logs import get_logger
from mosaicd.outputs import NPZ_READ_ERRORS
from mosaicd.settings import DaemonOptions

SLOTS = tuple(f"checkpoint-{i}.npz" for i in range(3))
EARLIER = ("checkpoint.npz", "checkpoint-previous.npz")  # what versions before the slots wrote, newest first


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    rank: int
    address: str
    round: int  # the round it goes on with (its model is the one after round - 1)
    vector: np.ndarray
    carried: dict[str, np.ndarray] = field(default_factory=dict)  # its compressor's state (`Compressor.state`)
    trained: dict[str, np.ndarray] = field(default_factory=dict)  # its training's state (`Task.node_state`)


def state_dir(options: DaemonOptions) -> Path | None:
    """--state-dir, else OUT/state/<host>_<port>; None where no restart could find it again (--port 0)."""
    if options.state_dir is not None:
        return Path(options.state_dir)
    if options.port == 0:
        return None
    return Path(options.out) / "state" / own_address(options, options.port).replace(":", "_")


def save(directory: Path, checkpoint: Checkpoint) -> None:
    """Write `checkpoint` over the slot written longest ago (or a missing or unreadable one), in place."""
    Slots(directory).save(checkpoint)


class Slots:
    """One writer's view of a state directory's slots: when each was written, read from their files at the first
    save (and again after a save that failed), then kept as this writer writes them. A node saves every round: the
    three slots' metas read back each time were half of a save's CPU time (bench/README.md, issue 59 item 3). The
    one writer of its directory: another process's saves there are not seen."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._written: dict[str, int | None] | None = None

    def save(self, checkpoint: Checkpoint) -> None:
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        written = self._written if self._written is not None else {name: _written(directory / name) for name in SLOTS}
        self._written = None  # until this save is done: one that fails is read back from the files next time
        slot = min(SLOTS, key=lambda name: -1 if written[name] is None else written[name])
        count = max((w for w in written.values() if w is not None), default=-1) + 1
        meta = {"run_id": checkpoint.run_id, "rank": checkpoint.rank, "address": checkpoint.address,
                "round": checkpoint.round, "written": count}
        arrays = {"vector": np.asarray(checkpoint.vector, dtype="<f4"),
                  **{f"carried_{f}": np.asarray(v, dtype="<f4") for f, v in checkpoint.carried.items()},
                  **{f"trained_{k}": np.asarray(v) for k, v in checkpoint.trained.items()},
                  "meta": np.array(json.dumps(meta))}  # last: a slot whose new meta can be read holds its new model
        path = directory / slot
        with open(path, "r+b" if path.exists() else "wb") as f:  # not truncated first: its blocks are reused
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as archive:
                for name, array in arrays.items():
                    with archive.open(f"{name}.npy", "w", force_zip64=True) as member:  # an .npy, bytes not copied
                        npy.write_array_header_1_0(member, npy.header_data_from_array_1_0(array))
                        member.write(memoryview(np.ascontiguousarray(array)).cast("B"))
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        self._written = {**written, slot: count}


def load(directory: Path | None, round: int | None = None) -> Checkpoint | None:
    """The newest checkpoint in `directory` (`round`: the newest of that round), or None if there is none (or none
    that can be read: then it is not used)."""
    return newest(kept(directory), round)


def newest(found: list[Checkpoint], round: int | None = None) -> Checkpoint | None:
    """The first of `found` (`kept`'s order: newest first), or of round `round`."""
    return next((c for c in found if round is None or c.round == round), None)


def rounds(directory: Path, run_id: str | None = None) -> list[int]:
    """The rounds of the checkpoints kept in `directory` (`run_id`: of that run), newest first."""
    return rounds_of(kept(directory), run_id)


def rounds_of(found: list[Checkpoint], run_id: str | None = None) -> list[int]:
    """The rounds of `found` (`kept`'s checkpoints; `run_id`: of that run), in its order."""
    return [c.round for c in found if run_id is None or c.run_id == run_id]


def kept(directory: Path | None) -> list[Checkpoint]:
    """The readable checkpoints in `directory`, the one written last first (earlier versions' files before any slot);
    none where there is no state directory. Each is read whole (a torn one fails its CRC): read once, then asked."""
    if directory is None:
        return []
    found = []
    for order, name in enumerate(EARLIER):
        if (read := _read(directory / name)) is not None:
            found.append((-1 - order, read[0]))
    for name in SLOTS:
        if (read := _read(directory / name)) is not None:
            found.append((read[1], read[0]))
    return [c for _, c in sorted(found, key=lambda item: item[0], reverse=True)]


MEMBER = "member.json"


def note_member(directory: Path, run_id: str, rank: int, address: str, started: float | None = None) -> None:
    """Say in the state directory that this node is rank `rank` of run `run_id` (replaced whole: a rename), and
    (`started`, wall-clock seconds) when it passed the run's start, where that counts (an asynchronous budget)."""
    directory.mkdir(parents=True, exist_ok=True)
    note = {"run_id": run_id, "rank": rank, "address": address}
    write_whole(directory / MEMBER, json.dumps(note if started is None else {**note, "started": started}))


def noted_start(directory: Path | None, run_id: str, rank: int, address: str, noted: float | None) -> float:
    """When this member passed the run's start, by the wall clock: `noted` (what its state directory said as it
    was started again), else now, noted there for a process started after it (`note_member`)."""
    if noted is not None:
        return noted
    now = time.time()
    if directory is not None:
        note_member(directory, run_id, rank, address, now)
    return now


def member_note(directory: Path | None) -> dict[str, Any]:
    """What `note_member` last wrote in the state directory ({} where nothing was)."""
    path = None if directory is None else directory / MEMBER
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def was_member(directory: Path | None) -> bool:
    """A node with this state directory registered into a run before (`note_member`)."""
    return directory is not None and (directory / MEMBER).is_file()


def _written(path: Path) -> int | None:
    """When the slot at `path` was written (its meta's count, read alone: its CRC checked, the model's not), None
    where it is missing or cannot be read. A slot that a killed write cut short has its previous meta, or one
    that fails its CRC: its meta is written after its model, its zip's directory last."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            return int(json.loads(str(data["meta"])).get("written", -1))
    except NPZ_READ_ERRORS:
        return None


def _read(path: Path) -> tuple[Checkpoint, int] | None:
    """The checkpoint at `path` and when it was written (`written`; -1 in an earlier version's file)."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            carried = {name.removeprefix("carried_"): data[name].astype(np.float32)
                       for name in data.files if name.startswith("carried_")}
            trained = {name.removeprefix("trained_"): data[name] for name in data.files if name.startswith("trained_")}
            return (Checkpoint(str(meta["run_id"]), int(meta["rank"]), str(meta["address"]), int(meta["round"]),
                               data["vector"].astype(np.float32), carried, trained), int(meta.get("written", -1)))
    except NPZ_READ_ERRORS as exc:
        get_logger(role="node").warning("checkpoint_unreadable", path=str(path), error=f"{type(exc).__name__}: {exc}",
                                        detail="not used: the previous checkpoint, if readable, or none is")
        return None
