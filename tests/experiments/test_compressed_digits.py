"""Issue #37's bar for --compress, on real data (scikit-learn's digits, Dirichlet 0.1, 16 nodes, K=4, 30 rounds):
int8 sends at most 0.27x the bytes of none within 1 point of its final node-average accuracy, and topk:0.1 with
error feedback at most 0.25x within 3 points. Bytes are counted as nodes.csv counts them (on the wire)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from mosaicd.experiments.simulate import run_simulation
from mosaicd.settings import Settings

RUN = dict(task="digits", nodes=16, fragments=4, rounds=30, partition="dirichlet", alpha=0.1, eval_every=10)


def run(tmp_path: Path, codec: str) -> tuple[float, int]:
    """(final node-average accuracy, bytes on the wire) of the run with `--compress codec`."""
    out = tmp_path / codec.replace(":", "-")
    summary = run_simulation(Settings(**RUN, compress=codec, out=out), progress=False)
    with open(out / "nodes.csv", newline="") as f:
        wire = sum(int(row["bytes_out"]) for row in csv.DictReader(f))
    return summary["final"]["node_average"], wire


@pytest.mark.slow  # three simulations of 30 digits rounds: ~40 s on 2 idle cores
def test_int8_and_topk_meet_the_issues_bytes_and_accuracy(tmp_path: Path) -> None:
    plain_accuracy, plain_bytes = run(tmp_path, "none")
    int8_accuracy, int8_bytes = run(tmp_path, "int8")
    topk_accuracy, topk_bytes = run(tmp_path, "topk:0.1")
    assert int8_bytes <= 0.27 * plain_bytes and int8_accuracy >= plain_accuracy - 0.01, (int8_bytes / plain_bytes,
                                                                                           int8_accuracy)
    assert topk_bytes <= 0.25 * plain_bytes and topk_accuracy >= plain_accuracy - 0.03, (topk_bytes / plain_bytes,
                                                                                           topk_accuracy)
