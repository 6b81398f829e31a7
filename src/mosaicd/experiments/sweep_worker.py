"""One run of a sweep in a process of its own: `sweep --jobs N` starts one per run, a Slurm array task runs one.

The sweep writes each run's ticket first (OUT/.sweep/<run>.json: its settings as the sweep resolved them, its grid
point, the mode), so the run is the same wherever and whenever it starts: a pending array task that starts hours
later does not read the spec again. The worker decides from the run's folder what to do, as the sweep itself
would (`run_state`): skip a finished run, continue an unfinished simulation, else run it from scratch.

    python -m mosaicd.experiments.sweep_worker OUT/.sweep/<run>.json

prints one JSON line per finished round ({"round", "rounds", "loss", "row", ...}) and, at the end, {"end": "done"}
or {"end": "failed", "error": ...}; exit status 0 (done or already done), 1 (failed), 130 (interrupted).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from mosaicd.experiments.sweep_runs import Run, execute, run_state
from mosaicd.files import write_whole
from mosaicd.progress import ProgressPrinter, RoundProgress
from mosaicd.settings import Settings

TICKETS = ".sweep"


def ticket_path(out: Path, run: Run) -> Path:
    return out / TICKETS / f"{run.name}.json"


def write_ticket(out: Path, run: Run, mode: str, timeout: float | None = None) -> Path:
    path = ticket_path(out, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"name": run.name, "point": run.point, "mode": mode, "timeout": timeout,
            "settings": run.settings.model_dump(mode="json")}
    write_whole(path, json.dumps(body, indent=1) + "\n")
    return path


class Ticket(NamedTuple):
    run: Run
    out: Path              # the sweep's folder
    mode: str
    timeout: float | None


def read_ticket(path: Path | str) -> Ticket:
    path = Path(path).resolve()
    body = json.loads(path.read_text())
    out = path.parent.parent
    settings = Settings.model_validate({**body["settings"], "out": str(out / "runs" / body["name"])})
    return Ticket(Run(body["name"], body["point"], settings), out, body["mode"], body.get("timeout"))


def progress_line(p: RoundProgress) -> dict[str, Any]:
    return dataclasses.asdict(p)


def round_progress(line: dict[str, Any]) -> RoundProgress:
    return RoundProgress(**{f.name: line[f.name] for f in dataclasses.fields(RoundProgress) if f.name in line})


def run_ticket(path: Path | str, lines: TextIO | None = None) -> dict[str, Any]:
    """The ticket's run, done here; its summary. `lines`: where each round's JSON line goes (none: nowhere)."""
    return run_read(read_ticket(path), lines)


def run_read(ticket: Ticket, lines: TextIO | None = None) -> dict[str, Any]:
    """`run_ticket` of a ticket read already."""
    run, out, mode, timeout = ticket
    state, summary = run_state(run, out, mode)
    if state == "done" and summary is not None:
        return summary

    def on_round(_run: Run, p: RoundProgress) -> None:
        if lines is not None:
            lines.write(json.dumps(progress_line(p)) + "\n")
            lines.flush()

    return execute(run, out, mode, ProgressPrinter(enabled=False), timeout, on_round, resume=state == "resume")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mosaicd.experiments.sweep_worker OUT/.sweep/RUN.json", file=sys.stderr)
        return 2
    try:
        run_ticket(args[0], sys.stdout)
    except KeyboardInterrupt:
        print(json.dumps({"end": "interrupted"}), flush=True)
        return 130
    except Exception as exc:  # the traceback is in the run's run.log (execute)
        print(json.dumps({"end": "failed", "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"end": "done"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
