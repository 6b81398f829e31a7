"""Training as researchers run it, exact in every mode: Adam with a warmed-up cosine schedule and clipping gives the
same models in `simulate`, `cluster` and a peer list, and after Ctrl-C + `--resume` in both `simulate` and
`cluster` (each node's optimizer state goes into its checkpoints); a task of one's own keeps its per-node state
through a resume the same way (`Task.node_state`); `--batched` steps the same optimizer within its tolerance."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from own_tasks import write_tasks
from runs import interrupt_when_checkpointed, run_peer_list

from mosaicd.experiments.simulate import run_simulation
from mosaicd.outputs import read_rounds
from mosaicd.progress import RoundProgress
from mosaicd.settings import Settings

ADAM = ["--task", "digits", "--nodes", "4", "--fanout", "2", "--fragments", "2", "--rounds", "150", "--local-steps",
        "2", "--optimizer", "adam", "--lr", "0.003", "--optimizer-option", "betas=[0.9,0.99]", "--lr-schedule",
        "cosine", "--lr-warmup-steps", "6", "--clip-grad-norm", "2.0", "--partition", "dirichlet", "--alpha", "0.5",
        "--seed", "4", "--eval-every", "50"]


def _settings(argv: list[str], **more: Any) -> Settings:
    """The Settings of `mosaicd simulate ARGV`, built as the command line builds them."""
    from mosaicd.cli import build_parser, load_settings

    args, _ = build_parser().parse_known_args(["simulate", *argv])
    return load_settings(args).model_copy(update=more)


def _hashes(out: Path) -> dict[str, str]:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished", summary.get("error")
    return summary["model_sha256"]


def _interrupted_simulation(settings: Settings, at: int) -> None:
    """A simulation stopped by Ctrl-C after round `at` (checkpoints every 3 rounds), then the same with --resume."""
    def stop(done: RoundProgress) -> None:
        if done.round == at:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_simulation(settings, progress=False, on_round=stop, advise=False)
    run_simulation(settings, progress=False, resume=True, advise=False)


def _interrupted_cluster(kit: Any, argv: list[str], out: Path, after: int) -> int:
    """`mosaicd cluster ARGV` (4 nodes) stopped by Ctrl-C once round `after` is done and checkpointed, then the same
    command with --resume, run to its end; the rounds the interrupted run had done."""
    proc = subprocess.Popen([*kit.by_hand, "cluster", *argv, "--out", str(out), "--quiet"], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    interrupt_when_checkpointed(kit, proc, out, 4, after=after)
    done = json.loads((out / "summary.json").read_text())["progress"]["rounds_done"]
    resumed = subprocess.run([*kit.by_hand, "cluster", *argv, "--out", str(out), "--quiet", "--resume"],
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return done


@pytest.mark.slow
def test_adam_with_a_cosine_schedule_is_exact_in_simulate_cluster_a_peer_list_and_after_resume(
        tmp_path: Path, kit: Any) -> None:
    reference = run_simulation(_settings(ADAM, out=tmp_path / "simulate"), progress=False)["model_sha256"]
    assert len(set(reference.values())) == 4
    rows = read_rounds(tmp_path / "simulate")
    assert rows[-1]["node_average"] > rows[0]["node_average"]  # it learns

    _interrupted_simulation(_settings(ADAM, out=tmp_path / "simulate-resumed", checkpoint_rounds=3), at=17)
    assert _hashes(tmp_path / "simulate-resumed") == reference

    stopped_at = _interrupted_cluster(kit, ADAM, tmp_path / "cluster", after=12)
    assert 12 <= stopped_at < 150 and _hashes(tmp_path / "cluster") == reference

    rank0 = run_peer_list(kit, tmp_path, ADAM, 4)
    assert _hashes(rank0) == reference


@pytest.mark.slow
def test_a_task_of_ones_own_keeps_its_per_node_state_through_a_resume(tmp_path: Path, kit: Any) -> None:
    tasks = write_tasks(tmp_path / "tasks")
    argv = ["--task", f"{tasks / 'numtask.py'}:HeavyBall", "--nodes", "4", "--fanout", "2", "--fragments", "2",
            "--rounds", "400", "--seed", "3", "--eval-every", "100", "--lr", "0.05"]
    reference = run_simulation(_settings(argv, out=tmp_path / "simulate"), progress=False)["model_sha256"]
    plain = run_simulation(_settings([*argv[:1], f"{tasks / 'numtask.py'}:Mean", *argv[2:]],
                                     out=tmp_path / "plain"), progress=False)["model_sha256"]
    assert plain != reference  # the velocity changes the models: a resume that lost it would show

    _interrupted_simulation(_settings(argv, out=tmp_path / "simulate-resumed", checkpoint_rounds=3), at=25)
    assert _hashes(tmp_path / "simulate-resumed") == reference

    _interrupted_cluster(kit, argv, tmp_path / "cluster", after=20)
    assert _hashes(tmp_path / "cluster") == reference


def test_batched_adam_stays_within_the_tolerance_of_the_exact_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from test_batched import _close

    from mosaicd.learning.tasks.torch_task import TorchTask

    monkeypatch.setattr(TorchTask, "stacked_train", True)  # vmap's path, which the CPU leaves aside for a CNN

    argv = [*ADAM[:ADAM.index("--rounds") + 1], "6", *ADAM[ADAM.index("--rounds") + 2:]]
    argv[argv.index("--eval-every") + 1] = "2"
    run_simulation(_settings(argv, out=tmp_path / "exact"), progress=False)
    run_simulation(_settings(argv, out=tmp_path / "batched", batched=True), progress=False)
    _close(tmp_path / "exact", tmp_path / "batched")
