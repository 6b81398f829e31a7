"""--tensorboard and --mlflow: every evaluated round of rounds.csv, read back with TensorBoard's and MLflow's own
readers, in process (simulate) and from the barrier's process (cluster)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from mosaicd.experiments.simulate import run_simulation
from mosaicd.rundir import read_rounds
from mosaicd.settings import Settings, SettingsError

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

RUN = {"task": "quadratic", "nodes": 4, "rounds": 6, "eval_every": 2, "fragments": 2, "fanout": 2, "seed": 3,
       "run_id": "trackers"}
CHECKED = ("node_average", "consensus_distance", "train_loss")


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_run(folder: Path, out: Path):  # noqa: ANN201
    client = MlflowClient(tracking_uri=f"sqlite:///{folder.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("trackers")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs] == [out.name]
    run = runs[0]
    history = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                       key=lambda m: m.step)] for key in CHECKED}
    return run, history


def expected(out: Path, key: str) -> list[tuple[int, float]]:
    return [(row["round"], float(row[key])) for row in read_rounds(out) if math.isfinite(float(row[key]))]


def test_simulate_writes_each_evaluated_round_to_tensorboard_and_mlflow(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    summary = run_simulation(Settings.load(**RUN, out=out, tensorboard=tmp_path / "tb", mlflow=tmp_path / "ml"),
                             progress=False)
    assert summary["status"] == "finished"
    scalars = tensorboard_scalars(tmp_path / "tb" / "sim")
    run, history = mlflow_run(tmp_path / "ml", out)
    for key in CHECKED:
        rows = expected(out, key)
        assert [step for step, _ in rows] == [1, 3, 5]
        assert [s for s, _ in scalars[key]] == [s for s, _ in rows]
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in rows], rel=1e-6)  # float32 there
        assert history[key] == [(step, pytest.approx(v, rel=1e-12)) for step, v in rows]
    assert run.info.status == "FINISHED"
    assert run.data.params["fragments"] == "2" and run.data.params["task"] == "quadratic"


@pytest.mark.slow
def test_the_barrier_of_a_cluster_writes_them_too(tmp_path: Path) -> None:
    out = tmp_path / "cluster"
    done = subprocess.run([sys.executable, "-m", "mosaicd", "cluster", *[f"--{k.replace('_', '-')}={v}" for k, v in
                           RUN.items()], "--out", str(out), "--tensorboard", str(tmp_path / "tb"),
                           "--mlflow", str(tmp_path / "ml")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    scalars = tensorboard_scalars(tmp_path / "tb" / "cluster")
    run, history = mlflow_run(tmp_path / "ml", out)
    for key in CHECKED:
        assert [s for s, _ in scalars[key]] == [1, 3, 5]
        assert history[key] == [(step, pytest.approx(v, rel=1e-12)) for step, v in expected(out, key)]
    assert run.info.status == "FINISHED"


def test_a_tracker_folder_that_cannot_be_written_is_warned_about_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "tb").write_text("a file where the folder would be")
    summary = run_simulation(Settings.load(**RUN, out=tmp_path / "sim", tensorboard=tmp_path / "tb"), progress=False)
    assert summary["status"] == "finished"
    assert len(read_rounds(tmp_path / "sim")) == 3


def test_a_tracker_whose_extra_is_missing_is_refused_naming_the_flag_and_the_extra(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['mlflow'] = None\n"
            "from mosaicd.settings import Settings, SettingsError\n"
            "try:\n    Settings.load(mlflow='ml')\nexcept SettingsError as exc:\n    print(exc)\n")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "--mlflow" in said.stdout and "pip install 'mosaic-learning[mlflow]'" in said.stdout, said
    assert not (tmp_path / "ml").exists()
    with pytest.raises(SettingsError):  # a value that is no path at all
        Settings.load(tensorboard=3.5j)


def test_a_training_loops_reported_metrics_are_scalars_of_their_own() -> None:
    from mosaicd.trackers import _numbers

    row = {"round": 3, "node_average": 0.5, "nodes": [0, 1], "reported": {"accuracy": 0.5, "test_loss": float("nan")}}
    assert _numbers(row) == {"node_average": 0.5, "reported.accuracy": 0.5}
