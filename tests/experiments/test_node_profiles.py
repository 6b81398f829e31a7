"""--node-profile (issue #37): a real cluster whose two slow nodes cannot meet the round deadline shows them as
stragglers (no nodes.csv row in the rounds they missed, the others waiting until the deadline), and `simulate` on its
virtual clock predicts the same stragglers, drops and surviving models."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from mosaicd.experiments.cluster import run_cluster
from mosaicd.experiments.simulate import run_simulation
from mosaicd.settings import Settings, SettingsError

# two nodes 5x slower: 2 s of training against a 1.5 s deadline, which the others (0.4 s, and 50 ms latency) meet
# with room to spare
PROFILE = "compute_s = 0.4\n[default]\nlatency = 0.05\n[nodes.1]\nslowdown = 5\n[nodes.4]\nslowdown = 5\n"
RUN = {"nodes": 6, "rounds": 5, "fragments": 2, "fanout": 2, "round_deadline": 1.5, "drop_after": 2, "seed": 3}


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "nodes.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_simulate_predicts_the_stragglers_from_the_profile_alone(tmp_path: Path) -> None:
    (tmp_path / "slow.toml").write_text(PROFILE)
    runs = [run_simulation(Settings.load(**RUN, node_profile=tmp_path / "slow.toml", out=tmp_path / f"sim{i}"),
                           progress=False) for i in range(2)]
    first = runs[0]
    assert [(e["round"], e["stragglers"], e["dropped"]) for e in first["events"]] == [(0, [1, 4], []),
                                                                                     (1, [1, 4], [1, 4])]
    assert first["dropped"] == [1, 4]
    # the time axis: two rounds that end at the deadline, then rounds of the fast nodes' 0.4 s
    virtual = [float(r["virtual_s"]) for r in csv.DictReader(open(tmp_path / "sim0" / "rounds.csv"))]
    assert virtual == pytest.approx([1.5, 3.0, 3.45, 3.9, 4.35])
    waits = {(r["round"], r["node"]): float(r["wait_s"]) for r in rows(tmp_path / "sim0")}
    assert waits[("0", "0")] == pytest.approx(1.05) and waits[("2", "0")] == 0.0
    # deterministic: the same settings give the same file, but for the wall clock
    assert rows(tmp_path / "sim0") == rows(tmp_path / "sim1")
    assert runs[1]["model_sha256"] == first["model_sha256"] and runs[1]["events"] == first["events"]


@pytest.mark.slow
def test_cluster_with_two_slow_nodes_shows_them_as_the_stragglers_simulate_predicts(tmp_path: Path) -> None:
    (tmp_path / "slow.toml").write_text(PROFILE)
    settings = {**RUN, "node_profile": tmp_path / "slow.toml"}
    simulated = run_simulation(Settings.load(**settings, out=tmp_path / "sim"), progress=False)
    clustered = run_cluster(Settings.load(**settings, out=tmp_path / "cluster"), progress=False, timeout=240)

    assert clustered["status"] == "finished"
    assert clustered["events"] == simulated["events"]  # stragglers [1, 4] in rounds 0 and 1, then dropped
    assert clustered["dropped"] == simulated["dropped"] == [1, 4]
    # nodes.csv: the slow nodes have no row in the rounds they missed; the same (round, node) rows as simulate's
    seen = {(r["round"], r["node"]) for r in rows(tmp_path / "cluster")}
    assert seen == {(r["round"], r["node"]) for r in rows(tmp_path / "sim")}
    assert not {n for _, n in seen} & {"1", "4"}
    # while the slow nodes were awaited, the others' rounds ended at the deadline: they waited for it at the
    # barrier (train + send + wait covers the round); afterwards nobody waits for them
    for row in rows(tmp_path / "cluster"):
        spent = float(row["train_s"]) + float(row["send_s"]) + float(row["wait_s"])
        if row["round"] in ("0", "1"):
            assert float(row["wait_s"]) > 0.4 and spent > 1.2, row
        assert float(row["train_s"]) >= 0.4 and float(row["send_s"]) >= 0.05, row  # the profile's, for real
    # the members left are the same, with the same models: the stragglers' fragments counted for nobody
    assert clustered["model_sha256"] == simulated["model_sha256"]
    journal = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert journal["settings"]["node_profile"]["nodes"] == {"1": {"slowdown": 5.0}, "4": {"slowdown": 5.0}}


def test_a_bad_profile_is_refused_naming_the_flag_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text("node,slowdown,latency\n0,2,0\n1,0.5,0\n")
    with pytest.raises(SettingsError, match=r"--node-profile .*bad.csv:3 slowdown: expected a number >= 1"):
        Settings.load(node_profile=tmp_path / "bad.csv")
    (tmp_path / "far.toml").write_text("[nodes.9]\nlatency = 1\n")
    with pytest.raises(SettingsError, match=r"names rank 9, but the run has 8 nodes"):
        Settings.load(node_profile=tmp_path / "far.toml", nodes=8)


def test_simulate_resumed_goes_on_with_the_virtual_clock(tmp_path: Path) -> None:
    """A slow node that lags behind (late rounds in a row, not dropped yet) starts its next round when it arrived:
    the checkpoint keeps that, so a resumed run's rows and times equal the uninterrupted run's."""
    (tmp_path / "lag.toml").write_text("compute_s = 0.3\n[nodes.2]\nslowdown = 4\n")
    flags = {**RUN, "rounds": 6, "round_deadline": 1.0, "drop_after": 3, "checkpoint_rounds": 1,
             "node_profile": tmp_path / "lag.toml"}
    whole = run_simulation(Settings.load(**flags, out=tmp_path / "whole"), progress=False)

    def stop_after_round_1(done: object) -> None:
        if getattr(done, "round", None) == 1:
            raise KeyboardInterrupt

    settings = Settings.load(**flags, out=tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        run_simulation(settings, progress=False, on_round=stop_after_round_1, advise=False)
    resumed = run_simulation(settings, progress=False, resume=True)
    assert resumed["model_sha256"] == whole["model_sha256"] and resumed["events"] == whole["events"]
    assert [(e["round"], e["stragglers"]) for e in whole["events"]] == [(0, [2]), (1, [2]), (2, [2])]

    def times(out: Path) -> list[tuple[str, str]]:
        return [(r["round"], r["virtual_s"]) for r in csv.DictReader(open(out / "rounds.csv"))]
    assert times(tmp_path / "stopped") == times(tmp_path / "whole")
    assert rows(tmp_path / "stopped") == rows(tmp_path / "whole")


def test_the_example_sweep_and_the_report_on_the_virtual_clock(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from mosaicd.experiments.report import write_report
    from mosaicd.experiments.sweep import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / "digits-stragglers.toml", out=tmp_path / "s")
    assert spec.base["node_profile"]["draw"] == [{"share": 0.2, "slowdown": 5}]
    (tmp_path / "slow.toml").write_text(PROFILE)
    run_simulation(Settings.load(**RUN, node_profile=tmp_path / "slow.toml", out=tmp_path / "sim"), progress=False)
    report = write_report(tmp_path / "sim")
    assert any(f.endswith("metric_vs_time.png") for f in report["figures"])
