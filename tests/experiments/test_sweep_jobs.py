"""`mosaicd sweep --jobs N`: runs at once in processes of their own give the models of runs one by one; Ctrl-C
stops every run so that the same command continues them; GPUs are shared out round robin."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd.experiments.sweep import load_spec, run_state
from mosaicd.experiments.sweep_jobs import default_jobs, gpu_for, visible_gpus
from mosaicd.experiments.sweep_runs import model_hashes

SPEC = """
mode = "simulate"
out = "{out}"
[run]
task = "{task}"
nodes = 4
rounds = {rounds}
local_steps = 1
eval_every = 2
threads = 1
[grid]
fragments = [1, 2]
seed = [0, 1]
"""


def sweep(spec: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mosaicd", "sweep", str(spec), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=spec.parent)


def test_two_at_once_give_the_models_of_one_at_a_time(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out="one", task="digits", rounds=3))
    one = sweep(spec, "--jobs", "1", "--quiet")
    assert one.returncode == 0, one.stderr[-3000:]
    two = sweep(spec, "--jobs", "2", "--out", "two")
    assert two.returncode == 0, two.stderr[-3000:]
    result = json.loads(two.stdout.splitlines()[-1])
    assert result["ran"] == 4 and result["failed"] == 0, result
    assert "2 running: " in two.stderr, two.stderr  # the one progress view names both runs going on
    first, second = model_hashes(tmp_path / "one"), model_hashes(tmp_path / "two")
    assert len(first) == 4 and all(len(h) == 4 for h in first.values())
    assert first == second
    with open(tmp_path / "two" / "grid.csv") as f:
        assert len(f.read().splitlines()) == 5
    assert "sweep: [4/4]" in two.stderr
    assert not list((tmp_path / "two" / ".sweep").glob("*.err")), "a run that went well leaves no error file"


@pytest.mark.slow
def test_ctrl_c_stops_every_run_and_the_same_command_finishes_them(tmp_path: Path, kit: Any) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out="o", task="quadratic", rounds=4000).replace("local_steps = 1\n", "")
                    .replace("seed = [0, 1]", "seed = [0]"))
    out = tmp_path / "o"
    command = [sys.executable, "-m", "mosaicd", "sweep", str(spec), "--jobs", "2"]
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kit.wait_until(lambda: len(list(out.glob("runs/*/simulate-checkpoint.npz"))) == 2, 120,
                       "both runs' first checkpoints", 0.05)
        os.kill(first.pid, signal.SIGINT)  # as Ctrl-C on a terminal sends it, to the sweep alone
        said = first.communicate(timeout=150)[1]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, said[-3000:]
    assert "sweep: stopping 2 runs" in said and "Run the same command again to resume" in said, said[-3000:]
    loaded = load_spec(spec)
    for run in loaded.runs:
        state, summary = run_state(run, out, "simulate")
        assert state == "resume" and summary is not None and summary["progress"]["rounds_done"] < 4000, state
    listed = sweep(spec, "--dry-run")
    assert listed.stdout.count("resume ") == 2, listed.stdout

    again = sweep(spec, "--jobs", "2", "--quiet")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["resumed"] == 2
    whole = sweep(spec, "--jobs", "2", "--out", "whole", "--quiet")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert model_hashes(out) == model_hashes(tmp_path / "whole") and len(model_hashes(out)) == 2


def test_the_default_is_what_the_cores_allow() -> None:
    assert default_jobs("simulate", threads=1, nodes=16, cores=16) == 16
    assert default_jobs("simulate", threads=4, nodes=16, cores=16) == 4
    assert default_jobs("cluster", threads=1, nodes=4, cores=16) == 4
    assert default_jobs("cluster", threads=1, nodes=32, cores=16) == 1
    assert default_jobs("simulate", threads=8, nodes=4, cores=2) == 1


def test_cuda_runs_take_one_gpu_each_round_robin() -> None:
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"})
    assert gpus == ["2", "5"]
    assert [gpu_for("cuda", slot, gpus) for slot in range(4)] == ["2", "5", "2", "5"]
    assert gpu_for("cpu", 0, gpus) is None  # a CPU run's environment is left alone
    assert gpu_for("cuda:1", 0, gpus) is None  # an explicit device is the user's choice
    assert gpu_for("cuda", 0, []) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_jobs_below_one_is_refused_naming_the_flag(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out="o", task="quadratic", rounds=3))
    done = sweep(spec, "--jobs", "0")
    assert done.returncode == 2 and "--jobs 0: must be 1 or more" in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


def test_what_a_slurm_job_asks_for(tmp_path: Path) -> None:
    """Without a GPU or a Slurm here: the parameters each job gets, and the sbatch lines submitit makes of them."""
    from submitit.slurm.slurm import _make_sbatch_string

    from mosaicd.experiments.sweep_slurm import first_ports, parse_options, slurm_parameters

    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out="o", task="teacher", rounds=3).replace("threads = 1", "threads = 2"))  # torch's
    runs = load_spec(spec).runs
    asked = slurm_parameters("s", "simulate", runs, parse_options(["partition=gpu", "time=90", "constraint=a100"]))
    assert asked == {"job_name": "s", "time": 90, "cpus_per_task": 2, "partition": "gpu", "constraint": "a100"}
    cuda = [r.__class__(r.name, r.point, r.settings.model_copy(update={"device": "cuda"})) for r in runs]
    assert slurm_parameters("s", "simulate", cuda, {})["gpus_per_task"] == 1  # Slurm sets CUDA_VISIBLE_DEVICES
    one = slurm_parameters("s", "cluster", runs[:1], {"nodes": 2})
    assert one["nodes"] == 2 and one["ntasks_per_node"] == 2  # the run's 4 nodes on 2 hosts
    with pytest.raises(Exception, match="nodes=3: a cluster run of 4 nodes"):
        slurm_parameters("s", "cluster", runs[:1], {"nodes": 3})
    text = _make_sbatch_string(command="python -m x", folder=str(tmp_path / "%j"),
                               **{k: v for k, v in asked.items() if k != "constraint"},
                               additional_parameters={"constraint": "a100"})
    assert "#SBATCH --time=90" in text and "#SBATCH --cpus-per-task=2" in text and "--constraint=a100" in text
    assert "--time=5" not in _make_sbatch_string(command="x", folder="f", time=None)  # no limit but the partition's
    assert first_ports([3, 4, 2], {"MOSAIC_PORT_BASE": "20000"}) == [20000, 20003, 20007]
    with pytest.raises(Exception, match="past 65535"):
        first_ports([100], {"MOSAIC_PORT_BASE": "65500"})
