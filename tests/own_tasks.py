"""Tasks of a user's own, as files outside the package (tests/learning/test_own_task.py,
tests/experiments/test_own_task_runs.py write them into a temporary folder): a numpy one, a torch one through
`mosaicd.TorchTask`'s helper, and broken ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

NUMPY_TASK = '''
import numpy as np

from mosaic_proto import Layout
from mosaicd import Task


class Mean(Task):
    """Each node pulls its model to its own target; `scale` (an option) sets how far apart the targets are."""

    metric, higher_is_better = "loss", False

    def __init__(self, run, data_dir, scale=1.0, dim=6):
        super().__init__(run, data_dir)
        self.dim = int(dim)
        rng = np.random.default_rng([run.seed, 7])
        self.targets = (scale * rng.standard_normal((run.nodes, self.dim))).astype(np.float32)

    @property
    def layout(self):
        return Layout.flat(self.dim)

    def initial(self, node):
        return np.zeros(self.dim, dtype=np.float32)

    def train(self, node, round, vector):
        noise = np.random.default_rng([self.run.seed, node, round]).standard_normal(self.dim)  # keyed draws only
        grad = (vector - self.targets[node] + 0.1 * noise).astype(np.float32)
        return (vector - np.float32(self.run.lr) * grad).astype(np.float32), float(grad @ grad) / 2

    def evaluate(self, vector):
        error = vector - self.targets.mean(axis=0)
        return {"loss": float(error @ error) / 2}


class HeavyBall(Mean):
    """Mean with a velocity per node kept across rounds: its state goes through checkpoints (node_state)."""

    def __init__(self, run, data_dir, scale=1.0, dim=6):
        super().__init__(run, data_dir, scale, dim)
        self.velocity = {}

    def train(self, node, round, vector):
        noise = np.random.default_rng([self.run.seed, node, round]).standard_normal(self.dim)
        grad = (vector - self.targets[node] + 0.1 * noise).astype(np.float32)
        velocity = self.velocity[node] = np.float32(0.9) * self.velocity.get(node, np.zeros_like(grad)) + grad
        return (vector - np.float32(self.run.lr) * velocity).astype(np.float32), float(grad @ grad) / 2

    def node_state(self, node):
        return {"velocity": self.velocity[node].copy()} if node in self.velocity else {}

    def load_node_state(self, node, state):
        if state:
            self.velocity[node] = state["velocity"].astype(np.float32)
'''

TORCH_TASK = '''
import torch
from torch import nn
from torch.utils.data import Dataset

from mosaicd import TorchTask


def blobs(seed, n):
    """Three Gaussian blobs in 8 dimensions: (inputs, labels) tensors."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.randn(n, 8, generator=g) + 2.0 * nn.functional.one_hot(y, 8).float(), y


class Blobs(TorchTask):
    name = "blobs"

    def __init__(self, run, data_dir, hidden=16):
        super().__init__(run, data_dir, train=blobs(1, 240), test=blobs(2, 60),
                         model=lambda: nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3)))


class Pairs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def margin(output, target):
    return output.gather(1, target[:, None]).mean()


class BlobsDataset(TorchTask):
    """The same data as a Dataset, with a loss and a metric of its own."""

    metric = "margin"

    def __init__(self, run, data_dir, hidden=16):
        super().__init__(run, data_dir, train=Pairs(*blobs(1, 240)), test=Pairs(*blobs(2, 60)),
                         model=lambda: nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3)),
                         loss=nn.functional.cross_entropy, metric=margin)
'''

BAD_TASKS = '''
import numpy as np

from mosaic_proto import Layout
from mosaicd import Task


class NotATask:
    pass


class Small(Task):
    def __init__(self, run, data_dir, fail=""):
        super().__init__(run, data_dir)
        if fail == "init":
            raise RuntimeError("no data here")
        self.fail = fail

    @property
    def layout(self):
        if self.fail == "layout":
            raise KeyError("weights")
        return Layout.flat(4)

    def initial(self, node):
        return np.zeros(3 if self.fail == "shape" else 4, dtype=np.float32)

    def train(self, node, round, vector):
        if self.fail == "train":
            raise RuntimeError("the training data went away")
        return vector, 0.0

    def evaluate(self, vector):
        return {"accuracy": 0.0}
'''

BROKEN_FILE = "import a_module_nobody_has\n"


def write_tasks(folder: Path) -> Path:
    """The task files in `folder` (made): numtask.py (Mean), torchtask.py (Blobs, BlobsDataset), bad.py, broken.py."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("numtask", NUMPY_TASK), ("torchtask", TORCH_TASK), ("bad", BAD_TASKS),
                       ("broken", BROKEN_FILE)):
        (folder / f"{name}.py").write_text(text)
    return folder


def mosaicd(*argv: str, path: Path | None = None, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`mosaicd ARGV` in a fresh interpreter; `path`: a folder put in front of PYTHONPATH (a task's module)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    here = [str(Path(p).resolve()) for p in sys.path if p and Path(p, "mosaicd").is_dir()]  # this source tree
    parts = ([str(path)] if path else []) + here + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment["PYTHONPATH"] = os.pathsep.join(parts)
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "mosaicd", *argv], capture_output=True, text=True, cwd=cwd,
                          env=environment, timeout=timeout, stdin=subprocess.DEVNULL)


def summary(out: Path) -> dict[str, Any]:
    import json

    return json.loads((out / "summary.json").read_text())
