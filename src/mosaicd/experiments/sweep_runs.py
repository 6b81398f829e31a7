"""A sweep's runs and what they leave: the run and spec records, each run's state on disk (`run_state`), its
grid.csv row, one run done in this process (`execute`) and the sweep's book of what it has done (`SweepBook`).
What `sweep` (one at a time), `sweep_jobs` (at once here) and `sweep_slurm` (in Slurm) share.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mosaicd.files import write_whole
from mosaicd.outputs import NETWORK_METRICS, SUMMARY_KEYS, higher_is_better, read_rounds
from mosaicd.progress import ProgressPrinter, RoundProgress, clock, metrics_text, round_text
from mosaicd.settings import Settings

GRID_COLUMNS = ["metric", "higher_is_better", "rounds", "node_average", "average_model", "consensus_distance",
                "node_spread", "best_node_average", "best_round", "train_loss", "wall_s"]


@dataclass(frozen=True)
class Run:
    name: str                      # folder name under OUT/runs
    point: dict[str, Any]          # the grid values of this run, in [grid] order
    settings: Settings

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.name


@dataclass
class Spec:
    path: Path
    mode: str
    out: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    runs: list[Run] = field(default_factory=list)
    description: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)  # --set key=value

    def to_json(self) -> dict[str, Any]:
        return {"spec": str(self.path), "mode": self.mode, "out": str(self.out), "description": self.description,
                "base": self.base, "grid": self.grid, "overrides": self.overrides,
                "runs": [{"name": r.name, "point": r.point, "dir": f"runs/{r.name}"} for r in self.runs]}


# ---------------------------------------------------------------------------------------------- results


def _best(rounds: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    values = [(r.get("node_average"), r.get("round")) for r in rounds
              if isinstance(r.get("node_average"), int | float) and math.isfinite(r["node_average"])]
    if not values:
        return None, None
    value, round_ = (max if higher_is_better(rounds) else min)(values, key=lambda x: x[0])
    return value, round_


def grid_row(run: Run, summary: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's grid values and final figures (one grid.csv row); `rounds`: its rows (`read_rounds`)."""
    final = summary.get("final") or {}
    best, best_round = _best(rounds)
    return {"run": run.name, **run.point, "metric": final.get("metric"),
            "higher_is_better": higher_is_better(rounds),
            "rounds": summary.get("settings", {}).get("rounds"),
            **{k: final.get(k) for k in NETWORK_METRICS},
            "best_node_average": best, "best_round": best_round, "train_loss": final.get("train_loss"),
            "wall_s": summary.get("wall_s")}


def write_grid_csv(spec: Spec, rows: list[dict[str, Any]]) -> Path:
    path = spec.out / "grid.csv"
    text = io.StringIO()
    writer = csv.DictWriter(text, ["run", *spec.grid, *GRID_COLUMNS])
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    write_whole(path, text.getvalue())
    return path


def run_state(run: Run, out: Path, mode: str = "simulate") -> tuple[str, dict[str, Any] | None]:
    """'done' (with its summary), 'todo' (no folder), 'broken' (no summary.json), 'failed' (a summary.json that
    says "status": "failed", with that summary), 'changed' (other settings) or, in a "simulate" sweep, 'resume'
    (an unfinished run with the spec's settings that `simulate --resume` continues, with its summary)."""
    folder = run.folder(out)
    if not folder.exists():
        return "todo", None
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return "broken", None
    # running: the partial summary of a run stopped mid-way
    if summary.get("status") in ("failed", "interrupted", "running"):
        if mode == "simulate" and _resumable(run, folder, summary):
            return "resume", summary
        return ("failed", summary) if summary.get("status") in ("failed", "interrupted") else ("broken", None)
    wanted = run.settings.run_fields()
    had = summary.get("settings") or {}
    if any(had.get(k) != v for k, v in wanted.items()):
        return "changed", None
    return "done", summary


