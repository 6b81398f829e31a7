"""`mosaicd report RUN_DIR [RUN_DIR ...]`: the paper's figures and a results table from a sweep's folder or one
run's, or a comparison of several.

RUN_DIR is the `out` of `mosaicd sweep` (it holds sweep.json and runs/*/summary.json), or the `out` of one
`mosaicd simulate` or `mosaicd cluster` run (it holds summary.json), reported as a sweep of one. A sweep's
unfinished runs (no summary.json, or one that says "status": "failed") are left out; a single run is reported
whatever its status, with the rounds it recorded. Several RUN_DIRs are compared: every run in them is a line of
the figures and a row of the table, beside the settings in which the runs differ (ad-hoc runs compared without a
sweep spec); they are written in the folders' common parent's report/ by default. Writes, in RUN_DIR/report/ (or
--out):

    metric_vs_rounds.png      node-average and average-model metric vs rounds
    metric_vs_time.png        the same vs time, where every run has a clock (each run's own, `clock_of`):
                              simulate's virtual clock (--node-profile or --sync async: `virtual_s`), an asynchronous
                              cluster's time grid (`time_s`), or a cluster's elapsed seconds (`elapsed_s`); runs of
                              different clocks (a barrier run beside an asynchronous one) share the figure
    consensus_vs_rounds.png   consensus distance and node spread vs rounds
    consensus_vs_time.png     the same vs time (as metric_vs_time.png)
    curves_vs_time.csv        the time figures' lines as numbers: line, clock, time, the four metrics
    best_vs_fanout.png        best node-average metric over rounds vs the degree s (when the grid varies fanout)
    best_vs_alpha.png         the same vs the Dirichlet alpha (when the grid varies alpha)
    accuracy_vs_bytes.png     final node-average metric vs bytes sent per node (when the grid varies compress)
    report.md                 the final table and the figures
    results.csv               one row per run: its grid point (or the settings it differs in) and final figures

Grouping: one line per K (`fragments`); lines are the mean over seeds (`seed` in the grid), the shaded
band spans min..max over seeds (error bars in the best-vs-s/alpha figures: +-1 std). Every other grid
key with several values (alpha, fanout, sampler, ...) gets its own row of subplots. Accuracy is shown in
percent; RMSE and the quadratic loss as they are (lower is better). "Best" is the best evaluated round
(highest accuracy, lowest RMSE/loss).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mosaicd.extras import needs
from mosaicd.files import replacing, write_whole
from mosaicd.outputs import NETWORK_METRICS, higher_is_better, read_rounds

HELP = "figures (PNG) and a results table (report.md) from a sweep's folder or one run's, or several compared"

LINE_KEY, SEED_KEY = "fragments", "seed"
RUN_KEY = "run"  # a comparison's line key: one line (and table row) per run
# a comparison's settings that may tell runs apart: the run's (RunConfig, the same on every node) and --batched,
# less the run's name and its deadline
NOT_COMPARED, ALSO_COMPARED = {"run_id", "round_deadline"}, ("batched",)
# the settings a single run's report lists
RUN_KEYS = ("task", "task_options", "nodes", "rounds", "fragments", "fanout", "sampler", "strategy", "partition",
            "alpha", "local_steps", "optimizer", "optimizer_options", "optimizer_state", "lr", "momentum",
            "lr_schedule", "lr_schedule_options", "lr_warmup_steps", "clip_grad_norm", "seed", "eval_every")
# a single run's report leaves out what is at its default (no momentum, no schedule, ...)
QUIET_DEFAULTS = {"optimizer_state": "keep", "momentum": 0.0, "lr_schedule": "constant", "lr_warmup_steps": 0,
                  "clip_grad_norm": None}
SERIES = NETWORK_METRICS


@dataclass
class RunData:
    name: str
    point: dict[str, Any]
    settings: dict[str, Any]
    rounds: list[dict[str, Any]]
    wall_s: float | None
    sent_per_node: float = math.nan  # bytes on the wire each node sent over the run, on average (nodes.csv)
    mode: str | None = None  # summary.json's: simulate, cluster, ...

    @property
    def clock(self) -> str | None:
        """The column its time axis reads (`clock_of`)."""
        return clock_of(self.rounds, self.mode)

    @property
    def metric(self) -> str:
        return str(self.rounds[-1].get("metric", "metric")) if self.rounds else "metric"

    @property
    def unit(self) -> Unit:
        return unit_of(self.metric, higher_is_better(self.rounds) is not False)

    def series(self, key: str) -> dict[int, float]:
        return {int(r["round"]): _num(r.get(key)) for r in self.rounds}


@dataclass
class Sweep:
    folder: Path
    info: dict[str, Any]
    grid: dict[str, list[Any]]
    runs: list[RunData]
    missing: list[str]

    @property
    def panel_keys(self) -> list[str]:
        return [k for k, v in self.grid.items() if k not in (self.line_key, SEED_KEY) and len(v) > 1]

    @property
    def compared(self) -> bool:
        """Several folders' runs, one line each (`load_many`)."""
        return bool(self.info.get("compared"))

    @property
    def line_key(self) -> str:
        return RUN_KEY if self.compared else LINE_KEY

    @property
    def differs(self) -> list[str]:
        """A comparison's settings whose values are not the same in every run."""
        return list(self.info.get("differs", []))

    @property
    def seeds(self) -> int:
        return len(self.grid.get(SEED_KEY, [None]))

    @property
    def single(self) -> bool:
        """One run's folder (a summary.json), not a sweep's."""
        return bool(self.info.get("single"))


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and value is not None else math.nan


