"""`mosaicd simulate --sync async` (issue 60): deterministic discrete events on the virtual clock, evaluated on a
time grid; AD-PSGD and asynchronous EL from the same flags; what only barrier runs (or push) use is refused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from mosaicd.cli import main
from mosaicd.experiments.simulate import run_simulation
from mosaicd.settings import Settings, SettingsError

# a quarter of the nodes on a link too slow for what they send (their queues supersede), and latency for all
PROFILE = "compute_s = 0.5\n[default]\nlatency = 0.02\n[[draw]]\nshare = 0.25\nbandwidth = 64\n"
RUN = {"sync": "async", "nodes": 8, "rounds": 6, "fragments": 4, "fanout": 2, "eval_every": 2}


def simulated(tmp_path: Path, name: str, **settings) -> dict:
    return run_simulation(Settings.load(**{**RUN, **settings}, out=tmp_path / name), progress=False)


def rows(out: Path, name: str = "rounds.csv") -> list[dict[str, str]]:
    with open(out / name, newline="") as f:
        return list(csv.DictReader(f))


def test_the_same_seed_gives_the_same_models_and_another_seed_others(tmp_path: Path) -> None:
    (tmp_path / "links.toml").write_text(PROFILE)
    first, again, other = (simulated(tmp_path, name, seed=seed, node_profile=tmp_path / "links.toml")
                           for name, seed in (("a", 3), ("b", 3), ("c", 4)))
    assert first["status"] == "finished" and first["model_sha256"] == again["model_sha256"]
    assert first["models_sha256"] == again["models_sha256"] != other["models_sha256"]
    assert first["asynchronous"]["fragments_superseded"] > 0  # the slow links' queues dropped older copies
    assert first["asynchronous"]["steps"] == {str(i): 6 for i in range(8)}
    # evaluated on the time grid: every 2 x compute_s of virtual time, then at the end (the slow links' last sends)
    times = [float(r["virtual_s"]) for r in rows(tmp_path / "a")]
    assert times[:3] == [1.0, 2.0, 3.0] and times[-1] > 3.0 and times == sorted(times)
    assert [int(r["round"]) for r in rows(tmp_path / "a")][:3] == [1, 3, 5]
    assert len(rows(tmp_path / "a", "nodes.csv")) == 8 * 6  # one row per node and iteration


def test_training_converges_and_an_unprofiled_run_is_numbered_as_a_barrier_run(tmp_path: Path) -> None:
    summary = simulated(tmp_path, "plain", eval_every=1)
    table = rows(tmp_path / "plain")
    assert [int(r["round"]) for r in table] == list(range(6))
    assert [float(r["virtual_s"]) for r in table] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert float(table[-1]["node_average"]) < float(table[0]["node_average"]) / 4
    assert summary["virtual_s"] == 6.0


def test_a_node_slowed_ten_times_does_not_slow_the_others(tmp_path: Path) -> None:
    (tmp_path / "slow.toml").write_text("[nodes.5]\nslowdown = 10\n")
    alike = simulated(tmp_path, "alike")["asynchronous"]["finished_at"]
    slowed = simulated(tmp_path, "slowed", node_profile=tmp_path / "slow.toml")["asynchronous"]["finished_at"]
    assert slowed["5"] == 60.0 and alike["5"] == 6.0
    assert {i: t for i, t in slowed.items() if i != "5"} == {i: t for i, t in alike.items() if i != "5"}
    assert set(alike.values()) == {6.0}  # each of the others did its 6 iterations in 6 x compute_s, as without it


def test_ad_psgd_and_asynchronous_el_run_from_the_flags(tmp_path: Path) -> None:
    adpsgd = simulated(tmp_path, "adpsgd", exchange="pairwise", eval_every=0)
    el = simulated(tmp_path, "el", fragments=1, eval_every=0)
    mosaic = simulated(tmp_path, "mosaic", eval_every=0)
    assert len({adpsgd["models_sha256"], el["models_sha256"], mosaic["models_sha256"]}) == 3
    sent = rows(tmp_path / "adpsgd", "nodes.csv")
    assert {(r["messages_out"], r["fragments_out"]) for r in sent} == {("1", "1")}  # one whole model, one peer
    assert {r["fragments_out"] for r in rows(tmp_path / "el", "nodes.csv")} == {"2"}  # the model to s = 2 peers
    for summary in (adpsgd, el, mosaic):
        assert summary["status"] == "finished" and summary["final"]["consensus_distance"] < 1.0


def test_async_send_aggregated_sends_the_aggregate_and_gives_other_models(tmp_path: Path) -> None:
    """--async-send (docs/spec.md, steps 2-3): the default sends the trained model, `aggregated` the aggregate; the
    same iterations and sends (the same plan), other models, both converging."""
    trained = simulated(tmp_path, "trained", eval_every=0)
    aggregated = simulated(tmp_path, "aggregated", eval_every=0, async_send="aggregated")
    assert trained["settings"]["async_send"] == "trained" and aggregated["settings"]["async_send"] == "aggregated"
    assert trained["models_sha256"] != aggregated["models_sha256"]
    for name in ("trained", "aggregated"):
        assert {r["fragments_out"] for r in rows(tmp_path / name, "nodes.csv")} == {"8"}  # 4 fragments x s = 2
    for summary in (trained, aggregated):
        assert summary["status"] == "finished" and summary["final"]["consensus_distance"] < 1.0


@pytest.mark.parametrize(("flags", "said"), [
    (["--sync", "async", "--round-deadline", "30"], "--round-deadline needs --sync barrier"),
    (["--sync", "async", "--batched"], "--batched needs --sync barrier"),
    (["--exchange", "pairwise"], "--exchange needs --sync async"),
    (["--sync", "async", "--exchange", "pairwise", "--fragments", "8"], "--fragments needs --exchange push"),
    (["--async-send", "aggregated"], "--async-send needs --sync async"),
    (["--sync", "async", "--exchange", "pairwise", "--async-send", "aggregated"],
     "--async-send needs --exchange push"),
    (["--sync", "async", "--exchange", "pairwise", "--max-norm", "3"], "--max-norm needs --exchange push"),
])
def test_a_setting_void_in_the_mode_is_refused_before_any_folder_is_made(
        flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["simulate", *flags, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and said in err, err
    assert not (tmp_path / "run").exists()


def test_a_node_of_a_barrier_refuses_a_sync_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A node of a barrier takes the barrier's run: `--sync async` is the barrier's to give (`mosaicd barrier
    --sync async`, tests/experiments/test_async_barrier.py)."""
    config = tmp_path / "run.toml"
    config.write_text('sync = "async"\n')
    with pytest.raises(SystemExit) as stopped:
        main(["node", "--config", str(config), "--barrier-url", "http://127.0.0.1:9", "--out", str(tmp_path / "n")])
    assert stopped.value.code == 2
    assert "a node of a barrier takes the barrier's run (`mosaicd barrier --sync async`)" in capsys.readouterr().err
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("settings", [
    {"compress": "int8"},
    {"compress": "topk:0.5"},  # sparse messages: each receiver reads the newest values it heard where one is silent
    {"byzantine": 1, "aggregator": "trimmed-mean"},  # a sign-flipper
    {"sampler": "oracle", "aggregator": "clipped"},
], ids=["int8", "topk", "trimmed-mean-against-a-sign-flipper", "oracle-clipped"])
def test_codecs_robust_rules_and_attackers_work_as_in_the_barrier_mode(tmp_path: Path, settings: dict) -> None:
    first, again = (simulated(tmp_path, name, eval_every=3, **settings) for name in ("a", "b"))
    plain = simulated(tmp_path, "plain", eval_every=0)
    assert first["status"] == "finished" and first["models_sha256"] == again["models_sha256"]
    assert first["models_sha256"] != plain["models_sha256"]  # the setting changed the run
    table = rows(tmp_path / "a")
    assert [r["round"] for r in table] == ["2", "5"]
    assert float(table[1]["node_average"]) < float(table[0]["node_average"])  # it learns (honest nodes only)


