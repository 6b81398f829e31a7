"""The barrier's journal as a file: its one name in a run's folder and how it is read (`mosaicd.daemon.barrier.journal`
writes it and loads a run from it; it reads the file through `read`). What else needs the journal (a folder's
classification, `cluster --resume`) asks here, or the barrier's journal, never the file itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mosaicd.rundir.read import read_summary

JOURNAL = "barrier-state.json"  # a cluster's barrier decisions (daemon/barrier/journal.py)


def read(out: Path | str) -> dict[str, Any]:
    """OUT's journal as saved (`FileNotFoundError` where there is none; OSError, ValueError where it cannot be
    read)."""
    return json.loads((Path(out) / JOURNAL).read_text())


def position(out: Path | str) -> tuple[str, int | None, int | None] | None:
    """(phase, round, rounds) of OUT's barrier journal, or None where there is none that can be read."""
    try:
        state = read(out)["state"]
        return str(state["phase"]), state.get("round"), state.get("rounds")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kept_rounds(out: Path | str) -> list[int]:
    """The open rounds `cluster --resume` can go on from, newest first, as OUT's barrier journal keeps them: both
    kept states of a run still running; the last open round of a run whose barrier had finished it but was stopped
    before its summary said so (while it collected or evaluated the final models: the nodes' checkpoints hold them).
    """
    try:
        data = read(out)
        newest, earlier = data["state"], data.get("earlier") or {}
        if newest["phase"] == "running":
            return [s["round"] for s in (newest, earlier) if s]
        if newest["phase"] == "finished" and earlier.get("phase") == "running" \
                and (read_summary(out) or {}).get("status") != "finished":
            return [earlier["round"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return []