def load(folder: Path | str) -> Sweep:
    """A sweep's folder (sweep.json), or one run's (summary.json) as a sweep of one with an empty grid."""
    folder = Path(folder)
    path = folder / "sweep.json"
    if not path.is_file():
        if (folder / "summary.json").is_file():
            return load_run(folder)
        raise FileNotFoundError(f"{folder}: no sweep.json or summary.json here; give the `out` folder of a "
                                "`mosaicd sweep`, or of a `mosaicd simulate` or `mosaicd cluster` run")
    info = json.loads(path.read_text())
    runs, missing = [], []
    for entry in info["runs"]:
        summary_path = folder / entry["dir"] / "summary.json"
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError):
            missing.append(entry["name"])
            continue
        if summary.get("status") in ("failed", "interrupted"):
            missing.append(f"{entry['name']} ({summary['status']})")
            continue
        runs.append(RunData(entry["name"], entry["point"], summary.get("settings", {}),
                            read_rounds(folder / entry["dir"]), summary.get("wall_s"),
                            sent_per_node(folder / entry["dir"], summary.get("settings", {}).get("nodes")),
                            summary.get("mode", info.get("mode"))))
    if not runs:
        raise FileNotFoundError(f"{folder}: none of the {len(info['runs'])} runs has finished (no summary.json)")
    return Sweep(folder, info, info.get("grid", {}), runs, missing)


def load_run(folder: Path | str) -> Sweep:
    """One run's folder (summary.json, as `mosaicd simulate/cluster --out` leave it) as a sweep of one."""
    folder = Path(folder)
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{folder}: cannot read summary.json ({exc})") from None
    if not isinstance(summary, dict) or "status" not in summary or not (folder / "rounds.csv").is_file():
        raise ValueError(f"{folder}: not a run's folder (a run leaves summary.json with its status, and rounds.csv): "
                         "give a run's or a sweep's --out")
    rounds = read_rounds(folder)
    status = summary.get("status", "finished")
    if not rounds:
        why = f" (the run {status}: {summary.get('error')})" if status in ("failed", "interrupted") else ""
        raise ValueError(f"{folder}: rounds.csv holds no evaluated round{why}")
    info = {"single": True, "mode": summary.get("mode"), "status": status, "error": summary.get("error")}
    run = RunData(folder.resolve().name, {}, summary.get("settings", {}), rounds, summary.get("wall_s"),
                  sent_per_node(folder, summary.get("settings", {}).get("nodes")), summary.get("mode"))
    return Sweep(folder, info, {}, [run], [])


def load_many(folders: Sequence[Path | str]) -> Sweep:
    """Several folders (runs' or sweeps') as one comparison: each of their runs a line of the figures and a row of
    the table, named by its folder as given, its point the settings in which the runs differ."""
    from mosaicd.settings import RunConfig

    given = [Path(f) for f in folders]
    twice = sorted({str(f) for f in given if sum(g.resolve() == f.resolve() for g in given) > 1})
    if twice:
        raise ValueError(f"{twice[0]}: given twice; give each folder once")
    runs, modes, missing = [], {}, []
    for sweep in map(load, given):
        for run in sweep.runs:
            name = str(sweep.folder) if sweep.single else f"{sweep.folder}/{run.name}"
            runs.append(RunData(name, {}, run.settings, run.rounds, run.wall_s, run.sent_per_node, run.mode))
            modes[name] = sweep.info.get("mode")
        missing += [f"{sweep.folder}/{name}" for name in sweep.missing]
    metrics = {run.name: run.metric for run in runs}
    if len(set(metrics.values())) > 1:
        raise ValueError("the runs measure different metrics (" + ", ".join(f"{m} in {n}" for n, m in metrics.items())
                         + "): report them apart")
    keys = [k for k in (*RunConfig.model_fields, *ALSO_COMPARED) if k not in NOT_COMPARED]
    values = {run.name: {"mode": modes[run.name], **{k: effective(run.settings, k) for k in keys}} for run in runs}
    differs = [k for k in ("mode", *keys) if len({json.dumps(v[k], sort_keys=True) for v in values.values()}) > 1]
    for run in runs:
        run.point = {RUN_KEY: run.name, **{k: values[run.name][k] for k in differs}}
    common = Path(os.path.commonpath([f.resolve() for f in given]))
    info = {"compared": True, "differs": differs, "folders": [str(f) for f in given],
            "mode": next(iter(set(modes.values()))) if len(set(modes.values())) == 1 else None}
    return Sweep(common if common not in given else common.parent, info, {RUN_KEY: [r.name for r in runs]}, runs,
                 missing)