def test_max_norm_keeps_the_models_under_a_large_bound_and_refuses_a_scaling_attacker(tmp_path: Path) -> None:
    """--max-norm in `simulate --sync async`: a bound nothing is over changes no model; against an attacker that
    sends its fragments scaled 1000x, the honest nodes refuse its messages (counted in summary.json and nodes.csv)
    and keep learning, where without the guard they do not."""
    plain, loose = simulated(tmp_path, "plain", eval_every=3), simulated(tmp_path, "loose", eval_every=3,
                                                                          max_norm=1e6)
    assert plain["models_sha256"] == loose["models_sha256"] and loose["asynchronous"]["refused_out_of_range"] == 0
    attack = {"byzantine": 1, "attack": "scale", "attack_scale": 1000.0}
    attacked = simulated(tmp_path, "attacked", eval_every=3, **attack)
    guarded = simulated(tmp_path, "guarded", eval_every=3, max_norm=10.0, **attack)
    assert guarded["models_sha256"] != attacked["models_sha256"]
    refused = guarded["asynchronous"]["refused_out_of_range"]
    counted = [part for r in rows(tmp_path / "guarded", "nodes.csv") for part in r["refused_by_reason"].split()]
    assert refused > 0 and sum(int(p.split("=")[1]) for p in counted if p.startswith("out_of_range=")) == refused
    assert guarded["final"]["node_average"] < plain["final"]["node_average"] * 2 < attacked["final"]["node_average"]


def test_ctrl_c_then_resume_with_max_norm_gives_the_uninterrupted_models_and_another_bound_is_refused(
        tmp_path: Path) -> None:
    """A checkpoint holds each node's --max-norm and what it refused by it; a resume with another bound is another
    run, refused naming the flag."""
    run = {**RUN, "rounds": 12, "checkpoint_rounds": 2, "byzantine": 1, "attack": "scale", "attack_scale": 1000.0,
           "max_norm": 10.0}
    whole = simulated(tmp_path, "whole", **run)
    settings = Settings.load(**run, out=tmp_path / "stopped")

    def stop(done: object) -> None:  # Ctrl-C lands in the main thread as this does, between two events
        if getattr(done, "round", None) == 7:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_simulation(settings, progress=False, on_round=stop, advise=False)
    assert (tmp_path / "stopped" / "simulate-checkpoint.npz").exists()
    with pytest.raises(SettingsError, match="--max-norm 20.0"):
        run_simulation(Settings.load(**{**run, "max_norm": 20.0}, out=tmp_path / "stopped"), progress=False,
                       resume=True)
    resumed = run_simulation(settings, progress=False, resume=True)
    assert resumed["models_sha256"] == whole["models_sha256"] and resumed["asynchronous"] == whole["asynchronous"]
    assert whole["asynchronous"]["refused_out_of_range"] > 0
    assert (tmp_path / "stopped" / "nodes.csv").read_text() == (tmp_path / "whole" / "nodes.csv").read_text()
