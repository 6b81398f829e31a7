"""`mosaicd sweep SPEC.toml`: run a grid of experiments, one output folder per run, resumably.

A run spec is a TOML file with two top-level keys and two tables:

    mode = "simulate"            # "simulate" (every node in this process) or "cluster" (real processes)
    out = "runs/digits-quick"    # the sweep's folder, relative to the working directory (--out overrides)

    [run]                        # base settings: any `Settings` field (the flags of `mosaicd simulate`)
    task = "digits"
    nodes = 16
    partition = "dirichlet"
    alpha = 0.1

    [grid]                       # swept settings: each a non-empty list; the runs are their product
    fragments = [1, 4, 16]
    seed = [0, 1, 2]

Keys may be written with '-' or '_'. A key may be in [run] or in [grid], not both; `out` is set by the
sweep and may be in neither. `mosaicd sweep SPEC --set key=value` (repeatable) overrides a setting of the spec:
a key of [grid] gets the value as its list (`--set 'fragments=[1,4]'`, or one value), any other key is set in
[run]; values are TOML (`--set lr=0.1`, `--set sampler=oracle`: a bare word is a string). An optional
top-level `description` string is copied into the report.
Every grid point is validated with the one `Settings` model (flags > MOSAIC_* environment > defaults,
as for `mosaicd simulate`) before anything runs; an error names the file, the table and the key.

What a sweep leaves in OUT:

    OUT/sweep.json                  the spec as read, the grid and the run list (read by `mosaicd report`)
    OUT/grid.csv                    one row per finished run: its grid values and final figures
    OUT/runs/<k=v,k=v,...>/         one run: settings.json, summary.json, rounds.csv, nodes.csv, run.log
                                    (cluster mode also: logs/ and nodes/)

Run folders are named by the grid values in the order the [grid] table lists them
(e.g. `fragments=4,seed=1`). Resuming: a run whose summary.json exists and whose run settings
(`Settings.run_fields()`) equal the spec's is skipped. An unfinished run of a "simulate" sweep (summary.json says
"status": "failed" or "running": it failed, was interrupted or killed) with the spec's settings is continued from
its last checkpoint, as `mosaicd simulate --resume` does (the same models as if it had never stopped); any other
unfinished run (a cluster's, or one without summary.json or with other settings) is deleted and run again from
scratch, in a folder that holds no other run's files (`rundir.claim_out`). summary.json is written atomically,
so Ctrl-C at any point leaves either a finished run or one that is resumed or redone.
grid.csv is rewritten after every finished run.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import itertools
import json
import math
import re
import shutil
import sys
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mosaicd.outputs import NETWORK_METRICS, SUMMARY_KEYS, higher_is_better, read_rounds
from mosaicd.progress import ProgressPrinter, RoundProgress, clock, metrics_text, round_text
from mosaicd.settings import Settings, SettingsError

if TYPE_CHECKING:
    from rich.console import Console

HELP = "run a grid of experiments from a TOML spec (resumable; see examples/)"

MODES = ("simulate", "cluster")
TOP_LEVEL = {"mode", "out", "description", "run", "grid"}
GRID_COLUMNS = ["metric", "higher_is_better", "rounds", "node_average", "average_model", "consensus_distance",
                "node_spread", "best_node_average", "best_round", "train_loss", "wall_s"]


class SpecError(SettingsError):
    """A run spec problem; the message names the file, the table and the key."""


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


# ---------------------------------------------------------------------------------------------- the spec


def _value_text(value: Any) -> str:
    if isinstance(value, dict):  # --task-option tables: task_options=scale-1+width-8
        return "+".join(f"{_value_text(k)}-{_value_text(v)}" for k, v in value.items())
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value) if isinstance(value, float) else str(value)
    return "".join(c if c.isalnum() or c in "._-+" else "_" for c in text)


def run_name(point: dict[str, Any]) -> str:
    """The folder name of a grid point: `k=v,k=v` in [grid] order (`single` for an empty grid)."""
    return ",".join(f"{k}={_value_text(v)}" for k, v in point.items()) or "single"


def _keys(table: dict[str, Any], where: str, path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fields = Settings.model_fields
    for raw, value in table.items():
        key = raw.replace("-", "_")
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            raise SpecError(f"{path}: [{where}] {raw}: unknown setting"
                            + (f" (did you mean {hint[0]}?)" if hint else ""))
        if key == "out":
            raise SpecError(f"{path}: [{where}] out: the sweep sets each run's out; put the sweep's folder in "
                            f"the top-level `out` key")
        if key in out:
            raise SpecError(f"{path}: [{where}] {raw}: given twice")
        out[key] = value
    return out


def _flag_names(message: str, keys: list[str]) -> list[str]:
    """The keys whose flag (`--local-steps`) a SettingsError message mentions."""
    return [k for k in keys if re.search(rf"--{re.escape(k.replace('_', '-'))}(?![\w-])", message)]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set key=value` items as settings (values read as TOML, a bare word as a string); SpecError naming the
    item for a malformed one, an unknown key or `out`."""
    overrides: dict[str, Any] = {}
    for item in items:
        raw, sep, text = item.partition("=")
        key = raw.strip().replace("-", "_")
        if not sep or not key:
            raise SpecError(f"--set {item}: expected key=value (e.g. --set rounds=20)")
        if key == "mode":
            raise SpecError(f"--set {item}: the mode is the spec's own (mode = \"simulate\" or \"cluster\" at its "
                            "top): a sweep of the other mode is another spec, with its own out")
        if key not in Settings.model_fields:
            hint = difflib.get_close_matches(key, list(Settings.model_fields), n=1)
            raise SpecError(f"--set {item}: unknown setting {raw.strip()!r}"
                            + (f" (did you mean {hint[0]}?)" if hint else ""))
        if key == "out":
            raise SpecError(f"--set {item}: the sweep sets each run's out; give the sweep's folder with --out")
        try:
            value = tomllib.loads(f"value = {text.strip()}")["value"]
        except tomllib.TOMLDecodeError as exc:
            if text.strip()[:1] in ("[", "{", '"', "'", "+", "-", ".", *"0123456789"):  # meant as TOML, not a word
                raise SpecError(f"--set {item}: the value of {key} is not TOML ({exc}); e.g. --set 'fragments=[1, 4]', "
                                "--set lr=0.1, --set sampler=oracle") from None
            value = text.strip()
        overrides[key] = value
    return overrides


