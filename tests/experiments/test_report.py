"""`mosaicd report`: PNGs and report.md from a tiny quadratic sweep."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from mosaicd.cli import main
from mosaicd.experiments.report import write_report
from mosaicd.experiments.sweep import load_spec, run_sweep

SPEC = """
mode = "simulate"
out = "{out}"
description = "tiny quadratic sweep"
[run]
task = "quadratic"
nodes = 5
dim = 8
rounds = 4
eval_every = 2
[grid]
fanout = [1, 2]
fragments = [1, 4]
seed = [0, 1]
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    spec = root / "spec.toml"
    spec.write_text(SPEC.format(out=root / "sweep"))
    run_sweep(load_spec(spec), progress=False)
    return root / "sweep"


def png_ok(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_report_writes_figures_and_table(swept: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["report", str(swept)])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out)
    out = swept / "report"
    assert result["out"] == str(out) and result["runs"] == 8
    for name in ("metric_vs_rounds.png", "consensus_vs_rounds.png", "best_vs_fanout.png"):
        assert png_ok(out / name), name
    assert not (out / "best_vs_alpha.png").exists()  # alpha is not swept
    md = (out / "report.md").read_text()
    assert "tiny quadratic sweep" in md and "](metric_vs_rounds.png)" in md and "](best_vs_fanout.png)" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| s | K | seeds | node-average")
    assert len(table) == 1 + 4  # header + one row per (s, K) cell
    assert " ± " in table[1]


def test_report_leaves_out_unfinished_runs(swept: Path, tmp_path: Path) -> None:
    summary = swept / "runs" / "fanout=2,fragments=4,seed=1" / "summary.json"
    saved = summary.read_bytes()
    summary.unlink()
    try:
        result = write_report(swept, tmp_path / "r")
    finally:
        summary.write_bytes(saved)
    assert result["runs"] == 7 and result["missing"] == 1
    assert "missing: fanout=2,fragments=4,seed=1" in (tmp_path / "r" / "report.md").read_text()


def test_report_of_a_folder_without_a_sweep(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no sweep.json or summary.json"):
        write_report(tmp_path)
    (tmp_path / "summary.json").write_text('{"a": 1}')  # another program's file, no rounds.csv: not "no round"
    with pytest.raises(ValueError, match="not a run's folder"):
        write_report(tmp_path)


def test_report_leaves_out_failed_runs(swept: Path, tmp_path: Path) -> None:
    summary = swept / "runs" / "fanout=1,fragments=1,seed=0" / "summary.json"
    saved = summary.read_bytes()
    summary.write_text(json.dumps({**json.loads(saved), "status": "failed", "error": "boom"}))
    try:
        result = write_report(swept, tmp_path / "r")
    finally:
        summary.write_bytes(saved)
    assert result["runs"] == 7 and result["missing"] == 1
    assert "missing: fanout=1,fragments=1,seed=0 (failed)" in (tmp_path / "r" / "report.md").read_text()


def test_report_of_one_simulate_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["simulate", "--task", "quadratic", "--nodes", "4", "--dim", "8", "--rounds", "4", "--eval-every", "1",
              "--fragments", "2", "--fanout", "1", "--out", str(run), "--quiet"])
    assert done.value.code == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["report", str(run)])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out)
    out = run / "report"
    assert result["out"] == str(out) and result["runs"] == 1 and result["status"] == "finished"
    assert [Path(f).name for f in result["figures"]] == ["metric_vs_rounds.png", "consensus_vs_rounds.png"]
    for name in ("metric_vs_rounds.png", "consensus_vs_rounds.png"):
        assert png_ok(out / name), name
    md = (out / "report.md").read_text()
    assert md.startswith(f"# Run report: {run}") and "mode `simulate`, status finished" in md
    assert "task=quadratic" in md and "fragments=2" in md and "4 rounds" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| seeds | node-average") and len(table) == 2  # header + the run
    assert table[1].startswith("| 1 | ") and " ± " not in table[1]
    final = json.loads((run / "summary.json").read_text())["final"]
    assert f"{final['node_average']:.4g}" in table[1]


