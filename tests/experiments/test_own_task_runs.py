"""A task of the user's runs the same in `cluster`, `simulate`, a peer list and a sweep (and its report): the same
final models, bit for bit, whether named by file or by module; a bad one stops a cluster or a sweep before any
process starts or folder is written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from own_tasks import mosaicd, summary, write_tasks
from runs import run_peer_list

RUN = ["--nodes", "4", "--fanout", "2", "--fragments", "2", "--rounds", "3", "--seed", "3", "--quiet"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("own") / "tasks")


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_cluster_gives_simulates_models_by_file_and_by_module(tasks: Path, tmp_path: Path) -> None:
    option = ["--task-option", "scale=2"]
    ok(mosaicd("simulate", "--task", "tasks/numtask.py:Mean", *option, *RUN, "--out", str(tmp_path / "sim"),
               cwd=tasks.parent))
    ok(mosaicd("cluster", "--task", "tasks/numtask.py:Mean", *option, *RUN, "--out", str(tmp_path / "file"),
               cwd=tasks.parent))
    ok(mosaicd("cluster", "--task", "numtask:Mean", *option, *RUN, "--out", str(tmp_path / "module"), path=tasks,
               cwd=tmp_path))
    simulated = summary(tmp_path / "sim")["model_sha256"]
    assert len(simulated) == 4
    for name in ("file", "module"):
        clustered = summary(tmp_path / name)
        assert clustered["mode"] == "cluster" and clustered["model_sha256"] == simulated, name
        assert clustered["final"]["metric"] == "loss" and clustered["final"]["node_average"] is not None


@pytest.mark.slow
def test_the_torch_helper_task_runs_alike_in_cluster_and_simulate(tasks: Path, tmp_path: Path) -> None:
    common = ["--task", f"{tasks / 'torchtask.py'}:Blobs", "--task-option", "hidden=8", "--partition", "dirichlet",
              "--alpha", "0.5", "--min-samples", "4", "--local-steps", "2", "--batch-size", "8", *RUN]
    ok(mosaicd("simulate", *common, "--out", str(tmp_path / "sim")))
    ok(mosaicd("cluster", *common, "--out", str(tmp_path / "cluster")))
    simulated, clustered = summary(tmp_path / "sim"), summary(tmp_path / "cluster")
    assert clustered["model_sha256"] == simulated["model_sha256"] and len(clustered["model_sha256"]) == 4
    assert clustered["final"]["metric"] == "accuracy" and 0 <= clustered["final"]["average_model"] <= 1


@pytest.mark.slow
def test_a_peer_list_runs_a_task_file(tasks: Path, tmp_path: Path, kit) -> None:
    settings = ["--task", f"{tasks / 'numtask.py'}:Mean", "--task-option", "scale=2", *RUN[:-1]]
    ok(mosaicd("simulate", *settings, "--out", str(tmp_path / "sim"), "--quiet"))
    rank0 = run_peer_list(kit, tmp_path, settings, 4)
    assert summary(rank0)["model_sha256"] == summary(tmp_path / "sim")["model_sha256"]


@pytest.mark.slow
def test_a_sweep_over_a_tasks_options_and_its_report(tasks: Path, tmp_path: Path) -> None:
    spec = tmp_path / "own.toml"
    spec.write_text('mode = "simulate"\nout = "sweep"\n[run]\ntask = "tasks/numtask.py:Mean"\nnodes = 4\n'
                    'fanout = 2\nfragments = 2\nrounds = 3\nseed = 3\n'
                    '[grid]\ntask_options = [{scale = 1}, {scale = 2}]\n')
    ok(mosaicd("sweep", str(spec), "--quiet", cwd=tasks.parent))
    runs = json.loads((tasks.parent / "sweep" / "sweep.json").read_text())["runs"]
    assert [r["point"] for r in runs] == [{"task_options": {"scale": 1}}, {"task_options": {"scale": 2}}]
    assert [r["name"] for r in runs] == ["task_options=scale-1", "task_options=scale-2"]
    hashes = [summary(tasks.parent / "sweep" / r["dir"])["model_sha256"] for r in runs]
    assert set(hashes[0].values()).isdisjoint(hashes[1].values())
    ok(mosaicd("simulate", "--task", "numtask:Mean", "--task-option", "scale=2", *RUN, "--out",
               str(tmp_path / "alone"), path=tasks))
    assert hashes[1] == summary(tmp_path / "alone")["model_sha256"]  # the sweep's run is the run alone
    report = ok(mosaicd("report", str(tasks.parent / "sweep"), cwd=tasks.parent))
    assert "| {'scale': 2} | 1 |" in (tasks.parent / "sweep" / "report" / "report.md").read_text(), report.stdout


@pytest.mark.parametrize("command", ["cluster", "sweep"])
def test_a_bad_task_stops_a_cluster_or_a_sweep_before_anything_is_written(tasks: Path, tmp_path: Path,
                                                                           command: str) -> None:
    bad = f"{tasks / 'bad.py'}:Small"
    if command == "cluster":
        proc = mosaicd("cluster", "--task", bad, "--task-option", "fail=init", *RUN, "--out", str(tmp_path / "out"),
                       cwd=tmp_path)
    else:
        spec = tmp_path / "bad.toml"
        spec.write_text(f'out = "out"\n[run]\ntask = "{bad}"\nnodes = 4\nfanout = 2\n'
                        '[grid]\ntask_options = [{fail = ""}, {fail = "init"}]\n')
        proc = mosaicd("sweep", str(spec), "--quiet", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"--task {bad}: Small(run, data_dir, fail='init') failed: RuntimeError: no data here" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def blocks(language: str) -> list[str]:
    text = (Path(__file__).resolve().parents[2] / "docs" / "own-model.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


@pytest.mark.slow
def test_the_docs_task_runs_alike_in_cluster_and_simulate_and_its_sweep_validates(tmp_path: Path) -> None:
    task, toy_data = blocks("python")[:2]  # the task and its toy data (the own-loop sketch follows)
    (tmp_path / "shapes_task.py").write_text(task)
    (tmp_path / "toy_data.py").write_text(toy_data)
    subprocess.run([sys.executable, "toy_data.py"], cwd=tmp_path, check=True, timeout=60)
    assert len(list((tmp_path / "data" / "shapes" / "train").glob("*/*.png"))) == 180
    run = ["--task", "shapes_task.py:ShapesCNN", "--task-option", "width=4", "--nodes", "3", "--fanout", "1",
           "--rounds", "2", "--local-steps", "2", "--seed", "1", "--quiet"]
    ok(mosaicd("simulate", *run, "--out", "sim", cwd=tmp_path))
    ok(mosaicd("cluster", *run, "--out", "cluster", cwd=tmp_path))
    simulated, clustered = summary(tmp_path / "sim"), summary(tmp_path / "cluster")
    assert clustered["model_sha256"] == simulated["model_sha256"] and len(simulated["model_sha256"]) == 3
    assert clustered["final"]["metric"] == "accuracy" and clustered["settings"]["task_options"] == {"width": 4}
    (tmp_path / "shapes.toml").write_text(blocks("toml")[1])
    listed = ok(mosaicd("sweep", "shapes.toml", "--dry-run", cwd=tmp_path))
    assert "task_options=width-16,fragments=4" in listed.stdout and "4 runs" in listed.stdout, listed.stdout
