"""`mosaicd runs [DIR]`: the runs under a folder, from their files only (any run that left a summary.json:
finished, failed, interrupted or still running), oldest first.

One row per run: its id (the run's own, else its folder under DIR), status, task, K, the optimizer of the local
steps (with its options, if any), rounds done of the run's,
the newest evaluation (node-average metric, at which round: counted from 0, as in rounds.csv), when it started
and its folder. `--json` prints the same as a list of objects, with the error of a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from mosaicd.rundir import list_runs

DEFAULT_DIR = Path("runs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=Path, nargs="?", default=DEFAULT_DIR,
                        help=f"the folder to look in, at any depth [default: {DEFAULT_DIR}]")
    parser.add_argument("--json", action="store_true", help="print the runs as a JSON list (for scripts)")


def metric_text(run: dict[str, Any]) -> str:
    """`accuracy 0.9258 @ 29`: the newest node-average metric and the round it was measured at."""
    value = run.get("node_average")
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return f"{run.get('metric') or 'metric'} {value:.4g} @ {run.get('evaluated_round')}"


def optimizer_text(run: dict[str, Any]) -> str:
    """`adamw` or `adam(betas=[0.9, 0.99])`: the optimizer as the run's settings give it (older runs: `-`)."""
    options = run.get("optimizer_options") or {}
    given = ",".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in sorted(options.items()))
    return f"{run.get('optimizer') or '-'}" + (f"({given})" if given else "")


def render(runs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("id", "status", "task", "K", "optimizer", "rounds", "metric (round)", "started", "folder"):
        table.add_column(name, justify="right" if name in ("K", "rounds") else "left", no_wrap=True)
    for run in runs:
        done, total = run.get("rounds_done"), run.get("rounds")
        status = str(run.get("status") or "-") + (f" (slurm {run['slurm_job']})" if run.get("slurm_job") else "")
        table.add_row(str(run["id"]), status, str(run.get("task") or "-"),
                      str(run.get("fragments") or "-"), optimizer_text(run),
                      f"{'-' if done is None else done}/{total or '-'}",
                      metric_text(run), (run.get("started") or "-").replace("T", " ")[:19], run["folder"])
    return table


def main(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        raise FileNotFoundError(f"{args.dir}: no such folder (give the folder your runs' --out are in)")
    runs = list_runs(args.dir)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    from mosaicd.terminal import console, show

    if not runs:
        print(f"no runs under {args.dir} (a run's folder holds its summary.json)")
        return 0
    show(console(), render(runs))
    return 0