def test_report_of_a_failed_run_shows_its_rounds_and_why(tmp_path: Path) -> None:
    from mosaicd import Settings
    from mosaicd.experiments.simulate import run_simulation
    from mosaicd.progress import RoundProgress

    def failing(p: RoundProgress) -> None:
        if p.round == 2:
            raise RuntimeError("out of memory")

    run = tmp_path / "run"
    with pytest.raises(RuntimeError):
        run_simulation(Settings.load(task="quadratic", nodes=4, dim=8, rounds=6, out=run), progress=False,
                       on_round=failing)
    result = write_report(run)
    assert result["status"] == "failed" and png_ok(run / "report" / "metric_vs_rounds.png")
    md = (run / "report" / "report.md").read_text()
    assert "status failed: out of memory" in md and "3 rounds of 6" in md

    (run / "rounds.csv").write_text((run / "rounds.csv").read_text().splitlines()[0] + "\n")  # the header only
    with pytest.raises(ValueError, match="no evaluated round .the run failed: out of memory"):
        write_report(run)


def test_a_sweep_of_codecs_gets_its_accuracy_against_bytes(tmp_path: Path) -> None:
    """A grid over --compress: accuracy_vs_bytes.png, and the table's bytes per node as nodes.csv counts them."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.replace("fanout = [1, 2]", 'compress = ["none", "int8"]').replace("seed = [0, 1]", "")
                    .replace("dim = 8", "dim = 512").format(out=tmp_path / "sweep"))
    run_sweep(load_spec(spec), progress=False)
    result = write_report(tmp_path / "sweep")
    out = tmp_path / "sweep" / "report"
    assert png_ok(out / "accuracy_vs_bytes.png") and str(out / "accuracy_vs_bytes.png") in result["figures"]
    table = [line.split(" | ") for line in (out / "report.md").read_text().splitlines() if line.startswith("| ")]
    column = table[0].index("MiB sent per node")
    sent = {(row[0].lstrip("| "), row[1]): float(row[column]) for row in table[1:]}
    assert 0 < sent[("int8", "4")] < 0.5 * sent[("none", "4")]


def test_report_compares_two_ad_hoc_runs_in_one_table_figure_and_csv(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Two simulate runs made here, differing in lr and seed only, compared without a sweep spec (issue 58, item 8):
    one row each naming the settings they differ in, one line each in the figures, their recorded finals in the
    CSV; written in the folders' common parent."""
    base = ["simulate", "--task", "quadratic", "--nodes", "4", "--dim", "8", "--rounds", "4", "--eval-every", "1",
            "--fragments", "2", "--fanout", "1", "--quiet"]
    runs = {"fast": ["--lr", "0.05"], "slow": ["--lr", "0.02", "--seed", "3"]}
    for name, flags in runs.items():
        with pytest.raises(SystemExit) as done:
            main([*base, *flags, "--out", str(tmp_path / name)])
        assert done.value.code == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["report", str(tmp_path / "fast"), str(tmp_path / "slow")])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out)
    out = tmp_path / "report"
    assert result["out"] == str(out) and result["runs"] == 2 and result["missing"] == 0
    for name in ("metric_vs_rounds.png", "consensus_vs_rounds.png"):
        assert png_ok(out / name), name
    finals = {name: json.loads((tmp_path / name / "summary.json").read_text())["final"] for name in runs}
    md = (out / "report.md").read_text()
    assert md.startswith(f"# Comparison report: {tmp_path / 'fast'}, {tmp_path / 'slow'}")
    assert "- they differ in: seed, lr\n" in md and "fanout=1" in md.split("settings they share: ")[1].split("\n")[0]
    table = [line.split(" | ") for line in md.splitlines() if line.startswith("| ")]
    assert table[0][:4] == ["| run", "seed", "lr", "seeds"] and len(table) == 3
    assert table[1][:3] == [f"| {tmp_path / 'fast'}", "0", "0.05"] and table[2][:3] == [f"| {tmp_path / 'slow'}",
                                                                                        "3", "0.02"]
    for row, name in zip(table[1:], runs, strict=True):
        assert row[4] == f"{finals[name]['node_average']:.4g}", (row, finals[name])
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["seed"], r["lr"], r["round"]) for r in rows] == [
        (str(tmp_path / "fast"), "0", "0.05", "3"), (str(tmp_path / "slow"), "3", "0.02", "3")]
    for row, name in zip(rows, runs, strict=True):
        assert float(row["node_average"]) == finals[name]["node_average"]
        assert float(row["average_model"]) == finals[name]["average_model"]
    assert finals["fast"]["node_average"] != finals["slow"]["node_average"]


def test_report_of_one_folder_given_twice_is_refused_in_one_line(swept: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["report", str(swept), str(swept), "--out", str(tmp_path / "r")])
    assert done.value.code == 1
    assert capsys.readouterr().err.strip() == f"mosaicd report: error: {swept}: given twice; give each folder once"
    assert not (tmp_path / "r").exists()
