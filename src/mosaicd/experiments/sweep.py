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
import difflib
import itertools
import json
import re
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mosaicd.experiments.sweep_runs import (
    Run,
    Spec,
    SweepBook,
    execute,
    run_state,
)
from mosaicd.files import write_whole
from mosaicd.progress import ProgressPrinter, RoundProgress
from mosaicd.settings import Settings, SettingsError
from mosaicd.settings.effects import defaults, shared_values, void_axis

if TYPE_CHECKING:
    from rich.console import Console

HELP = "run a grid of experiments from a TOML spec (resumable; see examples/)"

MODES = ("simulate", "cluster")
TOP_LEVEL = {"mode", "out", "description", "run", "grid"}


class SpecError(SettingsError):
    """A run spec problem; the message names the file, the table and the key."""


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
    if (void := void_axis(grid, base, defaults(Settings))) is not None:  # an axis that changes nothing somewhere
        raise SpecError(f"{path}: {void}")
    spec = Spec(path, mode, Path(out), base, grid, description=str(data.get("description", "")),
                overrides=overrides)
    errors: list[str] = []
    names: dict[str, dict[str, Any]] = {}
    points = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
    for point in points:
        name = run_name(point)
        if name in names:
            raise SpecError(f"{path}: [grid] points {names[name]} and {point} give the same folder name {name!r}")
        names[name] = point
        try:
            shared = shared_values(base, points, point, defaults(Settings))  # less what this run cannot use
            settings = Settings.load(**{**shared, **point, "out": spec.out / "runs" / name})
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


# what an optimizer's check builds on (`optim.check_training`)
TRAINING_KEYS = ["optimizer", "optimizer_options", "lr", "momentum", "weight_decay", "lr_schedule",
                 "lr_schedule_options", "lr_warmup_steps", "rounds", "local_steps"]
SETS_A_CLASS = {"task", "task_options", "optimizer", "optimizer_options", "lr_schedule", "lr_schedule_options"}


def _check_tasks(spec: Spec, overrides: dict[str, Any]) -> list[str]:
    """Each task of the user's in the grid (with its options and data folder) built once, and each grid point's
    optimizer where it has options or is given by path (`check_task`), so that one that cannot run stops the sweep
    before any run starts; the errors, each naming where the task or optimizer is set."""
    from mosaicd.learning.tasks import check_task
    from mosaicd.settings import LR_SCHEDULES, OPTIMIZERS, TaskName

    errors: list[str] = []
    seen: set[str] = set()
    for run in spec.runs:
        s = run.settings
        builds = [] if isinstance(s.task, TaskName) else ["task", "task_options"]
        if s.optimizer not in OPTIMIZERS or s.optimizer_options or s.lr_schedule not in LR_SCHEDULES:
            builds += TRAINING_KEYS
        values = s.run_config().model_dump(mode="json")
        key = json.dumps([str(s.data_dir), *(values[k] for k in builds)], sort_keys=True)
        if not builds or key in seen:
            continue
        seen.add(key)
        try:
            check_task(s.run_config(), s.data_dir)
        except SettingsError as exc:
            where = ", ".join(f"--set {k}={overrides[k]!r}" if k in overrides else f"[grid] {k} = {run.point[k]!r}"
                              if k in run.point else f"[run] {k} = {spec.base[k]!r}"
                              for k in builds if k in SETS_A_CLASS and (k in run.point or k in spec.base))
            errors.append(f"{where or 'the settings'}: {exc}" + (f" (grid point {run.name})" if run.point else ""))
    return errors


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


def _sweep(spec: Spec, progress: bool, keep_going: bool, timeout: float | None, console: Console | None,
           on_round: Callable[[Run, RoundProgress], None] | None, jobs: int, slurm: dict[str, Any] | None,
           wait: bool) -> dict[str, Any]:
    from mosaicd.experiments.sweep_slurm import SLURM_DIR, run_on_slurm

    write_whole(spec.out / "sweep.json", json.dumps(spec.to_json(), indent=2) + "\n")
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