def effective(settings: dict[str, Any], key: str) -> Any:
    """A setting's value as it acted on the run: alpha only under a Dirichlet partition (else None)."""
    if key == "alpha" and settings.get("partition") != "dirichlet":
        return None
    return settings.get(key)


def sent_per_node(folder: Path, nodes: Any) -> float:
    """The bytes on the wire a node sent over the run, averaged over the run's `nodes` (nodes.csv's bytes_out)."""
    try:
        with open(folder / "nodes.csv", newline="") as f:
            total = sum(int(row["bytes_out"] or 0) for row in csv.DictReader(f))
    except (OSError, KeyError, ValueError):
        return math.nan
    return total / nodes if isinstance(nodes, int) and nodes > 0 else math.nan


# ---------------------------------------------------------------------------------------------- units


@dataclass(frozen=True)
class Unit:
    metric: str
    scale: float
    label: str          # y label of the metric
    spread_label: str   # y label of the node spread
    higher_is_better: bool

    def fmt(self, value: float) -> str:
        return "-" if not math.isfinite(value) else f"{value * self.scale:.2f}" if self.scale == 100 else \
            f"{value:.4g}"


def unit_of(metric: str, higher_is_better: bool) -> Unit:
    """How to show `metric`; whether higher is better is the task's word (in the evaluation rows), not guessed."""
    better = "" if higher_is_better else " (lower is better)"
    if metric == "accuracy":
        return Unit(metric, 100.0, f"test accuracy (%){better}", "node spread (std of node accuracy, points)",
                    higher_is_better)
    if metric == "rmse":
        return Unit(metric, 1.0, f"test RMSE{better}", "node spread (std of node RMSE)", higher_is_better)
    if metric == "loss":
        return Unit(metric, 1.0, f"global loss f(x){better}", "node spread (std of node loss)", higher_is_better)
    return Unit(metric, 1.0, f"{metric}{better}", f"node spread (std of node {metric})", higher_is_better)


def mean_over_rounds(run: RunData) -> float:
    """Mean node-average metric over the evaluated rounds: a learning-speed summary (area under the curve)."""
    values = [v for v in run.series("node_average").values() if math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan


def best_of(run: RunData, unit: Unit) -> float:
    values = [v for v in run.series("node_average").values() if math.isfinite(v)]
    if not values:
        return math.nan
    return max(values) if unit.higher_is_better else min(values)


# ---------------------------------------------------------------------------------------------- grouping


def _label(key: str, value: Any) -> str:
    names = {"fragments": "K", "fanout": "s", "alpha": "alpha", "nodes": "n", "local_steps": "H"}
    if isinstance(value, dict):  # a --node-profile, a task's options: its file's name, or its JSON cut short
        text = str(value.get("source") or json.dumps(value, sort_keys=True))
        value = text if len(text) <= 32 else text[:31] + "…"
    return f"{names.get(key, key)}={value}"


def panels(sweep: Sweep, keys: Sequence[str]) -> list[dict[str, Any]]:
    """Every combination of the given grid keys' values (one subplot each), in grid order."""
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(sweep.grid[k] for k in keys))]


def select(sweep: Sweep, where: dict[str, Any]) -> list[RunData]:
    return [r for r in sweep.runs if all(r.point.get(k) == v for k, v in where.items())]


def line_values(sweep: Sweep) -> list[Any]:
    if sweep.compared:
        return list(sweep.grid[RUN_KEY])  # the runs in the order given
    if LINE_KEY in sweep.grid:
        return list(sorted(sweep.grid[LINE_KEY]))
    return [sweep.runs[0].settings.get(LINE_KEY)]


def in_line(run: RunData, k: Any, key: str = LINE_KEY) -> bool:
    return run.point.get(key, run.settings.get(key)) == k


