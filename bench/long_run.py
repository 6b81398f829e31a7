"""Seconds per round of a long `mosaicd simulate` with an evaluation every round: does the end of a run cost
what its start did? (issue #24, item 5)

The issue's case: `--task quadratic --nodes 4 --fragments 4 --fanout 2 --eval-every 1`, at 300, 600, 1,200 and
3,000 rounds. For each run: the wall time, seconds per round overall, the median seconds per round of the first
stretch (rounds 10 .. 10+S) and of the last (the last S rounds), and their ratio (1.0: flat; it grew with
the run when summary.json was rewritten with every row at every evaluation).

    .venv/bin/python bench/long_run.py                       # about a minute on 2 cores
    .venv/bin/python bench/long_run.py --rounds 300,600 --stretch 50

To measure another revision with the same script: `git archive REV src | tar -x -C /tmp/rev` then
`PYTHONPATH=/tmp/rev/src .venv/bin/python bench/long_run.py`.

Last line of stdout: a JSON object {"runs": [{"rounds", "wall_s", "s_per_round", "first_s", "last_s",
"ratio"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mosaicd.experiments.simulate import run_simulation
from mosaicd.logs import configure_logging
from mosaicd.progress import RoundProgress
from mosaicd.settings import Settings


def one_run(rounds: int, stretch: int, workdir: Path) -> dict[str, Any]:
    """One run of `rounds` rounds: its wall time and the median seconds per round of its first and last
    `stretch` rounds."""
    times: list[float] = []

    def mark(p: RoundProgress) -> None:
        times.append(time.perf_counter())

    settings = Settings.load(task="quadratic", nodes=4, fragments=4, fanout=2, eval_every=1, rounds=rounds,
                             out=workdir / f"rounds-{rounds}")
    started = time.perf_counter()
    run_simulation(settings, progress=False, on_round=mark)
    wall = time.perf_counter() - started
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    stretch = min(stretch, max(1, (len(steps) - 10) // 2))
    first, last = statistics.median(steps[10:10 + stretch]), statistics.median(steps[-stretch:])
    return {"rounds": rounds, "wall_s": round(wall, 2), "s_per_round": round(wall / rounds, 5),
            "first_s": round(first, 5), "last_s": round(last, 5), "ratio": round(last / first, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", default="300,600,1200,3000", help="comma-separated run lengths")
    parser.add_argument("--stretch", type=int, default=100, help="rounds in the first and the last stretch")
    args = parser.parse_args()
    configure_logging("warning")
    runs = []
    with tempfile.TemporaryDirectory(prefix="mosaic-long-") as tmp:
        print(f"{'rounds':>7} {'wall s':>8} {'s/round':>9} {'first ms':>9} {'last ms':>9} {'last/first':>10}")
        for rounds in (int(r) for r in args.rounds.split(",")):
            run = one_run(rounds, args.stretch, Path(tmp))
            runs.append(run)
            print(f"{run['rounds']:>7} {run['wall_s']:>8.2f} {run['s_per_round']:>9.4f} {run['first_s'] * 1e3:>9.2f} "
                  f"{run['last_s'] * 1e3:>9.2f} {run['ratio']:>10.2f}", flush=True)
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
