"""The barrier's evaluation of the average model builds the run's task once, as soon as the run is known
(`NetworkEvaluation.prepare`, called when registration closes), not at the first evaluation: the evaluations then
find it built."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from mosaicd.daemon.barrier.evaluator import NetworkEvaluation
from mosaicd.settings import Settings

COUNTED_TASK = '''
import threading

import numpy as np

from mosaic_proto import Layout
from mosaicd import Task


class Counted(Task):
    """A numpy task that notes in `log` each time it is built, and on which thread."""

    metric, higher_is_better = "loss", False

    def __init__(self, run, data_dir, log=""):
        super().__init__(run, data_dir)
        with open(log, "a") as f:
            f.write(threading.current_thread().name + "\\n")

    @property
    def layout(self):
        return Layout.flat(3)

    def initial(self, node):
        return np.zeros(3, dtype=np.float32)

    def train(self, node, round, vector):
        return vector, 0.0

    def evaluate(self, vector):
        return {"loss": float(vector @ vector)}
'''


def test_the_task_is_built_once_in_the_background_before_the_first_evaluation(tmp_path: Path) -> None:
    (tmp_path / "counted.py").write_text(COUNTED_TASK)
    log = tmp_path / "built.txt"
    run = Settings.load(task=f"{tmp_path / 'counted.py'}:Counted", task_options=[f"log={log}"], nodes=3,
                        fanout=1).run_config()
    evaluation = NetworkEvaluation(tmp_path / "data")
    evaluation.prepare(run)
    deadline = time.monotonic() + 60
    while not log.exists() and time.monotonic() < deadline:  # the build runs on its own thread
        time.sleep(0.05)
    metrics = evaluation(run, [np.ones(3, dtype=np.float32), np.full(3, 3, dtype=np.float32)])
    assert metrics["average_model"] == 12.0  # the average (2, 2, 2)
    assert log.read_text().splitlines() == ["mosaic-evaluation-task"]  # built once, by `prepare`
    evaluation(run, [np.zeros(3, dtype=np.float32)])
    assert len(log.read_text().splitlines()) == 1
