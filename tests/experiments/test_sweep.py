"""`mosaicd sweep`: spec validation names the key and file; runs, grid.csv, skip, redo, interrupt and resume."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd.cli import main
from mosaicd.experiments import sweep_runs as sweep
from mosaicd.experiments.simulate import run_simulation
from mosaicd.experiments.sweep import SpecError, load_spec, parse_overrides, run_sweep
from mosaicd.outputs import read_rounds
from mosaicd.progress import RoundProgress

TINY = """
mode = "simulate"
out = "{out}"
[run]
task = "quadratic"
nodes = 5
dim = 8
rounds = 3
[grid]
fragments = [1, 4]
seed = [0, 1]
"""


def write(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert str(path) in message
    return message


@pytest.mark.parametrize(("body", "names"), [
    ("[grid]\nfragments = [1, 32]", ["[grid] fragments = 32", "--dim"]),
    ("[run]\nlr = -1.0", ["[run] lr = -1.0", "greater than 0"]),
    ("[run]\nnodes = 4\n[grid]\nfanout = [2, 4]", ["[grid] fanout = 4", "[run] nodes = 4"]),
    ("[grid]\nfragmentz = [1, 2]", ["[grid] fragmentz", "unknown setting", "fragments"]),
    ("[run]\nlocal-stepz = 2", ["[run] local-stepz", "unknown setting"]),
    ("[grid]\nseed = 3", ["[grid] seed", "list"]),
    ("[grid]\nseed = []", ["[grid] seed", "non-empty"]),
    ("[run]\nseed = 1\n[grid]\nseed = [1, 2]", ["seed", "both"]),
    ("[run]\nout = \"x\"", ["[run] out"]),
    ("[grid]\nsampler = [\"local\", \"gossip\"]", ["[grid] sampler = 'gossip'"]),
    ("nodes = 3", ["nodes", "top-level", "[run]"]),
])
def test_spec_errors_name_the_key_and_the_file(tmp_path: Path, body: str, names: list[str]) -> None:
    message = spec_error(tmp_path, f'mode = "simulate"\nout = "{tmp_path / "o"}"\n{body}\n')
    for name in names:
        assert name in message


def test_spec_needs_a_known_mode_and_an_out(tmp_path: Path) -> None:
    assert "mode" in spec_error(tmp_path, 'mode = "cloud"\nout = "o"\n')
    assert "out" in spec_error(tmp_path, 'mode = "simulate"\n')
    assert "not valid TOML" in spec_error(tmp_path, "mode = \n")


def test_every_point_is_validated_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "o"
    message = spec_error(tmp_path, TINY.format(out=out).replace("fragments = [1, 4]", "fragments = [1, 4, 9]"))
    assert "2 of 6 runs" in message and "fragments = 9" in message
    assert not out.exists()


def test_run_names_follow_the_grid_order(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, TINY.format(out=tmp_path / "o")))
    assert [r.name for r in spec.runs] == ["fragments=1,seed=0", "fragments=1,seed=1", "fragments=4,seed=0",
                                           "fragments=4,seed=1"]
    assert spec.runs[2].settings.fragments == 4 and spec.runs[2].settings.out == tmp_path / "o/runs/fragments=4,seed=0"
    assert load_spec(write(tmp_path, TINY.format(out="x")), out=tmp_path / "y").out == tmp_path / "y"


def test_set_overrides_the_spec_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    spec_path = write(tmp_path, TINY.format(out=out))
    with pytest.raises(SystemExit) as done:  # a [run] key, a [grid] key's list, a key that neither table has
        main(["sweep", str(spec_path), "--quiet", "--set", "rounds=2", "--set", "fragments=[2]", "--set",
              "sampler=oracle", "--set", "local-steps=2"])
    assert done.value.code == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["fragments=2,seed=0", "fragments=2,seed=1"]
    summary = json.loads((out / "runs" / "fragments=2,seed=1" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["progress"] == {"rounds_done": 2, "rounds": 2}
    assert (summary["settings"]["sampler"], summary["settings"]["local_steps"]) == ("oracle", 2)
    assert json.loads((out / "sweep.json").read_text())["overrides"]["fragments"] == [2]
    capsys.readouterr()
    for item, words in (("fragmentz=2", ["--set fragmentz=2: unknown setting 'fragmentz'", "fragments"]),
                        ("rounds", ["--set rounds: expected key=value"]),
                        ("lr=-1", ["--set lr=-1", "greater than 0"]),
                        ("out=x", ["--set out=x", "--out"]),
                        ("mode=cluster", ["--set mode=cluster: the mode is the spec's own"])):
        with pytest.raises(SystemExit) as refused:
            main(["sweep", str(spec_path), "--dry-run", "--set", item])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.startswith("mosaicd sweep: error:"), err
        assert all(w in err for w in words), err


def mtimes(out: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}


def test_sweep_runs_skips_and_redoes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    spec_path = write(tmp_path, TINY.format(out=out))
    with pytest.raises(SystemExit) as done:
        main(["sweep", str(spec_path), "--quiet"])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ran"] == 4 and result["skipped"] == 0 and result["cpu_s"] > 0  # the docs quote CPU time
    for name in ("fragments=1,seed=0", "fragments=4,seed=1"):
        folder = out / "runs" / name
        for f in ("settings.json", "summary.json", "rounds.csv", "nodes.csv", "run.log"):
            assert (folder / f).is_file(), f
        assert "round 2 (3/3 done)" in (folder / "run.log").read_text()
    with open(out / "grid.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == [r.name for r in load_spec(spec_path).runs]
    assert {"fragments", "seed", "node_average", "average_model", "consensus_distance", "node_spread",
            "best_node_average", "train_loss", "wall_s"} <= set(rows[0])
    assert rows[3]["fragments"] == "4" and rows[3]["seed"] == "1" and float(rows[3]["node_average"]) > 0
    assert json.loads((out / "sweep.json").read_text())["grid"] == {"fragments": [1, 4], "seed": [0, 1]}

    before = mtimes(out)
    (out / "runs" / "fragments=4,seed=0" / "summary.json").unlink()  # a broken run
    again = run_sweep(load_spec(spec_path), progress=True)
    err = capsys.readouterr().err
    assert again["skipped"] == 3 and again["ran"] == 1 and again["redone"] == 1
    assert "skip fragments=1,seed=0" in err and "redoing fragments=4,seed=0" in err
    assert "runs 3/4" in err and "fragments=4,seed=0: round 0 (1/3 done)" in err  # the sweep's status line (not a tty)
    after = mtimes(out)
    assert set(after) == set(before)
    assert all(after[k] == before[k] for k in before if k != "fragments=4,seed=0")
    assert len(list(csv.DictReader(open(out / "grid.csv")))) == 4

    # changed settings: the run is redone
    changed = write(tmp_path, TINY.format(out=out).replace("rounds = 3", "rounds = 2"), "changed.toml")
    assert run_sweep(load_spec(changed), progress=False)["redone"] == 4


def test_interrupted_sweep_resumes(tmp_path: Path) -> None:
    out = tmp_path / "o"
    spec = load_spec(write(tmp_path, TINY.format(out=out)))
    seen: list[tuple[str, int]] = []

    def interrupting(run: sweep.Run, p: RoundProgress) -> None:  # Ctrl-C in round 2 of the third run
        seen.append((run.name, p.round))
        if len(seen) == 2 * 3 + 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, progress=False, on_round=interrupting)
    assert seen[-1] == ("fragments=4,seed=0", 1)
    broken = out / "runs" / "fragments=4,seed=0"
    assert broken.is_dir()
    left = json.loads((broken / "summary.json").read_text())  # it says why, and the next sweep redoes it
    assert left["status"] == "interrupted" and "interrupted" in left["error"]
    assert [r["round"] for r in read_rounds(broken)] == [0, 1]  # the rounds evaluated before Ctrl-C
    assert sweep.run_state(spec.runs[2], out)[0] == "resume"  # a simulate sweep continues it
    assert sweep.run_state(spec.runs[2], out, "cluster")[0] == "failed"  # a cluster sweep redoes it
    log = (broken / "run.log").read_text()
    assert "interrupted" in log and "round 1 (2/3 done)" in log and "(3/3 done)" not in log
    assert len(list(csv.DictReader(open(out / "grid.csv")))) == 2
    resumed = run_sweep(load_spec(spec.path), progress=False)
    assert resumed["skipped"] == 2 and resumed["ran"] == 2 and resumed["resumed"] == 1 and resumed["redone"] == 0
    finished = json.loads((broken / "summary.json").read_text())
    assert finished["status"] == "finished"
    assert "resume fragments=4,seed=0" in (broken / "run.log").read_text()
    assert [r["round"] for r in read_rounds(broken)] == [0, 1, 2]  # each round's row once
    uninterrupted = run_simulation(spec.runs[2].settings.model_copy(update={"out": tmp_path / "whole"}),
                                   progress=False)
    assert finished["model_sha256"] == uninterrupted["model_sha256"]


@pytest.mark.slow
def test_an_interrupted_cluster_sweep_leaves_the_advice_to_the_sweep(tmp_path: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """The cluster's own "--resume continues it" is wrong inside a sweep, which redoes the run: it is not printed."""
    out = tmp_path / "o"
    text = TINY.format(out=out).replace('mode = "simulate"', 'mode = "cluster"').replace("seed = [0, 1]", "")
    # rounds enough that the run is still going when it is interrupted at round 1 (status is polled every 0.2 s;
    # a fast host runs ~500 such rounds a second)
    text = text.replace("fragments = [1, 4]", "fragments = [2]").replace("rounds = 3", "rounds = 20000")
    spec = load_spec(write(tmp_path, text))

    def interrupting(run: sweep.Run, p: RoundProgress) -> None:
        if p.round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, progress=False, on_round=interrupting)
    err = capfd.readouterr().err
    assert "--resume" not in err and "mosaicd cluster:" not in err, err
    assert json.loads((spec.runs[0].folder(out) / "summary.json").read_text())["status"] == "interrupted"
    assert sweep.run_state(spec.runs[0], out, "cluster")[0] == "failed"  # the next sweep redoes it


