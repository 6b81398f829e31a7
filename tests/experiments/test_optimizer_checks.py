"""An optimizer's values are checked before the run, in the command's own process (issue 58 item 2): a value its
constructor refuses is one line naming the flag, exit 2, no folder, in `simulate` and `cluster` alike (before, a node
failed on it: a traceback, or 8 "node-N exited" lines and a failed folder). An optimizer given by file
(`FILE.py:CLASS`, item 3) trains the same models in both."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

RUN = ["--task", "digits", "--nodes", "4", "--fanout", "2", "--rounds", "2", "--seed", "3", "--quiet"]

SIGN_SGD = '''
import torch


class SignSGD(torch.optim.Optimizer):
    """Each coordinate moved by lr against the sign of its gradient."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
'''


@pytest.mark.parametrize("command", ["simulate", "cluster"])
@pytest.mark.parametrize("option,says", [("betas=0.9", "TypeError: 'float' object is not subscriptable"),
                                         ("eps=-1", "Invalid epsilon value: -1")])
def test_a_value_the_optimizer_refuses_is_one_line_naming_the_flag_and_no_folder(
        tmp_path: Path, kit: Any, command: str, option: str, says: str) -> None:
    _refused(tmp_path, kit, [command, *RUN], option, says)


@pytest.mark.parametrize("role", ["barrier", "node --peer-list peers.txt"])
def test_a_barrier_or_peer_list_member_refuses_it_as_well(tmp_path: Path, kit: Any, role: str) -> None:
    """Where the role has the run's settings (a barrier, a member of a peer list), not where a barrier gives them."""
    _refused(tmp_path, kit, [*role.split(), *RUN[:-1]], "eps=-1", "Invalid epsilon value: -1")


def _refused(tmp_path: Path, kit: Any, argv: list[str], option: str, says: str) -> None:
    out = tmp_path / "run"
    done = subprocess.run([*kit.by_hand, *argv, "--optimizer", "adam", "--optimizer-option", option,
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"mosaicd {argv[0]}: error: --optimizer-option {option}: {says}")
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert not out.exists()


@pytest.mark.slow
def test_an_optimizer_from_a_file_trains_the_same_models_in_simulate_and_cluster(tmp_path: Path, kit: Any) -> None:
    (tmp_path / "signsgd.py").write_text(SIGN_SGD)
    hashes = {}
    for command in ("simulate", "cluster"):
        out = tmp_path / command
        done = subprocess.run([*kit.by_hand, command, *RUN, "--optimizer", "signsgd.py:SignSGD", "--lr", "0.001",
                               "--out", str(out)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        hashes[command] = summary["model_sha256"]
    assert hashes["simulate"] == hashes["cluster"] and len(set(hashes["simulate"].values())) == 4


def test_a_sweep_checks_each_grid_points_optimizer_before_any_run(tmp_path: Path) -> None:
    from mosaicd.experiments.sweep import SpecError, load_spec

    spec = tmp_path / "sweep.toml"
    spec.write_text(f'out = "{tmp_path / "out"}"\n[run]\ntask = "digits"\nnodes = 4\nrounds = 2\noptimizer = "adam"\n'
                    '[grid]\noptimizer_options = [{eps = 1e-8}, {eps = -1}]\n')
    with pytest.raises(SpecError) as refused:
        load_spec(spec)
    assert "[grid] optimizer_options = {'eps': -1}: --optimizer-option eps=-1: Invalid epsilon value: -1" in \
        str(refused.value) and "{'eps': 1e-08}" not in str(refused.value)
    assert not (tmp_path / "out").exists()