def aggregate(runs: list[RunData], key: str, x_key: str = "round") -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                             np.ndarray, np.ndarray]:
    """Rounds common to all runs; mean, min, max and std over runs (seeds) of `key` at those rounds. `x_key`: the
    x of those rounds, the round itself or a time column (its mean over the runs)."""
    series = [r.series(key) for r in runs]
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    values = np.array([[s[t] for t in common] for s in series], dtype=float).reshape(len(series), len(common))
    x = np.array(common, dtype=float)  # the round, 0-based, as in rounds.csv and on the console
    if x_key != "round":  # each run's own clock
        times = [r.series(r.clock or x_key) for r in runs]
        x = np.array([np.mean([t[c] for t in times]) for c in common], dtype=float)
    with np.errstate(all="ignore"):
        return x, np.nanmean(values, 0), np.nanmin(values, 0), np.nanmax(values, 0), np.nanstd(values, 0)


# ---------------------------------------------------------------------------------------------- figures


def _colors(n: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return [cmap(0.9 * i / max(1, n - 1)) for i in range(n)]


def _line_label(sweep: Sweep, k: Any, runs: list[RunData]) -> str:
    """A line's legend: its K (a sweep's), or its run and the settings it differs in (a comparison's)."""
    if not sweep.compared:
        return _k_label(k, runs)
    return f"{k}" + "".join(f", {_label(key, runs[0].point.get(key))}" for key in sweep.differs)


def _k_label(k: Any, runs: list[RunData]) -> str:
    samplers = {r.settings.get("sampler") for r in runs}
    if k == 1 and samplers and "static" not in samplers:
        return "K=1 (EL)"
    return f"K={k}" + (" (D-PSGD)" if samplers == {"static"} else "")


def _panel_title(sweep: Sweep, where: dict[str, Any]) -> str:
    """The panel's grid point; alpha joins a Dirichlet panel when only the partition varies in the grid."""
    alpha = sweep.runs[0].settings.get("alpha")
    return ", ".join(_label(k, v) + (f", alpha={alpha}" if k == "partition" and v == "dirichlet"
                                     and "alpha" not in sweep.grid and alpha is not None else "")
                     for k, v in where.items())


def _context(sweep: Sweep) -> str:
    s = sweep.runs[0].settings
    parts = [str(s.get("task")), f"n={s.get('nodes')}"]
    for key, name in (("fanout", "s"), ("sampler", "sampler"), ("partition", "partition"), ("alpha", "alpha"),
                      ("local_steps", "H"), ("lr", "lr")):
        varied = {*sweep.grid, *sweep.differs}
        if key not in varied and key in s and not (key == "alpha" and (
                s.get("partition") != "dirichlet" or "partition" in varied)):
            parts.append(f"{name}={s[key]}")
    seeds = sweep.seeds
    return ", ".join(parts) + (f" | mean over {seeds} seeds, band = min..max" if seeds > 1 else "")


def _wants_log(ax: Any, unit: Unit, key: str) -> bool:
    """Log y for losses, RMSE spreads and distances that span more than two decades (never for accuracy)."""
    if unit.metric == "accuracy" and key != "consensus_distance":
        return False
    values = np.concatenate([line.get_ydata() for line in ax.get_lines()] or [np.array([])]).astype(float)
    values = values[np.isfinite(values)]
    return bool(values.size) and values.min() > 0 and values.max() / values.min() > 100


CLOCKS = {"virtual_s": "virtual time (s, simulate's clock of --node-profile)",
          "time_s": "time (s, since the asynchronous nodes' start)", "elapsed_s": "elapsed time (s, since the start)"}
MIXED = "time"  # a figure whose runs have different clocks
CLOCK_NAMES = {"virtual_s": "virtual", "time_s": "async wall", "elapsed_s": "wall"}


def clock_of(rounds: list[dict[str, Any]], mode: str | None) -> str | None:
    """The column a run's time axis reads: simulate's virtual clock where every row has one (--node-profile, or
    --sync async), an asynchronous cluster's time grid (`time_s`), a cluster's elapsed seconds; else None."""
    def every(key: str) -> bool:
        return bool(rounds) and all(math.isfinite(_num(row.get(key))) for row in rounds)

    for key in ("virtual_s", "time_s"):
        if every(key):
            return key
    return "elapsed_s" if mode == "cluster" and every("elapsed_s") else None


def time_key(sweep: Sweep) -> str | None:
    """The time axis of a sweep's figures: its runs' one clock, MIXED where they differ, None where one has none."""
    clocks = {run.clock for run in sweep.runs}
    if not clocks or None in clocks:
        return None
    return next(iter(clocks)) if len(clocks) == 1 else MIXED


def figure_vs_rounds(sweep: Sweep, keys: tuple[str, str], titles: tuple[str, str], path: Path,
                     x_key: str = "round") -> Path:
    """`x_key`: "round", or a time column (`time_key`)."""
    import matplotlib.pyplot as plt

    rows = panels(sweep, sweep.panel_keys)
    ks = line_values(sweep)
    colors = _colors(len(ks))
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.8 * len(rows) + 0.6), squeeze=False,
                             sharex="all" if x_key != "round" else "none")  # times compare across the panels
    for row, where in zip(axes, rows, strict=True):
        chosen = select(sweep, where)
        if not chosen:
            for ax in row:
                ax.set_visible(False)
            continue
        unit = chosen[0].unit
        for ax, key, title in zip(row, keys, titles, strict=True):
            scale = unit.scale if key in ("node_average", "average_model", "node_spread") else 1.0
            for k, color in zip(ks, colors, strict=True):
                runs = [r for r in chosen if in_line(r, k, sweep.line_key)]
                if not runs:
                    continue
                x, mean, lo, hi, _ = aggregate(runs, key, x_key)
                clock = f" [{CLOCK_NAMES[runs[0].clock or '']}]" if x_key == MIXED else ""
                ax.plot(x, mean * scale, color=color, lw=1.8, marker="o" if len(x) <= 12 else None, ms=3,
                        label=_line_label(sweep, k, runs) + clock
                        + (f" ({len(runs)} seeds)" if len(runs) != sweep.seeds else ""))
                if len(runs) > 1:
                    ax.fill_between(x, lo * scale, hi * scale, color=color, alpha=0.18, lw=0)
            ylabel = {"node_average": unit.label, "average_model": unit.label, "node_spread": unit.spread_label,
                      "consensus_distance": "consensus distance (mean L2 to the average model)"}[key]
            ax.set_xlabel({"round": "round", **CLOCKS, MIXED: "time (s, each run's clock in brackets)"
                           }.get(x_key, x_key))
            ax.set_ylabel(ylabel)
            metric_name = {"accuracy": "accuracy", "rmse": "RMSE", "loss": "loss"}.get(unit.metric, unit.metric)
            ax.set_title(title.format(metric=metric_name) + (f" ({_panel_title(sweep, where)})" if where else ""))
            if _wants_log(ax, unit, key):
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
    return _saved(fig, sweep, path)