def load_spec(path: Path | str, out: Path | str | None = None, overrides: dict[str, Any] | None = None) -> Spec:
    """Read and validate a spec: every grid point becomes a `Settings`, or a SpecError names what is wrong.
    `overrides` (`parse_overrides`): settings that replace the spec's, a [grid] key's list or a [run] key."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    for key in data:
        if key not in TOP_LEVEL:
            hint = " (settings go in the [run] table)" if key.replace("-", "_") in Settings.model_fields else ""
            raise SpecError(f"{path}: {key}: unknown top-level key; expected mode, out, description, [run], "
                            f"[grid]{hint}")
    mode = data.get("mode", "simulate")
    if mode not in MODES:
        raise SpecError(f"{path}: mode: must be one of {', '.join(MODES)}, got {mode!r}")
    if out is None:
        if "out" not in data:
            raise SpecError(f"{path}: out: missing (the sweep's folder, e.g. out = \"runs/{path.stem}\")")
        out = data["out"]
    if not isinstance(out, str | Path) or not str(out):
        raise SpecError(f"{path}: out: must be a folder name, got {out!r}")
    for table in ("run", "grid"):
        if not isinstance(data.get(table, {}), dict):
            raise SpecError(f"{path}: {table}: must be a table ([{table}])")
    base = _keys(data.get("run", {}), "run", path)
    grid = _keys(data.get("grid", {}), "grid", path)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{path}: [grid] {key}: must be a non-empty list of values, got {values!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise SpecError(f"{path}: [grid] {key}: repeated values in {values!r}")
        if key in base:
            raise SpecError(f"{path}: {key}: in both [run] and [grid]; keep one")
    overrides = dict(overrides or {})
    for key, value in overrides.items():
        if key in grid:
            grid[key] = value if isinstance(value, list) and value else [value]
        else:
            base[key] = value
    spec = Spec(path, mode, Path(out), base, grid, description=str(data.get("description", "")),
                overrides=overrides)
    errors: list[str] = []
    names: dict[str, dict[str, Any]] = {}
    for combo in itertools.product(*grid.values()):
        point = dict(zip(grid, combo, strict=True))
        name = run_name(point)
        if name in names:
            raise SpecError(f"{path}: [grid] points {names[name]} and {point} give the same folder name {name!r}")
        names[name] = point
        try:
            settings = Settings.load(**{**base, **point, "out": spec.out / "runs" / name})
        except SettingsError as exc:
            message = str(exc)
            named = _flag_names(message, list(base) + list(point))
            where = ", ".join(f"--set {k}={overrides[k]!r}" if k in overrides else f"[grid] {k} = {point[k]!r}"
                              if k in point else f"[run] {k} = {base[k]!r}" for k in named) or "the settings"
            errors.append(f"{where}: {message}" + (f" (grid point {name})" if point else ""))
            continue
        spec.runs.append(Run(name, point, settings))
    if not errors and (failed := _check_tasks(spec, overrides)):
        raise SpecError(f"{path}: " + "; ".join(failed))
    if errors:
        shown = list(dict.fromkeys(errors))
        more = f"\n  ... and {len(shown) - 5} more" if len(shown) > 5 else ""
        raise SpecError(f"{path}: {len(errors)} of {len(names)} runs have invalid settings:\n  "
                        + "\n  ".join(shown[:5]) + more)
    return spec


def _check_tasks(spec: Spec, overrides: dict[str, Any]) -> list[str]:
    """Each task of the user's in the grid (with its options and data folder) built once (`check_task`), so that
    one that cannot run stops the sweep before any run starts; the errors, each naming where the task is set."""
    from mosaicd.learning.tasks import check_task
    from mosaicd.settings import TaskName

    errors: list[str] = []
    seen: set[str] = set()
    for run in spec.runs:
        s = run.settings
        key = json.dumps([s.task, s.task_options, str(s.data_dir)], sort_keys=True)
        if isinstance(s.task, TaskName) or key in seen:
            continue
        seen.add(key)
        try:
            check_task(s.run_config(), s.data_dir)
        except SettingsError as exc:
            where = ", ".join(f"--set {k}={overrides[k]!r}" if k in overrides else f"[grid] {k} = {run.point[k]!r}"
                              if k in run.point else f"[run] {k} = {spec.base[k]!r}"
                              for k in ("task", "task_options") if k in run.point or k in spec.base)
            errors.append(f"{where or 'the settings'}: {exc}" + (f" (grid point {run.name})" if run.point else ""))
    return errors


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
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, ["run", *spec.grid, *GRID_COLUMNS])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    tmp.replace(path)
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
    if summary.get("status") in ("failed", "running"):  # running: the partial summary of a run stopped mid-way
        if mode == "simulate" and _resumable(run, folder, summary):
            return "resume", summary
        return ("failed", summary) if summary.get("status") == "failed" else ("broken", None)
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
    (folder / "settings.json").write_text(json.dumps(run.settings.model_dump(mode="json"), indent=2) + "\n")
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


def run_sweep(spec: Spec, progress: bool = True, keep_going: bool = False, timeout: float | None = None,
              console: Console | None = None,
              on_round: Callable[[Run, RoundProgress], None] | None = None, jobs: int = 1,
              slurm: dict[str, Any] | None = None, wait: bool = True) -> dict[str, Any]:
    """Run every grid point not already done; returns counts and the grid.csv path. Ctrl-C propagates.

    Progress and news go to one `ProgressPrinter` (on `console`, default stderr), with a line for the sweep and
    one for the current run; `progress=False` leaves only failures. `on_round(run, p)` is called after every
    round of every run (an exception there ends the run as a failure would; KeyboardInterrupt, the sweep).
    `jobs` > 1: that many runs at once, each in a process of its own (`sweep_jobs`), with the same results.
    `slurm` (its --slurm-option values): the runs go to Slurm (`sweep_slurm`); a sweep once submitted there is
    followed there (its live jobs waited for, unless not `wait`), never run here behind Slurm's back.
    A second sweep of the same `out` while this one goes on is refused (`rundir.hold`), not run beside it.
    """
    from mosaicd.rundir import hold, release

    spec.out.mkdir(parents=True, exist_ok=True)
    hold(spec.out, f"{spec.path}: out =")
    try:
        return _sweep(spec, progress, keep_going, timeout, console, on_round, jobs, slurm, wait)
    finally:
        release(spec.out)


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

    def _end_run(self, run: Run, text: str, always: bool = False) -> None:
        self.printer.end_run(run.name)
        eta = self.printer.sweep_eta()
        done = self.ended()
        self.printer.sweep_news(f"sweep: [{done}/{len(self.spec.runs)}] {text}"
                                + (f"; ~{clock(eta)} left" if eta and done < len(self.spec.runs) else ""),
                                always=always)

    def done(self, run: Run, summary: dict[str, Any]) -> None:
        self.counts["ran"] += 1
        self.rows[run.name] = grid_row(run, summary, read_rounds(run.folder(self.spec.out)))
        self.write_grid()
        self._end_run(run, f"{run.name} done in {summary.get('wall_s')}s")

    def fail(self, run: Run, error: str) -> None:
        self.failed.append(run.name)
        self.counts["failed"] += 1
        self._end_run(run, f"{run.name} failed: {error} (see {run.folder(self.spec.out) / 'run.log'})", always=True)

    def stop_at_failure(self, not_started: int) -> None:
        self.printer.message(f"sweep: stopped at the failed run; {not_started} run{'s' * (not_started != 1)} not "
                             "started (--keep-going goes on past a failed run; the same command again redoes it and "
                             "goes on)", always=True)

    def result(self) -> dict[str, Any]:
        return {**self.counts, "done": len(self.rows), "failed_runs": self.failed,
                "grid_csv": str(self.spec.out / "grid.csv"), "out": str(self.spec.out)}


def _sweep(spec: Spec, progress: bool, keep_going: bool, timeout: float | None, console: Console | None,
           on_round: Callable[[Run, RoundProgress], None] | None, jobs: int, slurm: dict[str, Any] | None,
           wait: bool) -> dict[str, Any]:
    from mosaicd.experiments.sweep_slurm import SLURM_DIR, run_on_slurm

    (spec.out / "sweep.json").write_text(json.dumps(spec.to_json(), indent=2) + "\n")
    with ProgressPrinter(enabled=progress, console=console, plain_every=30.0) as printer:
        book = SweepBook(spec, printer)
        at_once = max(1, min(jobs, len(book.to_run)))
        printer.start_sweep(len(spec.runs), len(book.to_run), sum(r.settings.rounds for r in book.to_run),
                            parallel=at_once)
        book.skip_done()
        if slurm is not None or (spec.out / SLURM_DIR / "submissions.json").exists():
            run_on_slurm(book, slurm or {}, timeout, wait, submit=slurm is not None)
            return book.result()
        if at_once > 1:
            from mosaicd.experiments.sweep_jobs import run_at_once

            run_at_once(book, at_once, keep_going, timeout, on_round)
            return book.result()
        for run in book.to_run:
            resume = book.start(run)
            try:
                summary = execute(run, spec.out, spec.mode, printer, timeout, on_round, resume=resume)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                book.fail(run, str(exc))
                if not keep_going:
                    book.stop_at_failure(len(spec.runs) - spec.runs.index(run) - 1)
                    break
                continue
            book.done(run, summary)
    return book.result()


# ---------------------------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, metavar="SPEC.toml", help="run spec (see examples/*.toml)")
    parser.add_argument("--out", type=Path, default=None, help="the sweep's folder [default: the spec's `out`]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of the spec (repeatable): a [grid] key's list or a [run] key; "
                        "the value is TOML, e.g. --set rounds=5 --set 'fragments=[1,4]' --set sampler=oracle")
    parser.add_argument("--dry-run", action="store_true", help="validate the spec, list the runs and their state")
    parser.add_argument("--keep-going", action="store_true", help="go on with the next run after a failed one")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (cluster mode)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--slurm", action="store_true",
                        help="submit the runs not done to Slurm (submitit): a simulate sweep as one job array, a "
                        "cluster sweep as a multi-task job per run; then wait for them (see --no-wait)")
    parser.add_argument("--slurm-option", dest="slurm_options", action="append", default=[], metavar="KEY=VALUE",
                        help="an sbatch option for --slurm (repeatable): partition=gpu, time=120 (minutes), "
                        "cpus_per_task=4, gpus_per_node=1, mem=8GB, account=..., array_parallelism=8, or any "
                        "other sbatch long option")
    parser.add_argument("--no-wait", action="store_true",
                        help="a sweep in Slurm: submit (or look) and return; the same command again shows the "
                        "state and gathers the finished runs into grid.csv")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="runs at once, each in a process of its own [default: what the cores allow: cores over "
                        "--threads for a simulation, over the nodes for a cluster]")


def parse_slurm_options(items: list[str], slurm: bool) -> dict[str, Any] | None:
    if items and not slurm:
        raise SettingsError(f"--slurm-option {items[0]}: only with --slurm")
    if not slurm:
        return None
    from mosaicd.experiments.sweep_slurm import parse_options

    return parse_options(items)


def live_in_slurm(spec: Spec) -> dict[str, Any]:
    """The sweep's runs queued or running in Slurm now ({} for a sweep never submitted there)."""
    from mosaicd.experiments.sweep_slurm import SLURM_DIR, SlurmSweep

    if not (spec.out / SLURM_DIR / "submissions.json").exists():
        return {}
    return SlurmSweep(spec).live()  # only to look: no book


