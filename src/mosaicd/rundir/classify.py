"""What a run's folder holds, as far as starting another run there goes: the files of a run (`run_files`) and the
run they are (`occupant`: none, finished, unfinished, leftovers), from its summary, its barrier's journal and its
checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mosaicd.rundir.journal import JOURNAL, kept_rounds, position
from mosaicd.rundir.read import RUN_MARKER, read_summary, rounds_done

SIMULATE_CHECKPOINT = "simulate-checkpoint.npz"  # what `simulate --resume` continues from (experiments/resume.py)
CHECKPOINTS = "checkpoint*.npz"  # a node's checkpoints in its state folder (daemon/node/checkpoint.py)
# a run's own files: what --replace removes (and all a folder may hold besides for a new run to start there);
# logs/, state/ (node checkpoints) and nodes/ (a cluster's nodes' folders) are folders
MODEL_HASHES = "model_sha256.csv"  # a finished run's node models, a SHA-256 per rank (outputs.RunRecorder.finish)
RUN_FILES = (RUN_MARKER, "rounds.csv", "nodes.csv", MODEL_HASHES, JOURNAL, SIMULATE_CHECKPOINT, "logs", "state",
             "nodes")


def _has_node_checkpoints(out: Path) -> bool:
    return any(out.glob(f"state/*/{CHECKPOINTS}")) or any(out.glob(f"nodes/*/state/*/{CHECKPOINTS}"))


def run_files(out: Path | str) -> list[str]:
    """The names in OUT that belong to a run (`RUN_FILES` and their half-written `.tmp` siblings)."""
    out = Path(out)
    return [n for name in RUN_FILES for n in (name, f"{name}.tmp") if (out / n).exists() or (out / n).is_symlink()]


@dataclass(frozen=True)
class Occupant:
    """The run a folder holds, as far as starting another one there goes."""

    kind: str               # "none", "finished", "unfinished", or "leftovers" (a run's files, no summary of it)
    mode: str | None        # "simulate" or "cluster", where known
    text: str               # how it ended, for a person: "failed with 17 of 60 rounds done: a write failed"
    resumable: bool         # its mode's --resume can continue it (simulate: its summary; cluster: its journal)
    files: tuple[str, ...]  # its files (`run_files`)


def occupant(out: Path | str) -> Occupant:
    """What OUT holds: nothing of a run, a finished run, an unfinished one (its summary says running or failed, or
    a barrier journal of a run still going, or checkpoints without a summary), or files a run left."""
    out = Path(out)
    files = tuple(run_files(out)) if out.is_dir() else ()
    if not files:
        return Occupant("none", None, "", False, ())
    summary = read_summary(out)
    journal = position(out)
    journal_running = journal is not None and journal[0] == "running"
    resumable_journal = bool(kept_rounds(out))
    mode = (summary or {}).get("mode") or ("cluster" if journal else "simulate" if SIMULATE_CHECKPOINT in files
                                            else None)
    status = (summary or {}).get("status")
    if status == "finished" and not journal_running:
        done, started = rounds_done(summary or {}), (summary or {}).get("started")
        text = ", ".join(t for t in (f"{done} rounds" if done is not None else "", f"started {started}"
                                     if started else "") if t) or "no details"
        return Occupant("finished", mode, text, False, files)
    if summary is not None and status in ("running", "failed", "interrupted"):
        rounds = (summary.get("settings") or {}).get("rounds")
        at = f" with {rounds_done(summary)} of {rounds} rounds done" if rounds_done(summary) is not None else ""
        text = (f"{status}{at}: {summary.get('error') or 'no reason given'}" if status != "running"
                else f"running{at}: still going, or killed")
        resumable = (resumable_journal if mode in ("cluster", "barrier") else mode == "simulate")
        return Occupant("unfinished", mode, text, resumable, files)
    if journal_running:
        assert journal is not None
        return Occupant("unfinished", "cluster", f"its barrier's journal is at round {journal[1]} of {journal[2]}",
                        True, files)
    if SIMULATE_CHECKPOINT in files or _has_node_checkpoints(out):
        return Occupant("unfinished", mode, "checkpoints, no summary.json", SIMULATE_CHECKPOINT in files, files)
    return Occupant("leftovers", mode, ", ".join(files), False, files)