def _small_multiples(sweep: Sweep, x_key: str, width: float, height: float) -> tuple[Any, list]:
    """A figure of one subplot per combination of the grid's other panel keys than `x_key` (3 a row): the figure,
    and (axes, grid point, its runs) of the subplots that have runs (the others hidden)."""
    import matplotlib.pyplot as plt

    rows = panels(sweep, [k for k in sweep.panel_keys if k != x_key])
    cols = min(3, len(rows))
    nrows = math.ceil(len(rows) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, height * nrows + 0.6), squeeze=False)
    drawn = []
    for i, ax in enumerate(axes.flat):
        chosen = select(sweep, rows[i]) if i < len(rows) else []
        if chosen:
            drawn.append((ax, rows[i], chosen))
        else:
            ax.set_visible(False)
    return fig, drawn


def _saved(fig: Any, sweep: Sweep, path: Path, spread: str | None = None) -> Path:
    """`fig` titled with the sweep's context (`spread`: what the seeds' spread is drawn as, if not a band) and
    written to `path`."""
    import matplotlib.pyplot as plt

    context = _context(sweep)
    fig.suptitle(context if spread is None else context.replace("band = min..max", spread), fontsize=10)
    fig.tight_layout()
    with replacing(path) as f:
        fig.savefig(f, dpi=110, format=path.suffix.lstrip("."))
    plt.close(fig)
    return path


