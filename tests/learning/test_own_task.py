"""A task of the user's (`--task module:Class`, `--task file.py:Class`, a registered name) and its options: how the
settings read them, what `mosaicd simulate` makes of them, and the one-line errors of a task that cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from own_tasks import mosaicd, summary, write_tasks

from mosaicd.learning.tasks import build_task, check_task
from mosaicd.settings import Settings, SettingsError, TaskName

RUN = ["--nodes", "4", "--fanout", "1", "--fragments", "2", "--rounds", "3", "--seed", "3", "--quiet"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("own") / "tasks")


def test_a_task_file_is_made_absolute_once_and_a_module_kept(tasks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tasks.parent)
    assert Settings.load(task="tasks/numtask.py:Mean").task == f"{tasks / 'numtask.py'}:Mean"
    assert Settings.load(task="numtask:Mean").task == "numtask:Mean"
    assert Settings.load(task="digits").task is TaskName.DIGITS  # the built-ins as they were
    run = Settings.load(task="tasks/numtask.py:Mean", task_options=["scale=2", "dim=5", "name=x"]).run_config()
    assert run.task_options == {"scale": 2, "dim": 5, "name": "x"}  # part of the run the barrier hands out
    assert json.loads(run.model_dump_json())["task"] == str(tasks / "numtask.py") + ":Mean"


def test_options_come_from_flags_toml_and_the_environment_alike(tmp_path: Path, tasks: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'task = "{tasks / "numtask.py"}:Mean"\n[task-options]\nscale = 2.5\ndim = 3\n')
    assert Settings.load(config=config).task_options == {"scale": 2.5, "dim": 3}
    monkeypatch.setenv("MOSAIC_TASK_OPTIONS", '{"scale": 2.5, "dim": 3}')
    assert Settings.load(task="numtask:Mean").task_options == {"scale": 2.5, "dim": 3}
    assert Settings.load(task="numtask:Mean", task_options=["scale=2.5", "dim=3"]).task_options == {"scale": 2.5,
                                                                                                     "dim": 3}


@pytest.mark.parametrize(("values", "expected"), [
    ({"task": "mnist"}, "--task (MOSAIC_TASK): expected one of quadratic, digits"),
    ({"task": "digits", "task_options": ["width=3"]}, "--task-option needs a --task of your own"),
    ({"task": "m:C", "task_options": ["width"]}, "--task-option (MOSAIC_TASK_OPTIONS): 'width': expected key=value"),
    ({"task": "m:C", "task_options": ["1x=2"]}, "'1x': an option is a keyword argument"),
    ({"task": "m:not a class"}, "'not a class' is not a class name"),
])
def test_malformed_tasks_and_options_are_settings_errors(values: dict, expected: str) -> None:
    with pytest.raises(SettingsError) as raised:
        Settings.load(**values)
    assert expected in str(raised.value), raised.value


def test_the_torch_helper_takes_tensors_or_a_dataset_and_is_seeded(tasks: Path) -> None:
    settings = Settings.load(task=f"{tasks / 'torchtask.py'}:Blobs", task_options=["hidden=8"], nodes=3, fanout=1,
                             partition="dirichlet", alpha=0.5, local_steps=3, batch_size=8, seed=4)
    task, twin = build_task(settings), build_task(settings)
    assert task.name == "blobs" and task.layout.dim == 8 * 8 + 8 + 8 * 3 + 3  # hidden=8 reached the model
    x0 = task.initial(0)
    assert np.array_equal(x0, twin.initial(2))  # the model is built under the run's seed
    trained, loss = task.train(1, 0, x0)
    again, loss_again = twin.train(1, 0, x0)
    assert np.array_equal(trained, again) and loss == loss_again and np.isfinite(loss)
    assert not np.array_equal(trained, task.train(2, 0, x0)[0])  # each node its own part of the data
    assert set(task.evaluate(trained)) == {"accuracy", "test_loss"}
    sizes = [len(task.shard(i)) for i in range(3)]
    assert sum(sizes) == 240 and len(set(sizes)) > 1  # Mosaic's Dirichlet partition of the user's labels
    dataset = build_task(settings.model_copy(update={"task": f"{tasks / 'torchtask.py'}:BlobsDataset"}))
    assert np.array_equal(dataset.split.x_train, task.split.x_train)
    assert np.array_equal(dataset.initial(0), x0)
    metrics = dataset.evaluate(trained)
    assert set(metrics) == {"margin", "test_loss"} and metrics["test_loss"] == pytest.approx(
        task.evaluate(trained)["test_loss"], rel=1e-5)


@pytest.mark.parametrize(("task", "options", "expected"), [
    ("no_such_module:Task", [], "--task no_such_module:Task: cannot import 'no_such_module': No module named "
                                "'no_such_module'"),
    ("{tasks}/missing.py:Task", [], "--task {tasks}/missing.py:Task: no such file: {tasks}/missing.py"),
    ("{tasks}/broken.py:Task", [], "--task {tasks}/broken.py:Task: cannot import {tasks}/broken.py: "
                                   "ModuleNotFoundError: No module named 'a_module_nobody_has'"),
    ("{tasks}/bad.py:Nothing", [], "--task {tasks}/bad.py:Nothing: {tasks}/bad.py has no 'Nothing'"),
    ("{tasks}/bad.py:NotATask", [], "--task {tasks}/bad.py:NotATask: NotATask is not a subclass of mosaicd.Task"),
    ("{tasks}/bad.py:Small", ["fail=init"], "--task {tasks}/bad.py:Small: Small(run, data_dir, fail='init') "
                                            "failed: RuntimeError: no data here"),
    ("{tasks}/bad.py:Small", ["fial=init"], "Small(run, data_dir, fial='init') failed: TypeError:"),
    ("{tasks}/bad.py:Small", ["fail=layout"], "--task {tasks}/bad.py:Small: its layout failed: KeyError: 'weights'"),
    ("{tasks}/bad.py:Small", ["fail=shape"], "initial(0) gave ndarray of shape (3,) and dtype float32; a float32 "
                                             "vector of the layout's 4 values is needed"),
    ("unregistered-name", [], "--task (MOSAIC_TASK): expected one of quadratic"),
])
def test_a_task_that_cannot_run_is_one_line_and_exit_2_before_anything_is_written(
        tasks: Path, tmp_path: Path, task: str, options: list[str], expected: str) -> None:
    out = tmp_path / "run"
    flags = [x for o in options for x in ("--task-option", o)]
    proc = mosaicd("simulate", "--task", task.format(tasks=tasks), *flags, *RUN, "--out", str(out), path=tasks)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("mosaicd simulate: error: "), proc.stderr
    assert expected.format(tasks=tasks) in proc.stderr, proc.stderr
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_simulate_runs_both_forms_alike_and_options_change_the_models(tasks: Path, tmp_path: Path) -> None:
    by_file = mosaicd("simulate", "--task", "tasks/numtask.py:Mean", "--task-option", "scale=2", *RUN,
                      "--out", str(tmp_path / "file"), cwd=tasks.parent)
    by_module = mosaicd("simulate", "--task", "numtask:Mean", "--task-option", "scale=2", *RUN,
                        "--out", str(tmp_path / "module"), path=tasks, cwd=tmp_path)
    other = mosaicd("simulate", "--task", "numtask:Mean", "--task-option", "scale=3", *RUN,
                    "--out", str(tmp_path / "other"), path=tasks, cwd=tmp_path)
    for proc in (by_file, by_module, other):
        assert proc.returncode == 0, proc.stderr[-2000:]
    file, module = summary(tmp_path / "file"), summary(tmp_path / "module")
    assert file["settings"]["task"] == f"{tasks / 'numtask.py'}:Mean"
    assert file["settings"]["task_options"] == {"scale": 2}
    assert file["final"]["metric"] == "loss" and file["final"]["node_average"] is not None
    assert len(file["model_sha256"]) == 4 and file["model_sha256"] == module["model_sha256"]
    assert set(summary(tmp_path / "other")["model_sha256"].values()).isdisjoint(module["model_sha256"].values())


def test_a_package_registers_a_task_name_by_entry_point(tasks: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    dist = site / "mosaic_own_tasks-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mosaic-own-tasks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mosaic_learning.tasks]\nmean = numtask:Mean\n")
    (site / "numtask.py").write_text((tasks / "numtask.py").read_text())
    named = mosaicd("simulate", "--task", "mean", "--task-option", "scale=2", *RUN, "--out", str(tmp_path / "named"),
                    path=site)
    assert named.returncode == 0, named.stderr[-2000:]
    by_module = mosaicd("simulate", "--task", "numtask:Mean", "--task-option", "scale=2", *RUN,
                        "--out", str(tmp_path / "module"), path=tasks)
    assert by_module.returncode == 0, by_module.stderr[-2000:]
    assert summary(tmp_path / "named")["settings"]["task"] == "mean"
    assert summary(tmp_path / "named")["model_sha256"] == summary(tmp_path / "module")["model_sha256"]


def test_check_task_leaves_the_built_ins_alone() -> None:
    assert check_task(Settings.load(task="cifar10").run_config()) is None  # no data needed to start, as before


def test_help_and_the_public_names_import_no_task(tmp_path: Path) -> None:
    code = ("import sys, mosaicd\n"
            "from mosaicd.cli import main\n"
            "for argv in (['--help'], ['simulate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "    assert 'torch' not in sys.modules and ('numpy' not in sys.modules or len(argv) == 2), argv\n"
            "from mosaicd import Task, TorchTask\n"
            "from mosaicd.learning.tasks.base import Task as Base\n"
            "assert Task is Base and issubclass(TorchTask, Task)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**mosaicd_env()}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--task-option KEY=VALUE" in proc.stdout and "MODULE:CLASS|FILE.py:CLASS" in proc.stdout


def mosaicd_env() -> dict[str, str]:
    import os

    here = [str(Path(p).resolve()) for p in sys.path if p and Path(p, "mosaicd").is_dir()]
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")},
            "PYTHONPATH": os.pathsep.join(here + [os.environ.get("PYTHONPATH", "")])}


def test_simulate_builds_the_task_it_checked_once(tmp_path: Path) -> None:
    (tmp_path / "counting.py").write_text(
        "import numpy as np\nfrom mosaic_proto import Layout\nfrom mosaicd import Task\n\n\n"
        "class Counting(Task):\n"
        "    def __init__(self, run, data_dir, log=''):\n"
        "        super().__init__(run, data_dir)\n"
        "        with open(log, 'a') as f:\n            f.write('built\\n')\n\n"
        "    layout = property(lambda self: Layout.flat(4))\n\n"
        "    def initial(self, node):\n        return np.zeros(4, dtype=np.float32)\n\n"
        "    def train(self, node, round, vector):\n        return vector + np.float32(node), 0.0\n\n"
        "    def evaluate(self, vector):\n        return {'accuracy': 0.5}\n")
    log = tmp_path / "builds.txt"
    proc = mosaicd("simulate", "--task", "counting.py:Counting", "--task-option", f"log={json.dumps(str(log))}", *RUN,
                   "--out", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert log.read_text() == "built\n"  # the data of a user's task is not loaded twice
    assert summary(tmp_path / "run")["final"]["node_average"] == 0.5