def _resumable(run: Run, folder: Path, summary: dict[str, Any]) -> bool:
    """Whether `simulate --resume` takes the unfinished run in `folder` on: its own, with the spec's settings."""
    from mosaicd.experiments.resume import RESULT_FIELDS
    from mosaicd.rundir import occupant

    held = occupant(folder)
    wanted, had = run.settings.model_dump(mode="json"), summary.get("settings") or {}
    return held.resumable and held.mode == "simulate" and all(had.get(k) == wanted[k] for k in RESULT_FIELDS)


# ---------------------------------------------------------------------------------------------- a run's log


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _log_round(log: TextIO, p: RoundProgress) -> None:
    loss = f" loss {p.loss:.4f}" if p.loss is not None and math.isfinite(p.loss) else ""
    metrics = f" | {metrics_text(p.row)}" if p.row else ""
    members = f" | members {p.live}/{p.members}" if p.members is not None else ""
    log.write(f"{_now()} {round_text(p.done, p.rounds)}{loss}{metrics}{members}\n")
    log.flush()


# ---------------------------------------------------------------------------------------------- the sweep


def write_settings(run: Run, folder: Path) -> None:
    """The run's settings.json in its folder, as the sweep resolved them."""
    write_whole(folder / "settings.json", json.dumps(run.settings.model_dump(mode="json"), indent=2) + "\n")


def model_hashes(out: Path) -> dict[str, dict[str, str]]:
    """Each run's `model_sha256` (run name -> rank -> hash) of the sweep in `out`, from the runs' summaries."""
    return {p.parent.name: json.loads(p.read_text())["model_sha256"] for p in sorted(out.glob("runs/*/summary.json"))}


def execute(run: Run, out: Path, mode: str, printer: ProgressPrinter, timeout: float | None = None,
            on_round: Callable[[Run, RoundProgress], None] | None = None, resume: bool = False) -> dict[str, Any]:
    """One run from scratch in its own folder (`resume`: the unfinished simulation there, continued); returns its
    summary.

    Each round goes to the run's log (OUT/runs/<run>/run.log), to the sweep's printer, then to `on_round`.
    The run's own components log nothing in this process (cluster nodes and barrier log to OUT/.../logs/).
    """
    folder = run.folder(out)
    if folder.exists() and not resume:
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=resume)
    write_settings(run, folder)
    with open(folder / "run.log", "a") as log:
        log.write(f"{_now()} {'resume' if resume else 'start'} {run.name} mode={mode}\n")
        log.flush()

        def round_done(p: RoundProgress) -> None:
            _log_round(log, p)
            printer.on_round(p, run.name)
            if on_round is not None:
                on_round(run, p)

        started = time.monotonic()
        try:
            if mode == "cluster":
                from mosaicd.experiments.cluster import run_cluster
                summary = run_cluster(run.settings, progress=False, timeout=timeout, on_round=round_done,
                                      advise=False)
            else:
                from mosaicd.experiments.simulate import run_simulation
                summary = run_simulation(run.settings, progress=False, on_round=round_done, resume=resume,
                                         advise=False)
        except KeyboardInterrupt:
            again = "continues this run" if mode == "simulate" else "redoes this run"
            log.write(f"{_now()} interrupted after {time.monotonic() - started:.1f}s (the next sweep {again})\n")
            raise
        except Exception:
            log.write(f"{_now()} failed after {time.monotonic() - started:.1f}s\n{traceback.format_exc()}")
            raise
        final = summary.get("final") or {}
        log.write(f"{_now()} done in {time.monotonic() - started:.1f}s: "
                  + json.dumps({k: final.get(k) for k in SUMMARY_KEYS})
                  + "\n")
    return summary


