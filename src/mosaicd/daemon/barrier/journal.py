"""What a barrier decided, kept on disk so that a barrier restarted with the same --out resumes the run.

OUT/barrier-state.json holds the run's settings, `BarrierState.to_json()` and the wall-clock start of the run, and
the state as it was when the round before opened (`earlier`): a whole cluster resumed exactly (`mosaicd cluster
--resume`) goes on from the newest round every node has a checkpoint of, which can be that one.
It is replaced atomically (written beside, fsync'd, renamed, directory fsync'd) after every decision that
nodes are told of (the roster, each release, each join), before they are told: a restarted barrier never
takes back what a node has heard.

The file's name and its reading are `mosaicd.rundir.journal`'s (the run folder's layer, which classifies folders
by it); this module writes it and loads a run from it. Anything above that needs the journal's kept rounds asks
`rounds` here.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from mosaic_proto import BarrierPhases, BarrierState
from mosaic_proto import resume_point as resume_rule
from mosaicd.files import write_whole
from mosaicd.rundir import journal as journal_file
from mosaicd.settings import RunConfig, SettingsError

STATE_FILE = journal_file.JOURNAL  # the one name, defined by the file's reader
VERSION = 1


class ResumeError(ValueError):
    """OUT holds a run in progress that this barrier cannot go on with (its settings differ)."""


class ResumeSettingsError(ResumeError, SettingsError):
    """The run in OUT is resumed only with flags other than those given (its settings, its secret): a usage error,
    exit 2, as `simulate --resume` with other settings."""


def save(out: Path, run: RunConfig, state: BarrierState, started: float, secured: bool) -> None:
    """`secured`: the run's requests are signed (a cluster secret): a barrier started again without one may not
    resume it (`load`)."""
    out.mkdir(parents=True, exist_ok=True)
    now = state.to_json()
    earlier = _earlier(out, now["round"])
    data = {"version": VERSION, "run": run.model_dump(mode="json"), "started": started, "secured": secured,
            "state": now, **({"earlier": earlier} if earlier else {})}
    write_whole(out / STATE_FILE, json.dumps(data), durable=True)  # json.dumps: the C encoder (json.dump: ~10x slower)


def _earlier(out: Path, round: int) -> dict[str, Any] | None:
    """The newest saved state of a round before `round` (what the file holds now, or its own earlier one)."""
    try:
        saved = journal_file.read(out)
    except (OSError, ValueError):
        return None
    for state in (saved.get("state"), saved.get("earlier")):
        if state and state["round"] < round:
            return state
    return None


def load(out: Path, run: RunConfig, round: int | None = None, counted: bool = False,
         secured: bool = True) -> dict[str, Any] | None:
    """The saved run to resume, if OUT holds one still running; None if there is none (or it ended). `round`: the
    state of that open round (the newest, or the one before it), ResumeError if it is not kept.

    ResumeError naming the flags and the run's values if the saved run's settings differ from `run`, or if the file
    cannot be read as a journal (damaged, or another file of that name). `counted`: `run`'s node count was not given
    but counted (DNS, registrations, a peer list: `DaemonOptions.nodes_counted`), and the saved run's is taken.
    `secured`: this barrier has the cluster secret; a run started with one is not resumed without it (ResumeError):
    its members would go on with nothing checked."""
    path = out / STATE_FILE
    try:
        data = journal_file.read(out)
        if data.get("version") != VERSION:
            return None
        if not BarrierPhases.saved(data["state"]["phase"]).running:  # ended; `cluster --resume` may take its last round
            if round is None or round not in rounds(out):
                return None
            data["state"], data["earlier"] = data["earlier"], None
        saved = RunConfig.model_validate(data["run"])
        started, newest, earlier = float(data["started"]), data["state"], data.get("earlier") or {}
        for kept in (newest, earlier):  # readable whole, before anything is decided from them
            if kept:
                BarrierState.from_json(kept, 0.0)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ResumeError(f"{path} cannot be read ({type(exc).__name__}: {exc}): move it away to start a new run in "
                          f"{out}") from None
    if data.get("secured") and not secured:
        raise ResumeSettingsError(f"{out} holds run {saved.run_id!r} in progress, started with a cluster secret: "
                                  "give its --secret-file (MOSAIC_SECRET_FILE) to resume it (without one, nothing its "
                                  "members send would be checked), or another --out")
    ours = (run.with_nodes(saved.nodes) if counted else run).model_dump(mode="json")
    theirs = saved.model_dump(mode="json")
    differ = sorted(k for k, v in theirs.items() if ours.get(k) != v)
    if differ:
        raise ResumeSettingsError(f"{out} holds run {saved.run_id!r} in progress, with other settings "
                                  f"({', '.join(_flag(k, ours.get(k)) for k in differ)}; the run has "
                                  f"{' '.join(_flag(k, theirs[k]) for k in differ)}): give that run's settings to "
                                  f"resume it, or another --out")
    state = newest
    if round is not None and newest["round"] != round:
        state = earlier
        if state.get("round") != round:
            raise ResumeError(f"{path} keeps rounds {newest['round']} and {earlier.get('round')}, not round {round}")
    return {"run": saved, "started": started, "state": state}


def _flag(name: str, value: Any) -> str:
    return f"--{name.replace('_', '-')} {value if isinstance(value, str) else json.dumps(value)}"


def rounds(out: Path) -> list[int]:
    """The open rounds whose state the journal in OUT keeps that `cluster --resume` can go on from (newest first)."""
    return journal_file.kept_rounds(out)


def resume_point(out: Path, run: RunConfig, held: Mapping[int, Collection[int]], counted: bool = False,
                 secured: bool = True) -> tuple[int, set[int]] | None:
    """The one rule of an exact resume (`mosaic_proto.resume_point`, fed the states kept here): the newest open round
    the journal in OUT keeps (`rounds`) of which every
    live member of that round (joining ones too) holds a checkpoint (`held`: rank -> the rounds of its checkpoints),
    and those members; None where there is none. `cluster --resume` asks it with the checkpoints in OUT/state, the
    barrier of a peer list with those its members say they hold as they register again (`load`'s ResumeError for a
    run of other settings)."""
    return resume_rule((load(out, run, round, counted, secured)["state"] for round in rounds(out)), held)