def default_jobs(spec: Spec) -> int:
    """Runs at once that this machine's cores allow for the spec's mode, threads and nodes."""
    from mosaicd.experiments.sweep_jobs import default_jobs as allowed

    if not spec.runs:
        return 1
    return allowed(spec.mode, max(r.settings.threads for r in spec.runs), max(r.settings.nodes for r in spec.runs))


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and its children so far (cluster runs' processes too)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def main(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec, args.out, parse_overrides(args.overrides))
    except SettingsError as exc:
        print(f"mosaicd sweep: error: {exc}", file=sys.stderr)
        return 2
    try:
        options = parse_slurm_options(args.slurm_options, args.slurm)
    except SettingsError as exc:
        print(f"mosaicd sweep: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        live = live_in_slurm(spec)
        for run in spec.runs:
            state = run_state(run, spec.out, spec.mode)[0]
            if run.name in live:
                state = f"{live[run.name].state.lower()} (slurm job {live[run.name].job})"
            print(f"{state:8s} {run.folder(spec.out)}")
        print(f"{len(spec.runs)} runs, mode {spec.mode}, out {spec.out}")
        return 0
    if args.jobs is not None and args.jobs < 1:
        print(f"mosaicd sweep: error: --jobs {args.jobs}: must be 1 or more", file=sys.stderr)
        return 2
    jobs = args.jobs or default_jobs(spec)
    started = time.monotonic()
    try:
        result = run_sweep(spec, progress=not args.quiet, keep_going=args.keep_going, timeout=args.timeout,
                           jobs=jobs, slurm=options, wait=not args.no_wait)
    except SettingsError as exc:
        print(f"mosaicd sweep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if live_in_slurm(spec):
            print(f"mosaicd sweep: stopped waiting; the runs in Slurm go on (scancel their jobs to stop them; "
                  f"{spec.out / 'slurm' / 'submissions.json'} lists them). The same command shows them and gathers "
                  "the finished.", file=sys.stderr)
            return 130
        done = sum(1 for r in spec.runs if run_state(r, spec.out, spec.mode)[0] == "done")
        again = ("goes on from its last checkpoint" if spec.mode == "simulate" else "is redone from scratch")
        print(f"mosaicd sweep: interrupted; {done}/{len(spec.runs)} runs done in {spec.out / 'runs'}. Run the same "
              f"command again to resume (the interrupted run {again}).", file=sys.stderr)
        return 130
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["cpu_s"] = round(cpu_seconds(), 1)  # what it costs whatever else the host runs (the docs' figures)
    print(json.dumps(result))
    return 1 if result["failed"] else 0
