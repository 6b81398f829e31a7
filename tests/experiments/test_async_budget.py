"""--time-budget (issue 60, item 1): an asynchronous run's nodes stop at their --rounds iterations or at the budget,
whichever comes first, in `simulate --sync async` (virtual seconds) and in the daemons (seconds from the start's
barrier); summary.json and the end line say which; the evaluation grid ends with the budget."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from mosaic_proto.async_node import StopReason
from mosaicd.cli import main
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.node.async_member import AsyncNode
from mosaicd.experiments.cluster_async import run_cluster_async
from mosaicd.experiments.simulate import run_simulation
from mosaicd.learning.tasks import build_task
from mosaicd.settings import Settings, SettingsError

RUN = {"sync": "async", "task": "quadratic", "nodes": 6, "fragments": 4, "fanout": 2}
# a quarter of the nodes on a link too slow for what they send, latency for all, node 5 three times slower
PROFILE = ("compute_s = 0.5\n[default]\nlatency = 0.02\n[[draw]]\nshare = 0.25\nbandwidth = 64\n"
           "[nodes.5]\nslowdown = 3\n")


def simulated(tmp_path: Path, name: str, **settings: Any) -> dict[str, Any]:
    return run_simulation(Settings.load(**{**RUN, **settings}, out=tmp_path / name), progress=False)


def rows(out: Path, name: str = "rounds.csv") -> list[dict[str, str]]:
    with open(out / name, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(("flags", "said"), [
    (["--time-budget", "5"], "--time-budget needs --sync async"),
    (["--sync", "async", "--time-budget", "0"], "--time-budget (MOSAIC_TIME_BUDGET): Input should be greater than 0"),
    (["--sync", "async", "--time-budget", "-2"], "--time-budget (MOSAIC_TIME_BUDGET): Input should be greater than 0"),
    (["--sync", "async", "--time-budget", "nan"], "--time-budget (MOSAIC_TIME_BUDGET): Input should be a finite"),
])
@pytest.mark.parametrize("command", ["simulate", "cluster"])
def test_a_budget_that_cannot_act_or_is_not_positive_is_refused_before_anything_starts(
        command: str, flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([command, *flags, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and said in err and "\n" not in err.strip(), err
    assert not list(tmp_path.iterdir())


def test_each_node_stops_at_the_budget_or_its_iterations_and_the_summary_says_which(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compute_s 0.5, a budget of 2.2 virtual seconds: the unslowed nodes' fifth iteration ends at 2.5 s, past it,
    and is their last; node 5 (1.5 s an iteration) stops after its second, at 3.0 s. With --rounds 3 the unslowed
    nodes stop at their iterations first (1.5 s) and node 5 still at the budget."""
    (tmp_path / "p.toml").write_text(PROFILE)
    budget = simulated(tmp_path, "budget", rounds=50, time_budget=2.2, eval_every=2, node_profile=tmp_path / "p.toml")
    block = budget["asynchronous"]
    assert block["steps"] == {**{str(i): 5 for i in range(5)}, "5": 2} and block["stopped"] == "budget"
    assert block["stopped_by"] == {str(i): "budget" for i in range(6)}
    assert block["finished_at"] == {**{str(i): 2.5 for i in range(5)}, "5": 3.0}
    table = rows(tmp_path / "budget")  # the grid, every 2 x 0.5 s up to the budget, then the end
    assert [float(r["virtual_s"]) for r in table[:-1]] == [1.0, 2.0] and float(table[-1]["virtual_s"]) >= 3.0
    assert [int(r["round"]) for r in table] == [1, 3, math.ceil(float(table[-1]["virtual_s"]) / 0.5) - 1]
    assert len(rows(tmp_path / "budget", "nodes.csv")) == 5 * 5 + 2

    mixed = simulated(tmp_path, "mixed", rounds=3, time_budget=2.2, eval_every=0, node_profile=tmp_path / "p.toml")
    assert mixed["asynchronous"]["stopped"] == "budget and iterations"
    assert mixed["asynchronous"]["stopped_by"] == {**{str(i): "iterations" for i in range(5)}, "5": "budget"}
    assert mixed["asynchronous"]["steps"] == {**{str(i): 3 for i in range(5)}, "5": 2}

    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(["simulate", *(f"--{k.replace('_', '-')}={v}" for k, v in RUN.items()), "--rounds", "50",
              "--time-budget", "3", "--eval-every", "0", "--quiet", "--out", str(tmp_path / "cli")])
    assert ended.value.code == 0
    end = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the end line says it too
    assert end["stopped"] == "budget" and end["steps"] == {str(i): 3 for i in range(6)}