def test_a_second_sweep_of_the_same_out_is_refused_while_the_first_goes_on(tmp_path: Path, kit: Any) -> None:
    """Two sweeps of one spec at once would redo and write the same runs' folders: the second is refused."""
    out = tmp_path / "o"
    # rounds: far more than a fast host simulates before the second sweep is refused (the test stops the first);
    # a --node-profile would not slow simulate, whose clock it plays
    spec = write(tmp_path, TINY.format(out=out).replace('task = "quadratic"', 'task = "digits"')
                 .replace("rounds = 3", "rounds = 20000").replace("nodes = 5\ndim = 8", "nodes = 4"))
    first = subprocess.Popen([sys.executable, "-m", "mosaicd", "sweep", str(spec), "--quiet"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kit.wait_until(lambda: any(out.glob("runs/*/nodes.csv")), 90, "the sweep's first run under way", 0.05)
        second = subprocess.run([sys.executable, "-m", "mosaicd", "sweep", str(spec)], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip() == f"mosaicd sweep: error: {spec}: out = {out}: another process is running a " \
            "run there now: wait for it to end, or stop it (Ctrl-C), then try again", second.stderr
        assert first.poll() is None
    finally:
        os.kill(first.pid, signal.SIGINT)
        said = first.communicate(timeout=60)[1]
    assert first.returncode == 130, said[-3000:]


def test_a_failed_run_stops_the_sweep_with_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import mosaicd.experiments.simulate

    def boom(settings, progress=True, on_round=None, **_):
        raise RuntimeError("no data")

    monkeypatch.setattr(mosaicd.experiments.simulate, "run_simulation", boom)
    spec = load_spec(write(tmp_path, TINY.format(out=tmp_path / "o")))
    result = run_sweep(spec, progress=False)
    assert result["failed"] == 1 and result["ran"] == 0
    assert "sweep: stopped at the failed run; 3 runs not started (--keep-going goes on" in capsys.readouterr().err
    assert "RuntimeError: no data" in (tmp_path / "o/runs/fragments=1,seed=0/run.log").read_text()
    assert run_sweep(spec, progress=False, keep_going=True)["failed"] == 4


@pytest.mark.parametrize("typo", ["fragments=[1,4", "lr=0.1.2", "seed=\"7", "alpha={a = 1"])
def test_a_set_value_that_is_not_toml_is_refused_once_naming_the_key(typo: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_overrides([typo])
    key = typo.partition("=")[0]
    assert f"the value of {key} is not TOML" in str(refused.value)


def test_a_bare_word_is_a_string() -> None:
    assert parse_overrides(["sampler=oracle", "task=tasks/mine.py:Net"]) == {"sampler": "oracle",
                                                                            "task": "tasks/mine.py:Net"}
