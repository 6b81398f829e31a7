"""A sweep's wall time with runs one after another against several at once (`mosaicd sweep --jobs N`).

Runs the spec twice in fresh folders, `--jobs 1` (the reference) then `--jobs N`, and prints each wall time, the
CPU seconds (the sweep's `cpu_s`: itself and its children), the speed-up and whether every run's `model_sha256` is
the same both ways (it must be).

Usage: python bench/sweep_jobs.py [--spec examples/digits-paper.toml] [--jobs 2] [--set rounds=20 ...]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mosaicd.experiments.sweep_runs import model_hashes


def sweep(spec: Path, out: Path, jobs: int, sets: list[str]) -> dict:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mosaicd", "sweep", str(spec), "--out", str(out), "--jobs", str(jobs),
                           "--quiet", *(a for s in sets for a in ("--set", s))], capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"sweep --jobs {jobs} exited {done.returncode}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    return {"jobs": jobs, "wall_s": round(wall, 1), "cpu_s": result["cpu_s"], "runs": result["ran"],
            "hashes": model_hashes(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=Path("examples/digits-paper.toml"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = sweep(args.spec.resolve(), Path(tmp) / "one", 1, args.sets)
        print(f"--jobs 1: {one['runs']} runs in {one['wall_s']} s wall, {one['cpu_s']} CPU-s", flush=True)
        many = sweep(args.spec.resolve(), Path(tmp) / "many", args.jobs, args.sets)
        print(f"--jobs {args.jobs}: {many['runs']} runs in {many['wall_s']} s wall, {many['cpu_s']} CPU-s", flush=True)
    same = one["hashes"] == many["hashes"] and len(one["hashes"]) == one["runs"]
    print(f"speed-up {one['wall_s'] / many['wall_s']:.2f}x; the same models both ways: {same}")
    print(json.dumps({"spec": str(args.spec), "sets": args.sets, "runs": one["runs"], "jobs": args.jobs,
                      "wall_s_jobs_1": one["wall_s"], "wall_s_jobs_n": many["wall_s"], "cpu_s_jobs_1": one["cpu_s"],
                      "cpu_s_jobs_n": many["cpu_s"], "speedup": round(one["wall_s"] / many["wall_s"], 2),
                      "same_models": same}))


if __name__ == "__main__":
    main()
