"""bench/ab.py: each version's runs import that version's `src`, the pairs alternate their order, and the figure
given is the median of the pairs' after / before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
AB = ROOT / "bench" / "ab.py"

# a "bench" whose one figure says which src it imported: 2 for this checkout's, 1 for another
WHICH_SRC = ("import json, pathlib, mosaic_proto; ours = pathlib.Path(mosaic_proto.__file__).resolve()"
             f".is_relative_to({str(ROOT / 'src')!r}); print('table'); print(json.dumps({{'src': {{'ours': "
             "2.0 if ours else 1.0}, 'label': 'x'}))")


def test_the_pairs_alternate_their_order(kit: Any) -> None:
    ab = kit.bench_module("ab")
    assert ab.order(3) == [(0, "before"), (0, "after"), (1, "after"), (1, "before"), (2, "before"), (2, "after")]


def test_a_figure_is_read_by_its_dotted_path_and_a_wrong_one_is_named(kit: Any) -> None:
    ab = kit.bench_module("ab")
    report = {"warm": {"wall_s": 7.5, "runs": 2, "ok": True, "event_loop": "auto"}, "batched": [{"s": 3.5}]}
    assert ab.figure(report, "warm.wall_s") == 7.5 and ab.figure(report, "warm.runs") == 2.0
    assert ab.figure(report, "batched.0.s") == 3.5  # a list's item by its index
    for key, words in (("warm.cpu_s", "no 'cpu_s'"), ("cold.wall_s", "no 'cold'"), ("warm.ok", "not a number"),
                       ("warm.event_loop", "not a number"), ("warm.wall_s.x", "below a number"),
                       ("batched.1.s", "no index of a list of 1"), ("batched.s", "no index")):
        with pytest.raises(ValueError, match=f"--key {key}: .*{words}"):
            ab.figure(report, key)


def test_the_median_of_the_pairs_ratios(kit: Any) -> None:
    ab = kit.bench_module("ab")
    rows = [{"pair": p, "variant": v, "figures": {"t": t}}
            for p, v, t in ((0, "before", 10.0), (0, "after", 9.0), (1, "after", 12.0), (1, "before", 10.0),
                            (2, "before", 8.0), (2, "after", 8.0))]
    s = ab.summary(rows, ["t"])["t"]
    assert s["ratios"] == [0.9, 1.2, 1.0] and s["median_ratio"] == 1.0
    assert s["before_median"] == 10.0 and s["after_median"] == 9.0


def test_each_version_runs_its_own_src_in_alternating_order(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(AB), "--before", "HEAD", "--after", ".", "--pairs", "2",
                           "--key", "src.ours", "--", "-c", WHICH_SRC], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert [(r["pair"], r["variant"]) for r in result["runs"]] == [(0, "before"), (0, "after"), (1, "after"),
                                                                    (1, "before")]
    assert {r["variant"]: r["figures"]["src.ours"] for r in result["runs"]} == {"before": 1.0, "after": 2.0}
    assert result["figures"]["src.ours"]["ratios"] == [2.0, 2.0] and result["figures"]["src.ours"]["median_ratio"] == 2
    assert "src.ours: before 1, after 2 (medians)" in done.stdout


def test_a_failing_run_or_an_unknown_revision_is_named(tmp_path: Path) -> None:
    failing = subprocess.run([sys.executable, str(AB), "--before", "HEAD", "--pairs", "1", "--key", "x", "--",
                              "-c", "import sys; sys.exit('broken bench')"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert failing.returncode == 1
    assert "the before run of pair 1 failed: exit 1: broken bench" in failing.stderr
    unknown = subprocess.run([sys.executable, str(AB), "--before", "no-such-rev", "--key", "x", "--", "-c", "0"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert unknown.returncode == 1 and "'no-such-rev' is no revision of this repository" in unknown.stderr
    missing = subprocess.run([sys.executable, str(AB), "--before", "HEAD", "--key", "x"], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
    assert missing.returncode == 2 and "give the command to measure after --" in missing.stderr
