"""Before against after: one bench command run on two versions of `src`, in turn, each figure's after / before.

Why a script: on a shared 2-core host the same run reads up to 10% apart within minutes, and the host drifts. A
variant always run second gains or loses what the drift gives it: Prometheus' updates made to do nothing read 10%
less CPU in the nodes' loops in three pairs all run in one order, and nothing (4.54 against 4.50 ms) in four pairs
run ABBA (bench/README.md, "eighth pass"). So the pairs alternate their order (before, after; after, before; ...)
and the figure given is the median of the pairs' ratios, each pair's runs side by side in time.

A version is a git revision (its `src`, `git archive`d into a temporary folder) or `.` (this checkout's `src`);
it is put first on PYTHONPATH, which the command's own subprocesses (a cluster's nodes) inherit. The command is
any bench script that prints one JSON object as its last line; `--key` names figures in it by their dotted path
(a list's item by its index: `batched.0.batched_s`).

    .venv/bin/python bench/ab.py --before HEAD~1 --key warm.node_loop_ms_per_round --key warm.cpu_per_round_s \\
        -- bench/tutorial.py --no-cold --no-simulate
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = "."  # the checkout's own src


def figure(report: dict[str, Any], key: str) -> float:
    """The number at `key` (dotted: `warm.wall_s`) of a bench's JSON report; ValueError naming what is missing."""
    value: Any = report
    for part in key.split("."):
        if isinstance(value, list):  # a list's item by its index: `batched.0.batched_s`
            if not part.isdigit() or int(part) >= len(value):
                raise ValueError(f"--key {key}: {part!r} is no index of a list of {len(value)} there")
            value = value[int(part)]
            continue
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"--key {key}: the report has no {part!r} there (it has {sorted(value)[:12]})"
                             if isinstance(value, dict) else f"--key {key}: {part!r} is below a number")
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"--key {key}: {value!r} is not a number")
    return float(value)


def source_of(version: str, into: Path) -> Path:
    """The `src` folder of `version`: this checkout's (`.`), or a revision's, extracted under `into`. SystemExit
    naming --before/--after where git does not know it."""
    if version == HERE:
        return ROOT / "src"
    done = subprocess.run(["git", "-C", str(ROOT), "archive", version, "src"], capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"ab.py: {version!r} is no revision of this repository: {done.stderr.decode().strip()}")
    folder = into / version.replace("/", "_")
    with tarfile.open(fileobj=BytesIO(done.stdout)) as archive:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.11.4 and later
        archive.extractall(folder, **safe)
    return folder / "src"


def order(pairs: int) -> list[tuple[int, str]]:
    """(pair, variant) in the order they run: before, after; after, before; before, after; ..."""
    runs = []
    for pair in range(pairs):
        first, second = ("before", "after") if pair % 2 == 0 else ("after", "before")
        runs += [(pair, first), (pair, second)]
    return runs


def run_once(command: list[str], src: Path, timeout: float) -> dict[str, Any]:
    """One run of `command` with `src` first on PYTHONPATH: its last stdout line, parsed. RuntimeError with the
    end of its output where it fails or prints no JSON last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no end within --timeout {timeout:g} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    try:
        report = json.loads(lines[-1])
    except ValueError:
        raise RuntimeError(f"its last line is no JSON: {lines[-1][:300]!r}") from None
    if not isinstance(report, dict):
        raise RuntimeError("its last line is JSON but no object")
    return report


def summary(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, dict[str, Any]]:
    """Per key: each pair's after / before, their median, and the medians of each variant's figures."""
    out = {}
    for key in keys:
        ratios = []
        for pair in sorted({r["pair"] for r in rows}):
            of = {r["variant"]: r["figures"][key] for r in rows if r["pair"] == pair}
            if len(of) == 2:
                ratios.append(of["after"] / of["before"] if of["before"] else math.nan)
        out[key] = {"ratios": [round(x, 4) for x in ratios],
                    "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
                    "before_median": statistics.median(r["figures"][key] for r in rows if r["variant"] == "before"),
                    "after_median": statistics.median(r["figures"][key] for r in rows if r["variant"] == "after")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a git revision, or . (this checkout's src)")
    parser.add_argument("--after", default=HERE, help="a git revision, or . (this checkout's src) [default: .]")
    parser.add_argument("--pairs", type=int, default=4, help="pairs of runs, their order alternating [default: 4]")
    parser.add_argument("--key", action="append", required=True, help="a figure of the report (dotted path); "
                        "give it once per figure")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take [default: 900]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bench script and its flags")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --: -- bench/tutorial.py --no-cold")
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: at least 1")
    with tempfile.TemporaryDirectory(prefix="mosaic-ab-") as tmp:
        sources = {"before": source_of(args.before, Path(tmp)), "after": source_of(args.after, Path(tmp))}
        rows: list[dict[str, Any]] = []
        runs = order(args.pairs)
        for i, (pair, variant) in enumerate(runs, 1):
            load = os.getloadavg()[0]
            print(f"run {i}/{len(runs)}: pair {pair + 1}, {variant} ({getattr(args, variant)}), load {load:.1f} ...",
                  end=" ", flush=True)
            started = time.monotonic()
            try:
                report = run_once(command, sources[variant], args.timeout)
                figures = {key: figure(report, key) for key in args.key}
            except (RuntimeError, ValueError) as exc:
                print("failed", flush=True)
                print(f"ab.py: the {variant} run of pair {pair + 1} failed: {exc}", file=sys.stderr)
                return 1
            rows.append({"pair": pair, "variant": variant, "load_before": round(load, 2),
                         "seconds": round(time.monotonic() - started, 1), "figures": figures})
            print(" ".join(f"{k}={v:g}" for k, v in figures.items()), flush=True)
    result = summary(rows, args.key)
    for key, s in result.items():
        print(f"{key}: before {s['before_median']:g}, after {s['after_median']:g} (medians); after / before, each "
              f"pair {', '.join(f'{x:g}' for x in s['ratios'])}: median {s['median_ratio']:g}")
    print(json.dumps({"before": args.before, "after": args.after, "command": command, "runs": rows,
                      "figures": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