def test_a_budget_gives_the_same_models_twice_and_those_of_as_many_rounds_where_it_stops_every_node_alike(
        tmp_path: Path) -> None:
    """Without a profile an iteration takes 1 virtual second: a budget of 4 s stops every node after 4, as
    --rounds 4 does (what they sent at 4 s reaches finished nodes either way): the same models, bit for bit."""
    first, again = (simulated(tmp_path, name, rounds=40, time_budget=4.0, seed=3) for name in ("a", "b"))
    rounds = simulated(tmp_path, "rounds", rounds=4, seed=3)
    assert first["model_sha256"] == again["model_sha256"] and first["models_sha256"] == again["models_sha256"]
    assert first["models_sha256"] == rounds["models_sha256"]
    assert first["asynchronous"]["stopped"] == "budget" and rounds["asynchronous"]["stopped"] == "iterations"
    assert simulated(tmp_path, "less", rounds=40, time_budget=3.0, seed=3)["models_sha256"] != first["models_sha256"]


def _stop_at(round: int) -> Any:
    def stop(done: object) -> None:  # Ctrl-C lands in the main thread as this does, between two events
        if getattr(done, "round", None) == round:
            raise KeyboardInterrupt
    return stop


def test_ctrl_c_then_resume_with_a_budget_gives_the_uninterrupted_models_bit_for_bit(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(PROFILE)
    run = {**RUN, "compress": "int8", "rounds": 100, "time_budget": 4.2, "eval_every": 2, "checkpoint_rounds": 4,
           "node_profile": tmp_path / "p.toml"}
    whole = run_simulation(Settings.load(**run, out=tmp_path / "whole"), progress=False)
    settings = Settings.load(**run, out=tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):  # checkpointed at round 3 (grid point 2), stopped after round 5
        run_simulation(settings, progress=False, on_round=_stop_at(5), advise=False)
    assert (tmp_path / "stopped" / "simulate-checkpoint.npz").exists()
    with pytest.raises(SettingsError, match="--time-budget 5.0"):  # another budget is another run
        run_simulation(Settings.load(**{**run, "time_budget": 5.0}, out=tmp_path / "stopped"), progress=False,
                       resume=True)
    seen: list[int] = []
    resumed = run_simulation(settings, progress=False, resume=True, on_round=lambda done: seen.append(done.round))
    assert seen[0] == 5 and resumed["models_sha256"] == whole["models_sha256"]
    assert resumed["asynchronous"] == whole["asynchronous"] and whole["asynchronous"]["stopped"] == "budget"
    assert (tmp_path / "stopped" / "nodes.csv").read_text() == (tmp_path / "whole" / "nodes.csv").read_text()


async def test_a_daemon_started_again_counts_its_budget_from_the_run_s_start_not_its_own(tmp_path: Path,
                                                                                         kit: Any) -> None:
    """A node's first process trains until its 0.4 s are spent (checkpointing each iteration); started again with
    the same state directory, it goes on from its checkpoint with the budget already spent: one iteration (the
    least a node does), not another 0.4 s of them."""
    profile = kit.pace(tmp_path, 0.05)
    settings = Settings.load(**{**RUN, "nodes": 3}, rounds=1000, time_budget=0.4, node_profile=profile,
                             state_dir=tmp_path / "state", out=tmp_path / "n")
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(3)]
    first = AsyncNode(settings, build_task(settings.run_config()), 0, addresses, Secret(None))
    first.restore()
    await first.train()
    assert first.state.stopped_by is StopReason.BUDGET and 2 <= first.state.step < 1000
    again = AsyncNode(settings, build_task(settings.run_config()), 0, addresses, Secret(None))
    again.restore()
    assert again.resumed_from is not None and 1 <= again.resumed_from < first.state.step
    await again.train()
    assert again.state.stopped_by is StopReason.BUDGET and again.state.step == again.resumed_from + 1
    assert again.report()["stopped_by"] == "budget"


@pytest.mark.slow
def test_a_cluster_s_nodes_stop_at_the_budget_when_their_rounds_are_out_of_reach(tmp_path: Path, kit: Any) -> None:
    """3 s of training at 0.2 s an iteration at least: about 15 iterations, far from --rounds 1000. Each node stops
    by the budget, within a generous margin of it (a loaded host slows the last iteration and the report), and the
    grid ends with it."""
    profile = kit.pace(tmp_path, 0.2)
    summary = run_cluster_async(Settings.load(**{**RUN, "nodes": 4}, rounds=1000, time_budget=3.0,
                                              node_profile=profile, out=tmp_path / "run"),
                                progress=False, timeout=240)
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and block["stopped"] == "budget", block
    assert block["stopped_by"] == {str(i): "budget" for i in range(4)}
    for rank in map(str, range(4)):
        assert 1 <= block["steps"][rank] < 1000 and 3.0 <= block["elapsed_s"][rank] < 3.0 + 60, block
    table = rows(tmp_path / "run")
    times = [float(r["time_s"]) for r in table]
    assert all(t <= 3.0 + 1e-6 for t in times[:-1]) and times[-1] == max(block["elapsed_s"].values())
    assert int(table[-1]["round"]) < 1000