def figure_best_vs(sweep: Sweep, x_key: str, x_label: str, path: Path, log_x: bool = False) -> Path:
    ks = line_values(sweep)
    colors = _colors(len(ks))
    fig, drawn = _small_multiples(sweep, x_key, 5.5, 4.0)
    xs = sorted(sweep.grid[x_key])
    for ax, where, chosen in drawn:
        unit = chosen[0].unit
        for k, color in zip(ks, colors, strict=True):
            means, stds, used = [], [], []
            for xv in xs:
                values = [best_of(r, unit) for r in chosen if in_line(r, k) and r.point.get(x_key) == xv]
                values = [v for v in values if math.isfinite(v)]
                if values:
                    used.append(xv)
                    means.append(np.mean(values) * unit.scale)
                    stds.append(np.std(values) * unit.scale)
            if used:
                ax.errorbar(used, means, yerr=stds, color=color, marker="o", ms=4, capsize=3, lw=1.6,
                            label=_k_label(k, [r for r in chosen if in_line(r, k)]))
        ax.set_xlabel(x_label)
        ax.set_ylabel("best " + unit.label.replace("test ", "test ", 1) + " over rounds")
        ax.set_title(f"best node-average {'accuracy' if unit.metric == 'accuracy' else unit.metric} vs {x_label}"
                     + (f" ({_panel_title(sweep, where)})" if where else ""))
        if log_x:
            ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([str(v) for v in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _saved(fig, sweep, path, "error bars = +-1 std")


def figure_metric_vs_bytes(sweep: Sweep, path: Path) -> Path:
    """Final node-average metric against the bytes a node sent, one line per K through the codecs (`compress`)."""
    ks = line_values(sweep)
    colors = _colors(len(ks))
    fig, drawn = _small_multiples(sweep, "compress", 6.0, 4.4)
    for ax, where, chosen in drawn:
        unit = chosen[0].unit
        for k, color in zip(ks, colors, strict=True):
            points = []
            for codec in sweep.grid["compress"]:
                runs = [r for r in chosen if in_line(r, k) and r.point.get("compress") == codec]
                finals = [_num(r.rounds[-1].get("node_average")) for r in runs if r.rounds]
                sent = [r.sent_per_node for r in runs]
                if finals and all(map(math.isfinite, sent)):
                    points.append((float(np.mean(sent)) / 2**20, float(np.mean(finals)) * unit.scale, str(codec)))
            points.sort()
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color, marker="o", lw=1.6, ms=5,
                    label=_k_label(k, [r for r in chosen if in_line(r, k)]))
            for x, y, codec in points:
                ax.annotate(codec, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        ax.set_xscale("log")
        ax.set_xlabel("MiB sent per node over the run (on the wire)")
        ax.set_ylabel("final node-average " + unit.label)
        ax.set_title("final node-average vs bytes sent" + (f" ({_panel_title(sweep, where)})" if where else ""))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return _saved(fig, sweep, path, "points = mean")


# ---------------------------------------------------------------------------------------------- the table


def _pm(values: list[float], unit: Unit | None) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    scale = unit.scale if unit else 1.0
    mean, std = float(np.mean(values)) * scale, float(np.std(values)) * scale
    digits = 2 if scale == 100 else None
    if digits is None:
        return f"{mean:.4g}" + (f" ± {std:.2g}" if len(values) > 1 else "")
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(values) > 1 else "")


def table_keys(sweep: Sweep) -> list[str]:
    """The table's first columns: a sweep's grid keys (panels, then K, then the rest; the seeds averaged), or a
    comparison's run and the settings its runs differ in."""
    if sweep.compared:
        return [RUN_KEY, *sweep.differs]
    keys = [k for k in sweep.grid if k != SEED_KEY]
    order = sweep.panel_keys + ([LINE_KEY] if LINE_KEY in sweep.grid else [])
    return order + [k for k in keys if k not in order]


def table(sweep: Sweep) -> list[str]:
    keys = table_keys(sweep)
    unit = sweep.runs[0].unit
    m = unit.label.replace(" (lower is better)", "")
    spread = unit.spread_label.split(" (")[0] + (" (points)" if unit.scale == 100 else "")
    header = [*(_label(k, "").rstrip("=") for k in keys), "seeds", f"node-average {m}", f"average-model {m}",
              f"best node-average {m}", f"node-average {m}, mean over rounds", "consensus distance", spread,
              "train loss", "MiB sent per node", "wall (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    if sweep.compared:
        cells = [run.point for run in sweep.runs]
    else:
        values = [sorted(sweep.grid[k]) if k == LINE_KEY else sweep.grid[k] for k in keys]
        cells = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
    for cell in cells:
        runs = select(sweep, cell)
        if not runs:
            continue
        finals = [r.rounds[-1] for r in runs if r.rounds]
        lines.append("| " + " | ".join([
            *(str(cell[k]) for k in keys), str(len(runs)),
            _pm([_num(f.get("node_average")) for f in finals], unit),
            _pm([_num(f.get("average_model")) for f in finals], unit),
            _pm([best_of(r, unit) for r in runs], unit),
            _pm([mean_over_rounds(r) for r in runs], unit),
            _pm([_num(f.get("consensus_distance")) for f in finals], None),
            _pm([_num(f.get("node_spread")) for f in finals], unit),
            _pm([_num(f.get("train_loss")) for f in finals], None),
            _pm([r.sent_per_node / 2**20 for r in runs], None),
            _pm([_num(r.wall_s) for r in runs], None),
        ]) + " |")
    return lines


RESULT_COLUMNS = ("round", "metric", "node_average", "average_model", "best_node_average", "mean_over_rounds",
                  "consensus_distance", "node_spread", "train_loss", "bytes_sent_per_node", "wall_s")


def write_results_csv(sweep: Sweep, path: Path) -> Path:
    """One row per run: its name, its point (grid values, or the settings a comparison's runs differ in) and its
    final figures as recorded (accuracy as a fraction), for a spreadsheet or pandas."""
    keys = [k for k in dict.fromkeys(k for run in sweep.runs for k in run.point) if k != RUN_KEY]
    with replacing(path) as raw, io.TextIOWrapper(raw, newline="") as f:
        writer = csv.writer(f)
        writer.writerow([RUN_KEY, *keys, *RESULT_COLUMNS])
        for run in sweep.runs:
            final = run.rounds[-1] if run.rounds else {}
            point = [json.dumps(v) if isinstance(v, dict | list) else v for v in (run.point.get(k) for k in keys)]
            writer.writerow([run.name, *point, final.get("round"), run.metric, final.get("node_average"),
                             final.get("average_model"), best_of(run, run.unit), mean_over_rounds(run),
                             final.get("consensus_distance"), final.get("node_spread"), final.get("train_loss"),
                             run.sent_per_node, run.wall_s])
    return path


CURVE_COLUMNS = ("line", "clock", "time", *SERIES)


def write_curves_vs_time(sweep: Sweep, path: Path) -> Path:
    """The time figures' lines as numbers (each line the mean over its seeds, at the rounds they all have): one row
    per line and point, its clock (the rounds.csv column its time is) and its time."""
    with replacing(path) as raw, io.TextIOWrapper(raw, newline="") as f:
        _write_curves(sweep, csv.writer(f))
    return path


def _write_curves(sweep: Sweep, writer: Any) -> None:
    writer.writerow(CURVE_COLUMNS)
    for where in panels(sweep, sweep.panel_keys):
        chosen = select(sweep, where)
        for k in line_values(sweep):
            runs = [r for r in chosen if in_line(r, k, sweep.line_key)]
            if not runs:
                continue
            x, *_ = aggregate(runs, SERIES[0], MIXED)
            means = [aggregate(runs, key, MIXED)[1] for key in SERIES]
            label = _line_label(sweep, k, runs) + (f" ({_panel_title(sweep, where)})" if where else "")
            for i, t in enumerate(x):
                writer.writerow([label, runs[0].clock, f"{t:.9g}", *(f"{m[i]:.9g}" for m in means)])


def settings_line(settings: dict[str, Any], leave_out: Sequence[str] = ()) -> str:
    """A run's settings that the report lists (RUN_KEYS), less those at their quiet defaults and `leave_out`."""
    return ", ".join(f"{k}={settings[k]}" for k in RUN_KEYS if k in settings and k not in leave_out and not (
        k == "alpha" and settings.get("partition") != "dirichlet") and settings[k] != {}
        and (k not in QUIET_DEFAULTS or settings[k] != QUIET_DEFAULTS[k]))


def write_report(folder: Path | str | Sequence[Path | str], out: Path | str | None = None) -> dict[str, Any]:
    """`folder`: a sweep's or a run's folder; several: their runs compared (`load_many`)."""
    with needs("drawing figures"):
        import matplotlib

    matplotlib.use("Agg")
    folders = [folder] if isinstance(folder, str | Path) else list(folder)
    sweep = load(folders[0]) if len(folders) == 1 else load_many(folders)
    out = Path(out) if out else sweep.folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, Path]] = [
        ("Node-average and average-model metric vs rounds", figure_vs_rounds(
            sweep, ("node_average", "average_model"), ("node-average {metric}", "average-model {metric}"),
            out / "metric_vs_rounds.png")),
        ("Consensus distance and node spread vs rounds", figure_vs_rounds(
            sweep, ("consensus_distance", "node_spread"), ("consensus distance", "node spread"),
            out / "consensus_vs_rounds.png")),
    ]
    clock = time_key(sweep)
    if clock is not None:
        figures.append(("Node-average and average-model metric vs time", figure_vs_rounds(
            sweep, ("node_average", "average_model"), ("node-average {metric}", "average-model {metric}"),
            out / "metric_vs_time.png", x_key=clock)))
        figures.append(("Consensus distance and node spread vs time", figure_vs_rounds(
            sweep, ("consensus_distance", "node_spread"), ("consensus distance", "node spread"),
            out / "consensus_vs_time.png", x_key=clock)))
    if len(sweep.grid.get("fanout", [])) > 1:
        figures.append(("Best node-average metric vs degree s", figure_best_vs(
            sweep, "fanout", "degree s (receivers per fragment)", out / "best_vs_fanout.png")))
    if len(sweep.grid.get("alpha", [])) > 1:
        figures.append(("Best node-average metric vs Dirichlet alpha",
                        figure_best_vs(sweep, "alpha", "Dirichlet alpha", out / "best_vs_alpha.png", log_x=True)))
    if len(sweep.grid.get("compress", [])) > 1:
        figures.append(("Final node-average metric vs bytes sent per node",
                        figure_metric_vs_bytes(sweep, out / "accuracy_vs_bytes.png")))
    s = sweep.runs[0].settings
    base = ", ".join(f"{k}={v}" for k, v in sweep.info.get("base", {}).items())
    final_round = max((r.rounds[-1]["round"] + 1 for r in sweep.runs if r.rounds), default=0)
    if sweep.single:
        status = str(sweep.info.get("status"))
        error = sweep.info.get("error")
        lines = [f"# Run report: {sweep.folder}", "",
                 f"- mode `{sweep.info.get('mode')}`, status {status}" + (f": {error}" if error else ""),
                 "- settings: " + settings_line(s),
                 f"- task {s.get('task')}, metric {sweep.runs[0].metric}, {final_round} rounds"
                 + (f" of {s.get('rounds')}" if s.get("rounds") not in (None, final_round) else ""),
                 "",
                 f"## Final figures (round {final_round - 1}, the last evaluated; rounds count from 0)"]
    elif sweep.compared:
        lines = [f"# Comparison report: {', '.join(sweep.info['folders'])}", "",
                 f"- runs: {len(sweep.runs)}" + (f" (missing: {', '.join(sweep.missing)})" if sweep.missing else ""),
                 "- they differ in: " + (", ".join(sweep.differs) or "no setting of the run"),
                 "- settings they share: " + (settings_line(s, sweep.differs) or "(defaults)"),
                 f"- task {s.get('task')}, metric {sweep.runs[0].metric}",
                 "",
                 "## Final figures (each run's last evaluated round, counted from 0)"]
    else:
        lines = [f"# Sweep report: {sweep.folder}", ""]
        if sweep.info.get("description"):
            lines += [sweep.info["description"], ""]
        lines += [
            f"- spec: `{sweep.info.get('spec')}`, mode `{sweep.info.get('mode')}`",
            f"- runs: {len(sweep.runs)} finished of {len(sweep.runs) + len(sweep.missing)}"
            + (f" (missing: {', '.join(sweep.missing)})" if sweep.missing else ""),
            f"- base settings: {base or '(defaults)'}",
            "- grid: " + ", ".join(f"{k} = {v}" for k, v in sweep.grid.items()),
            f"- task {s.get('task')}, metric {sweep.runs[0].metric}, {final_round} rounds",
            "",
            "## Final figures (the last evaluated round, counted from 0; mean ± std over seeds)"]
    lines += [
        "",
        *table(sweep),
        "",
        "Best node-average: the best evaluated round of each run; mean over rounds: the node-average metric "
        "averaged over the evaluated rounds (how fast it learns); both then mean ± std over seeds. Consensus "
        "distance: mean over nodes of ||x_i - mean_j x_j||. Node spread: std over nodes of the node metric. "
        "MiB sent per node: the fragment messages' bytes on the wire over the run (nodes.csv). Wall: seconds per run.",
        "Each run's figures, as recorded: [results.csv](results.csv)."
        + (" The time figures' lines: [curves_vs_time.csv](curves_vs_time.csv); a run's clock is simulate's virtual "
           "one (virtual), an asynchronous cluster's seconds since its nodes' start (async wall), or a cluster's "
           "seconds since its start (wall)." if clock is not None else ""),
        "",
        "## Figures",
        "",
    ]
    for title, path in figures:
        lines += [f"### {title}", "", f"![{title}]({path.name})", ""]
    write_whole(out / "report.md", "\n".join(lines))
    results = write_results_csv(sweep, out / "results.csv")
    curves = write_curves_vs_time(sweep, out / "curves_vs_time.csv") if clock is not None else None
    return {"out": str(out), "report": str(out / "report.md"), "results": str(results),
            **({"curves_vs_time": str(curves)} if curves is not None else {}),
            "figures": [str(p) for _, p in figures],
            "runs": len(sweep.runs), "missing": len(sweep.missing),
            **({"status": sweep.info.get("status")} if sweep.single else {})}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", nargs="+", help="a sweep's folder (the spec's "
                        "`out`) or one run's (the --out of `mosaicd simulate` or `mosaicd cluster`); several: their "
                        "runs compared, one line and one table row each")
    parser.add_argument("--out", type=Path, default=None, help="where to write [default: RUN_DIR/report; several: "
                        "report/ in their common parent folder]")


def main(args: argparse.Namespace) -> int:
    result = write_report(args.run_dir, args.out)
    print(json.dumps(result))
    return 0
