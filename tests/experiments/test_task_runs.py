"""Every task trains for a few rounds on tiny files in its real format, in a cluster of processes and in
process, and both give the same final models bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from mosaicd.experiments.cluster import run_cluster
from mosaicd.experiments.simulate import run_simulation
from mosaicd.learning.data import write_synthetic
from mosaicd.settings import Settings

CASES = {
    "quadratic": {},
    "digits": {"partition": "dirichlet", "alpha": 0.1, "min_samples": 8},
    "teacher": {"partition": "dirichlet", "alpha": 0.3, "samples_per_node": 40},
    "cifar10": {"partition": "shards"},
    "cifar100": {},
    "movielens": {"partition": "natural", "lr": 0.2},
    "shakespeare": {"partition": "natural", "batch_size": 4},
}


@pytest.mark.slow
@pytest.mark.parametrize("task", list(CASES))
def test_task_trains_in_cluster_and_in_process(task: str, tmp_path: Path) -> None:
    if task not in ("quadratic", "digits", "teacher"):
        write_synthetic(task, tmp_path / "data", train=60, test=20, users=6)
    common = {"task": task, "nodes": 3, "rounds": 2, "fragments": 2, "fanout": 1, "local_steps": 2, "seed": 5,
              "data_dir": tmp_path / "data", "round_deadline": 60, **CASES[task]}
    simulated = run_simulation(Settings.load(**common, out=tmp_path / "sim"), progress=False)
    clustered = run_cluster(Settings.load(**common, out=tmp_path / "cluster"), progress=False, timeout=240)
    assert simulated["model_sha256"] == clustered["model_sha256"]
    assert len(clustered["model_sha256"]) == 3
    final = clustered["final"]
    assert final["metric"] in ("accuracy", "rmse", "loss")
    for key in ("node_average", "average_model", "consensus_distance", "node_spread"):
        assert final[key] is not None, key
    assert (tmp_path / "cluster" / "rounds.csv").read_text().count("\n") == 3  # header + 2 evaluated rounds
    # the nodes evaluate themselves, the barrier combines: simulate's metrics, exactly (elapsed_s is a clock)
    assert {k: v for k, v in final.items() if k != "elapsed_s"} == \
        {k: v for k, v in simulated["final"].items() if k != "elapsed_s"}
