"""`cluster --resume`: the one home of the resume policy of a cluster's run. Whether the run in OUT can be resumed
with these settings (`check`), from which round and with which nodes (`resume_point`, `start`: the newest round
the barrier's journal keeps of which every live member has a checkpoint), and what the user of a run that stopped
is told to do next (`next_step`: --resume, or --replace where it cannot be resumed exactly).

The journal is asked through its owner (`daemon/barrier/journal.py`), the checkpoints through theirs
(`daemon/node/checkpoint.py`).
"""

from __future__ import annotations

from pathlib import Path

from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.daemon.node import checkpoint
from mosaicd.rundir import read_summary
from mosaicd.settings import Settings


class NotResumable(ValueError):
    """`--resume` of a folder whose run cannot be resumed exactly (the message says why)."""


def check(out: Path, settings: Settings) -> None:
    """ResumeError naming the run settings that differ (--nodes too) from the run in OUT, before any change."""
    barrier_journal.load(out, settings.run_config(), secured=not (settings.insecure and settings.secret_file is None))


def start(out: Path, settings: Settings) -> tuple[int, list[str]]:
    """`--resume`: the round to go on from and the nodes to start again (`resume_point`); NotResumable where
    there is none."""
    kept = barrier_journal.rounds(out)
    if not kept:
        raise NotResumable(f"--resume: {out} holds no interrupted run to go on with (no "
                           f"{barrier_journal.STATE_FILE} of a running run)")
    point = resume_point(out, settings, kept)
    if point is None:
        raise NotResumable(f"--resume: the journal keeps rounds {kept}, but not every live member has a "
                           f"checkpoint of one of them in {out / 'state'}: it cannot be resumed exactly")
    return point


def resume_point(out: Path, settings: Settings, kept: list[int]) -> tuple[int, list[str]] | None:
    """The round an interrupted cluster in `out` goes on from (`barrier_journal.resume_point`: the newest of the
    open rounds its journal keeps, `kept`, of which every live member has a checkpoint) and the nodes to start again
    (node-<i>, whose checkpoint holds its rank); None where there is none (the journal raises ResumeError for a run
    of other settings)."""
    found = {f"node-{i}": {round: c.rank for round in kept
                           if (c := checkpoint.load(out / "state" / f"node-{i}", round)) is not None}
             for i in range(settings.nodes)}
    held: dict[int, set[int]] = {}
    for ranks in found.values():
        for round, rank in ranks.items():
            held.setdefault(rank, set()).add(round)
    point = barrier_journal.resume_point(out, settings.run_config(), held)
    if point is None:
        return None
    round, live = point
    return round, sorted((n for n, ranks in found.items() if ranks.get(round) in live), key=lambda n: found[n][round])


def rounds_released(out: Path) -> int | None:
    """The rounds the run in OUT got through as its journal says (a barrier writes its summary every few seconds,
    its journal every round): what a resumed run goes on from; None without a journal of a run to resume."""
    kept = barrier_journal.rounds(out)
    return kept[0] if kept else None


def next_step(out: Path, settings: Settings, exc: BaseException) -> str | None:
    """What the user can do with the run in OUT after it stopped, in one line (None: the error says it all)."""
    if (read_summary(out) or {}).get("status") == "finished":
        return "the run had finished before it was interrupted: its results are there"
    kept = barrier_journal.rounds(out)
    if kept and (at := _resumes_at(out, settings, kept)) is not None:
        # a node may not have checkpointed the newest round yet: the resume goes on from the one before
        where = "" if at == kept[0] else f" from {at} rounds done (the newest round every node has a checkpoint of)"
        return f"the run stopped with {kept[0]} of {settings.rounds} rounds done; the same command with --resume " \
            f"continues it{where} (--out {out})"
    if kept:
        return f"the run stopped with {kept[0]} of {settings.rounds} rounds done, before every node had a checkpoint " \
            f"of a round its journal keeps, so it cannot be resumed exactly; --replace starts it again (--out {out})"
    if isinstance(exc, KeyboardInterrupt):
        return f"the run was stopped before its first round; --replace starts it again (--out {out})"
    return None


def _resumes_at(out: Path, settings: Settings, kept: list[int]) -> int | None:
    """The round `--resume` goes on from (`resume_point`), None where it cannot resume exactly."""
    try:
        point = resume_point(out, settings, kept)
    except (OSError, ValueError, KeyError):  # ResumeError is a ValueError
        return None
    return None if point is None else point[0]
