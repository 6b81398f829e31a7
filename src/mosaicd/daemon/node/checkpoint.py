"""A node's checkpoint: its model after a round, and which round it goes on with, so that a node started again
with the same state directory rejoins the run where it left off.

STATE_DIR/checkpoint.npz, replaced atomically (written beside, fsync'd, renamed): a crash leaves the previous
checkpoint or the new one, never a torn one. The one before is kept as checkpoint-previous.npz: a whole cluster
resumed exactly goes on from the newest round every node has (`mosaicd cluster --resume`), which can be the one
before a node's newest. With a lossy --compress it also holds what the node's error feedback carries (`carried`,
`Compressor.state`), so that a resumed node sends what it would have sent.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mosaicd.daemon.http.membership import own_address
from mosaicd.logs import get_logger
from mosaicd.outputs import NPZ_READ_ERRORS
from mosaicd.settings import DaemonOptions

FILE = "checkpoint.npz"
PREVIOUS = "checkpoint-previous.npz"


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    rank: int
    address: str
    round: int  # the round it goes on with (its model is the one after round - 1)
    vector: np.ndarray
    carried: dict[str, np.ndarray] = field(default_factory=dict)  # its compressor's state (`Compressor.state`)


def state_dir(options: DaemonOptions) -> Path | None:
    """--state-dir, else OUT/state/<host>_<port>; None where no restart could find it again (--port 0)."""
    if options.state_dir is not None:
        return Path(options.state_dir)
    if options.port == 0:
        return None
    return Path(options.out) / "state" / own_address(options, options.port).replace(":", "_")


def save(directory: Path, checkpoint: Checkpoint) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"run_id": checkpoint.run_id, "rank": checkpoint.rank, "address": checkpoint.address,
            "round": checkpoint.round}
    buffer = io.BytesIO()
    np.savez(buffer, vector=np.asarray(checkpoint.vector, dtype="<f4"), meta=np.array(json.dumps(meta)),
             **{f"carried_{f}": np.asarray(v, dtype="<f4") for f, v in checkpoint.carried.items()})
    tmp = directory / f"{FILE}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if (directory / FILE).exists():
        os.replace(directory / FILE, directory / PREVIOUS)
    os.replace(tmp, directory / FILE)


def load(directory: Path | None, round: int | None = None) -> Checkpoint | None:
    """The newest checkpoint in `directory` (`round`: the one of that round, the newest or the one before), or None
    if there is none (or it cannot be read: then it is not used)."""
    if directory is None:
        return None
    for name in (FILE, PREVIOUS):  # only the previous one is left if a crash came between save's two renames
        found = _read(directory / name)
        if found is not None and (round is None or found.round == round):
            return found
    return None


def rounds(directory: Path) -> list[int]:
    """The rounds of the checkpoints kept in `directory`, newest first."""
    return [c.round for c in (_read(directory / FILE), _read(directory / PREVIOUS)) if c is not None]


def _read(path: Path) -> Checkpoint | None:
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            carried = {name.removeprefix("carried_"): data[name].astype(np.float32)
                       for name in data.files if name.startswith("carried_")}
            return Checkpoint(str(meta["run_id"]), int(meta["rank"]), str(meta["address"]), int(meta["round"]),
                              data["vector"].astype(np.float32), carried)
    except NPZ_READ_ERRORS as exc:
        get_logger(role="node").warning("checkpoint_unreadable", path=str(path), error=f"{type(exc).__name__}: {exc}",
                                        detail="not used: the previous checkpoint, if readable, or none is")
        return None