class SweepBook:
    """What a sweep has done so far (counts, grid.csv rows, failures) and what it says of each run, whether its
    runs go one after another here or at once in other processes."""

    def __init__(self, spec: Spec, printer: ProgressPrinter) -> None:
        self.spec, self.printer = spec, printer
        self.states = {run.name: run_state(run, spec.out, spec.mode) for run in spec.runs}
        self.to_run = [r for r in spec.runs if self.states[r.name][0] != "done"]
        self.rows: dict[str, dict[str, Any]] = {}
        self.counts = {"total": len(spec.runs), "skipped": 0, "ran": 0, "redone": 0, "resumed": 0, "failed": 0}
        self.failed: list[str] = []
        self.started = 0  # runs started by this sweep

    def skip_done(self) -> None:
        for run in self.spec.runs:
            state, summary = self.states[run.name]
            if state == "done" and summary is not None:
                self.rows[run.name] = grid_row(run, summary, read_rounds(run.folder(self.spec.out)))
                self.counts["skipped"] += 1
                self.printer.skip_run()
                self.printer.message(f"sweep: skip {run.name} (summary.json matches its settings)")
        self.write_grid()

    def write_grid(self) -> None:
        write_grid_csv(self.spec, [self.rows[r.name] for r in self.spec.runs if r.name in self.rows])

    def ended(self) -> int:
        return self.counts["skipped"] + self.counts["ran"] + self.counts["failed"]

    def start(self, run: Run, elsewhere: bool = False) -> bool:
        """Say how the run starts (resumed, redone, new; `elsewhere`: a run Slurm started, said as such);
        whether it continues an unfinished simulation."""
        state, last = self.states[run.name]
        if elsewhere:
            state = "elsewhere"
        if state == "resume":
            self.printer.message(f"sweep: resuming {run.name} ({(last or {}).get('status')}: "
                                 f"{(last or {}).get('error') or 'stopped'})")
            self.counts["resumed"] += 1
        if state in ("broken", "changed", "failed"):
            why = {"broken": "no summary.json", "changed": "its settings differ from the spec",
                   "failed": f"it failed: {(last or {}).get('error')}"}[state]
            self.printer.message(f"sweep: redoing {run.name} from scratch ({why})")
            self.counts["redone"] += 1
        self.started += 1
        self.printer.sweep_news(f"sweep: [{self.counts['skipped'] + self.started}/{len(self.spec.runs)}] "
                                f"{run.name} ...")
        self.printer.start_run(run.name, run.settings.rounds)
        return state == "resume"

    def _end_run(self, run: Run, text: str, failed: bool = False) -> None:
        """A failure is a line even where progress is off."""
        self.printer.end_run(run.name, failed=failed)
        eta = self.printer.sweep_eta()
        done = self.ended()
        self.printer.sweep_news(f"sweep: [{done}/{len(self.spec.runs)}] {text}"
                                + (f"; ~{clock(eta)} left" if eta and done < len(self.spec.runs) else ""),
                                always=failed)

    def done(self, run: Run, summary: dict[str, Any]) -> None:
        self.counts["ran"] += 1
        self.rows[run.name] = grid_row(run, summary, read_rounds(run.folder(self.spec.out)))
        self.write_grid()
        self._end_run(run, f"{run.name} done in {summary.get('wall_s')}s")

    def fail(self, run: Run, error: str) -> None:
        self.failed.append(run.name)
        self.counts["failed"] += 1
        self._end_run(run, f"{run.name} failed: {error} (see {run.folder(self.spec.out) / 'run.log'})", failed=True)

    def stop_at_failure(self, not_started: int) -> None:
        self.printer.message(f"sweep: stopped at the failed run; {not_started} run{'s' * (not_started != 1)} not "
                             "started (--keep-going goes on past a failed run; the same command again redoes it and "
                             "goes on)", always=True)

    def result(self) -> dict[str, Any]:
        return {**self.counts, "done": len(self.rows), "failed_runs": self.failed,
                "grid_csv": str(self.spec.out / "grid.csv"), "out": str(self.spec.out)}
