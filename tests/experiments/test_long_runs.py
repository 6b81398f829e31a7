"""A long run costs the same per round at its end as at its start: rows are appended, summary.json stays small,
and the progress printer keeps a bounded window (issue #24, item 5).

Measured within one run, first stretch against last, so that a busy machine slows both alike: the bytes this
process writes per round (`wchar` of /proc/self/io: a count of work, not a time) and the median seconds per
round (with a generous factor). Before rows were appended, summary.json was rewritten with every row so far at
every evaluation: at 1,000 rounds the last stretch wrote about six times the first's bytes per round.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import pytest

from mosaicd.experiments.simulate import run_simulation
from mosaicd.outputs import read_rounds
from mosaicd.progress import RoundProgress
from mosaicd.settings import Settings

ROUNDS, STRETCH = 1000, 200


def written_bytes() -> int:
    """Bytes this process has passed to write() so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io is Linux's")
def test_the_last_rounds_cost_what_the_first_did(tmp_path: Path) -> None:
    marks: list[tuple[float, int]] = []
    sizes: dict[int, int] = {}

    def mark(p: RoundProgress) -> None:
        marks.append((time.perf_counter(), written_bytes()))
        if p.round in (STRETCH, ROUNDS - 2):
            sizes[p.round] = (tmp_path / "summary.json").stat().st_size

    settings = Settings.load(task="quadratic", nodes=4, fragments=4, fanout=2, eval_every=1, rounds=ROUNDS,
                             out=tmp_path)
    summary = run_simulation(settings, progress=True, on_round=mark)  # the printer's plain lines, on stderr
    assert summary["status"] == "finished" and len(marks) == ROUNDS

    def per_round(start: int) -> tuple[float, float]:
        """Median seconds and mean bytes written per round over the rounds start .. start + STRETCH."""
        stretch = marks[start:start + STRETCH + 1]
        seconds = [b[0] - a[0] for a, b in zip(stretch, stretch[1:], strict=False)]
        return statistics.median(seconds), (stretch[-1][1] - stretch[0][1]) / STRETCH

    first_s, first_bytes = per_round(50)
    last_s, last_bytes = per_round(ROUNDS - STRETCH - 1)
    print(f"\nper round, rounds 50-{50 + STRETCH} against the last {STRETCH}: {first_s * 1e3:.2f} ms / "
          f"{last_s * 1e3:.2f} ms, {first_bytes:.0f} B / {last_bytes:.0f} B written")
    assert last_bytes <= 1.3 * first_bytes, (first_bytes, last_bytes)
    assert last_s <= 3 * first_s + 0.002, (first_s, last_s)
    # what makes it so: summary.json holds no rows (its size does not follow the run), rounds.csv has them all
    assert abs(sizes[ROUNDS - 2] - sizes[STRETCH]) < 200, sizes
    assert "rounds" not in json.loads((tmp_path / "summary.json").read_text())
    assert [r["round"] for r in read_rounds(tmp_path)] == list(range(ROUNDS))
