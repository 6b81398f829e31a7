"""`mosaicd`'s settings: flag errors name the flag, MOSAIC_* and --config apply, CLI > env > TOML, peer lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd.cli import build_parser, load_settings, main
from mosaicd.experiments.cluster import free_ports
from mosaicd.settings import Settings, SettingsError


def settings_of(argv: list[str]) -> Settings:
    """What a command line resolves to (flags, then the environment, then --config), without running anything."""
    return load_settings(build_parser().parse_args(argv))


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run `mosaicd ARGV` in this process, expecting it to stop before doing anything; (exit code, stderr)."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code, capsys.readouterr().err


def run(kit: Any, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    import os

    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")} | (env or {})
    return subprocess.run([*kit.by_hand, *argv], capture_output=True, text=True, timeout=timeout, env=environment,
                          cwd=cwd, stdin=subprocess.DEVNULL)


# -- flag validation ---------------------------------------------------------------------------------------------

def test_fanout_too_large_for_the_nodes_names_fanout(kit: Any) -> None:
    proc = run(kit, "simulate", "--fanout", "9", "--nodes", "4")
    assert proc.returncode == 2
    assert "--fanout" in proc.stderr and "--nodes 4" in proc.stderr
    assert proc.stderr.startswith("mosaicd simulate: error:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "flag"), [
    (["simulate", "--sampler", "bogus"], "--sampler"),
    (["simulate", "--strategy", "zigzag"], "--strategy"),
    (["simulate", "--task", "mnist"], "--task"),
    (["simulate", "--rounds", "abc"], "--rounds"),
    (["simulate", "--rounds", "0"], "--rounds"),
    (["simulate", "--fanout", "0"], "--fanout"),
    (["simulate", "--lr", "-0.1"], "--lr"),
    (["simulate", "--momentum", "1"], "--momentum"),
    (["simulate", "--fragments", "32", "--dim", "16"], "--fragments"),
    (["cluster", "--fanout", "8"], "--fanout"),  # the default --nodes is 8
    (["node", "--run-id", "no spaces allowed"], "--run-id"),
    (["node", "--port", "70000"], "--port"),
    (["node", "--round-deadline", "0"], "--round-deadline"),
    (["barrier", "--max-body-bytes", "10"], "--max-body-bytes"),
    (["barrier", "--log-level", "loud"], "--log-level"),
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--dim", "1000000"], "--curvature diagonal, or --no-train"),  # a correlated A of 7,451 GiB
])
def test_flag_errors_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(argv, capsys)
    assert code == 2
    assert err.startswith(f"mosaicd {argv[0]}: error: ") and flag in err, err


def test_several_errors_are_all_named(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(["simulate", "--rounds", "x", "--sampler", "y"], capsys)
    assert code == 2 and "--rounds" in err and "--sampler" in err


def test_env_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOSAIC_ROUNDS", "many")
    code, err = cli_error(["simulate"], capsys)
    assert code == 2 and "MOSAIC_ROUNDS" in err and "'many'" in err


def test_config_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    code, err = cli_error(["simulate", "--config", str(missing)], capsys)
    assert code == 2 and "--config" in err and "no such file" in err and str(missing) in err
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = \n")
    code, err = cli_error(["simulate", "--config", str(broken)], capsys)
    assert code == 2 and "--config" in err and "not valid TOML" in err and "line 1" in err
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[mosaic]\nrounds = 'x'\n")
    code, err = cli_error(["simulate", "--config", str(wrong)], capsys)
    assert code == 2 and "--rounds" in err and "'x'" in err and f"rounds in --config {wrong}" in err
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("roundz = 3\n")
    code, err = cli_error(["simulate", "--config", str(unknown)], capsys)
    assert code == 2 and f"--config {unknown}: unknown setting 'roundz'" in err
    # a table that is not [mosaic] (a sweep spec's [run], a typo) is refused, not skipped with its settings
    for text in ("nodes = 4\n[run]\nrounds = 3\n", "[mosiac]\nrounds = 3\n", "[mosaic]\nrounds = 3\n[run]\nseed = 1\n"):
        tables = tmp_path / "tables.toml"
        tables.write_text(text)
        code, err = cli_error(["simulate", "--config", str(tables)], capsys)
        assert code == 2 and f"--config {tables}: unknown table" in err and err.count("\n") == 1, (text, err)


def test_missing_config_file_from_the_command(tmp_path: Path, kit: Any) -> None:
    proc = run(kit, "simulate", "--config", str(tmp_path / "absent.toml"), cwd=tmp_path)
    assert proc.returncode == 2 and "--config: no such file" in proc.stderr
    assert not (tmp_path / "runs").exists()  # it stopped before running anything


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([])
    assert stopped.value.code == 2 and "cluster" in capsys.readouterr().out


# -- where settings come from ------------------------------------------------------------------------------------

def test_environment_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOSAIC_ROUNDS", "7")
    monkeypatch.setenv("MOSAIC_SAMPLER", "oracle")
    monkeypatch.setenv("MOSAIC_TRAIN", "false")
    monkeypatch.setenv("MOSAIC_ROUND_DEADLINE", "2.5")
    s = settings_of(["node"])
    assert (s.rounds, s.sampler.value, s.train, s.round_deadline) == (7, "oracle", False, 2.5)
    assert s.nodes == Settings.model_fields["nodes"].default  # untouched fields keep their defaults


ROOT = Path(__file__).resolve().parents[1]


def deployed_environment(file: str, service: str, given: dict[str, str]) -> dict[str, str]:
    """The MOSAIC_* variables a deploy file gives `service`, its ${VAR:-default} and ${VAR:?error} read as Compose
    reads them with the variables `given` (a person's shell)."""
    import re

    import yaml

    def value(match: re.Match) -> str:
        name, how, fallback = match.group(1), match.group(2), match.group(3)
        if given.get(name):
            return given[name]
        assert how == ":-", f"{file}: {name} is required"
        return fallback
    environment = yaml.safe_load((ROOT / file).read_text())["services"][service]["environment"]
    return {k: re.sub(r"\$\{(\w+)(:-|:\?)([^}]*)\}", value, str(v)) for k, v in environment.items()}


def deployed_settings(monkeypatch: pytest.MonkeyPatch, file: str, service: str, given: dict[str, str]) -> Settings:
    """The settings `service` of a deploy file runs with, given the shell variables `given` and no other MOSAIC_*."""
    for key in [k for k in os.environ if k.startswith("MOSAIC_")]:
        monkeypatch.delenv(key)
    for key, value in deployed_environment(file, service, given).items():
        monkeypatch.setenv(key, value)
    return settings_of([service])


@pytest.mark.parametrize("file", ["compose.yaml", "deploy/stack.yaml", "deploy/multihost/barrier.yaml"])
def test_a_deploy_file_runs_asynchronously_given_only_mosaic_sync(file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOSAIC_SYNC=async alone: the file's own round deadline (300 s, for dozens of containers on few cores) is a
    default (MOSAIC_DEFAULTS), left out of a run without rounds; in a barrier run it applies; a deadline a person
    sets applies in a barrier run and is refused, naming the flag, in an asynchronous one."""
    def barrier(**given: str) -> Settings:
        return deployed_settings(monkeypatch, file, "barrier", {"MOSAIC_NODES": "8", **given})

    assert (barrier(MOSAIC_SYNC="async").sync.value, barrier(MOSAIC_SYNC="async").round_deadline) == ("async", 120)
    assert (barrier().sync.value, barrier().round_deadline) == ("barrier", 300)
    assert barrier(MOSAIC_ROUND_DEADLINE="60").round_deadline == 60
    with pytest.raises(SettingsError, match="--round-deadline needs --sync barrier"):
        barrier(MOSAIC_SYNC="async", MOSAIC_ROUND_DEADLINE="60")


@pytest.mark.parametrize(("file", "service", "field"), [
    ("compose.yaml", "node", "nodes_per_process"), ("deploy/stack.yaml", "node", "nodes_per_process"),
    ("deploy/stack.yaml", "barrier", "nodes_per_address"),
    ("deploy/multihost/nodes.yaml", "node", "nodes_per_process")])
def test_a_deploy_file_runs_several_nodes_per_container_given_only_their_number(
        file: str, service: str, field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOSAIC_NODES_PER_CONTAINER=N: each container's `mosaicd node` forks N members, and Swarm's barrier counts each
    address of `tasks.node` as N nodes; unset, one node per container, as before."""
    def deployed(**given: str) -> Settings:
        required = {"MOSAIC_BARRIER_URL": "http://barrier:8000", "MOSAIC_SECRET_PATH": "/dev/null"}
        return deployed_settings(monkeypatch, file, service, {**required, **given})

    assert getattr(deployed(), field) == 1
    assert getattr(deployed(MOSAIC_NODES_PER_CONTAINER="4"), field) == 4
    if service == "barrier":
        assert deployed(MOSAIC_NODES_PER_CONTAINER="4").expect_dns == "tasks.node"


@pytest.mark.parametrize("file", ["compose.yaml", "deploy/stack.yaml", "deploy/multihost/barrier.yaml"])
def test_a_deploy_file_slows_its_nodes_given_only_a_profile(file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOSAIC_NODE_PROFILE, a profile's JSON: the barrier's run carries it (the nodes get it as they register); unset,
    the file's empty default is no profile."""
    def barrier(**given: str) -> Settings:
        return deployed_settings(monkeypatch, file, "barrier", {"MOSAIC_NODES": "8", **given})

    assert barrier().node_profile is None
    slowed = barrier(MOSAIC_NODE_PROFILE='{"compute_s": 1, "draw": [{"share": 0.25, "slowdown": 5}]}').node_profile
    assert slowed is not None and slowed["compute_s"] == 1 and slowed["draw"] == [{"share": 0.25, "slowdown": 5}]


def test_deployment_defaults_apply_where_nothing_else_gives_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOSAIC_DEFAULTS: below flags, variables and --config, and left out where it has no effect; an empty MOSAIC_*
    variable is no value; a malformed or unknown default is refused, naming MOSAIC_DEFAULTS."""
    monkeypatch.setenv("MOSAIC_DEFAULTS", "round_deadline = 300\nrounds = 9")
    monkeypatch.setenv("MOSAIC_ROUND_DEADLINE", "")
    assert (settings_of(["barrier"]).round_deadline, settings_of(["barrier"]).rounds) == (300, 9)
    assert settings_of(["barrier", "--rounds", "4"]).rounds == 4
    monkeypatch.setenv("MOSAIC_ROUNDS", "5")
    assert settings_of(["barrier"]).rounds == 5
    assert settings_of(["barrier", "--sync", "async"]).round_deadline == 120
    for text, error in (("round_deadline =", "MOSAIC_DEFAULTS: not valid TOML"),
                        ("deadline = 3", "MOSAIC_DEFAULTS: no setting 'deadline'")):
        monkeypatch.setenv("MOSAIC_DEFAULTS", text)
        with pytest.raises(SettingsError, match=error):
            settings_of(["barrier"])


def test_config_file_applies(tmp_path: Path) -> None:
    top = tmp_path / "top.toml"
    top.write_text('rounds = 9\nround-deadline = 4.5\nsampler = "static"\ntrain = false\n')
    s = settings_of(["simulate", "--config", str(top)])
    assert (s.rounds, s.round_deadline, s.sampler.value, s.train) == (9, 4.5, "static", False)
    table = tmp_path / "table.toml"
    table.write_text('# a run\n[mosaic]\nrun_id = "from-toml"\nfragments = 2\n')
    s = settings_of(["simulate", "--config", str(table)])
    assert (s.run_id, s.fragments) == ("from-toml", 2)


def test_cli_beats_env_beats_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[mosaic]\nrounds = 3\nnodes = 5\nseed = 11\n")
    monkeypatch.setenv("MOSAIC_ROUNDS", "4")
    monkeypatch.setenv("MOSAIC_NODES", "6")
    s = settings_of(["simulate", "--config", str(config), "--rounds", "5"])
    assert (s.rounds, s.nodes, s.seed) == (5, 6, 11)
    s = settings_of(["simulate", "--config", str(config)])
    assert (s.rounds, s.nodes, s.seed) == (4, 6, 11)
    monkeypatch.delenv("MOSAIC_ROUNDS")
    assert settings_of(["simulate", "--config", str(config)]).rounds == 3
    # a bad value in a lower layer is harmless when a higher one overrides it
    config.write_text("[mosaic]\nrounds = 'lots'\n")
    assert settings_of(["simulate", "--config", str(config), "--rounds", "2"]).rounds == 2


def test_settings_load_reports_like_the_cli() -> None:
    with pytest.raises(SettingsError, match="--fanout"):
        Settings.load(nodes=3, fanout=3)


def test_env_and_config_reach_a_real_run(tmp_path: Path, kit: Any) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[mosaic]\nnodes = 4\nfanout = 1\nrounds = 9\ndim = 8\n")
    out = tmp_path / "out"
    proc = run(kit, "simulate", "--config", str(config), "--rounds", "2", "--quiet",
               env={"MOSAIC_OUT": str(out), "MOSAIC_SEED": "3", "MOSAIC_FRAGMENTS": "2"})
    assert proc.returncode == 0, proc.stderr
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert {k: settings[k] for k in ("nodes", "fanout", "rounds", "dim", "seed", "fragments")} == dict(
        nodes=4, fanout=1, rounds=2, dim=8, seed=3, fragments=2)


# -- peer lists --------------------------------------------------------------------------------------------------

def test_peer_list_without_this_node_is_a_clear_error(tmp_path: Path, kit: Any) -> None:
    mine, other_a, other_b = free_ports(3)
    peers = tmp_path / "peers.txt"
    peers.write_text(f"127.0.0.1:{other_a}\n127.0.0.1:{other_b}\n")
    # no subcommand: `mosaicd --peer-list ...` is `mosaicd node --peer-list ...`; it must not wait for rank 0
    for argv in (["--peer-list", str(peers)], ["node", "--peer-list", str(peers)]):
        proc = run(kit, *argv, "--port", str(mine), "--host", "127.0.0.1", "--register-deadline", "30", timeout=20)
        assert proc.returncode == 1, proc.stderr
        assert "--peer-list" in proc.stderr and f"127.0.0.1:{mine} is not listed" in proc.stderr
        assert "--advertise" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("text", "expected"), [
    ("# nodes\n127.0.0.1:9001\n\nnot-an-address\n", "line 4: expected host:port, got 'not-an-address'"),
    ("127.0.0.1:9001\n127.0.0.1:99999  # too high\n", "line 2: expected host:port"),
    ("127.0.0.1:\n", "line 1: expected host:port"),
    ("\n\n   :9001\n", "line 3: expected host:port"),
    ("127.0.0.1:9001 127.0.0.1:9002\n", "line 1: expected host:port"),
    ("127.0.0.1:9001\n127.0.0.1:9001\n", "the same address is listed twice"),
    ("# only comments\n\n", "no host:port lines"),
])
def test_malformed_peer_lists_name_the_line(tmp_path: Path, kit: Any, text: str, expected: str) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text(text)
    proc = run(kit, "--peer-list", str(peers), "--port", "9001", timeout=20)
    assert proc.returncode == 1, proc.stderr
    assert f"--peer-list {peers}" in proc.stderr and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_peer_list_too_short_for_the_fanout_is_worded_as_cluster_words_it(tmp_path: Path, kit: Any) -> None:
    """Two lines and the default fanout 2: every member says so at once (issue #24, item 8), not pydantic."""
    ports = free_ports(2)
    peers = tmp_path / "peers.txt"
    peers.write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    cluster = run(kit, "cluster", "--nodes", "2", "--out", str(tmp_path / "c"))
    for port in ports:  # rank 0 (which would host the barrier) and rank 1 alike
        proc = run(kit, "--peer-list", str(peers), "--port", str(port), "--out", str(tmp_path / str(port)), timeout=20)
        assert proc.returncode == cluster.returncode == 2, proc.stderr
        assert proc.stderr == (f"mosaicd node: error: --peer-list {peers} lists 2 nodes: settings: --fanout 2 needs at "
                               "least 3 nodes, got --nodes 2\n")
        assert cluster.stderr.endswith("settings: --fanout 2 needs at least 3 nodes, got --nodes 2\n")


@pytest.mark.parametrize("command", ["simulate", "cluster"])
def test_one_node_is_refused_as_too_few_for_the_fanout(tmp_path: Path, kit: Any, command: str) -> None:
    """--nodes 1 passed the check that --nodes 2 failed: the run started, failed at its first plan (exit 1) and left
    an unfinished folder that told the user to --resume it."""
    out = tmp_path / "one"
    proc = run(kit, command, "--task", "quadratic", "--nodes", "1", "--rounds", "2", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("settings: --fanout 2 needs at least 3 nodes, got --nodes 1\n"), proc.stderr
    assert not out.exists()


def test_a_port_in_use_is_one_line_naming_the_flag(tmp_path: Path, kit: Any) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        barrier = run(kit, "barrier", "--nodes", "3", "--port", str(port), "--out", str(tmp_path / "b"))
        node = run(kit, "node", "--barrier-url", "http://127.0.0.1:9", "--port", str(port), "--out",
                   str(tmp_path / "n"))
    for role, proc in (("barrier", barrier), ("node", node)):
        assert proc.returncode == 1, proc.stderr
        said = [line for line in proc.stderr.splitlines() if not line.startswith("{")]  # less JSON log lines
        assert said == [f"mosaicd {role}: error: --port {port}: 127.0.0.1:{port} is in use (another process listens "
                        "there); give another --port (0: any free one)"], proc.stderr
    assert not (tmp_path / "b" / "summary.json").exists()  # no run started: none says "running"


def test_missing_peer_list_is_named(tmp_path: Path, kit: Any) -> None:
    proc = run(kit, "node", "--peer-list", str(tmp_path / "absent.txt"), "--port", "9001", timeout=20)
    assert proc.returncode == 1 and "--peer-list" in proc.stderr and "No such file" in proc.stderr


# -- the command line a person meets -----------------------------------------------------------------------------

def test_help_is_per_subcommand_grouped_with_choices_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    helps = {}
    for command in ("node", "barrier", "cluster", "simulate"):
        with pytest.raises(SystemExit) as stopped:
            main([command, "--help"])
        assert stopped.value.code == 0
        helps[command] = capsys.readouterr().out
    for command, text in helps.items():
        assert "run: the run" in text and "learning:" in text and "outputs:" in text, command
        assert "{quadratic,digits,teacher,cifar10,cifar100,movielens,shakespeare}" in text and "[default: 20;" in text
    assert "--barrier-url" in helps["node"] and "--barrier-url" not in helps["simulate"]
    assert "--expect-dns" in helps["barrier"] and "--expect-dns" not in helps["node"]
    assert "--port" not in helps["simulate"] and "--max-norm" in helps["simulate"]  # no listening; the guard, yes
    assert all(text.count("outputs: results and logs") == 1 for text in helps.values())  # --config in it, once


@pytest.mark.parametrize(("argv", "expected"), [
    (["simulate", "--barrier-url", "http://x:1"], "--barrier-url does not apply to `mosaicd simulate`"),
    (["simulate", "--retries", "99"], "--retries does not apply to `mosaicd simulate`"),
    (["cluster", "--host", "0.0.0.0"], "--host does not apply to `mosaicd cluster`"),
    (["simulate", "--fragmnets", "3"], "did you mean --fragments?"),
    (["node", "--barrier-url", "http://127.0.0.1:9", "--fragments", "3"], "--fragments: with --barrier-url"),
    (["node", "--barrier-url", "barrier:8000"], "--barrier-url (MOSAIC_BARRIER_URL): expected http://host:port"),
])
def test_usage_errors_exit_2_naming_the_flag(argv: list[str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(argv, capsys)
    assert code == 2 and expected in err, err


def test_version(kit: Any) -> None:
    proc = run(kit, "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("mosaicd ")


def test_an_interrupt_inside_exec_ends_the_command_with_130(tmp_path: Path) -> None:
    """Ctrl-C landing in code run from a string (torch's imports make dataclasses): the command ends with 130, as
    for any Ctrl-C, not killed by SIGINT (-2) as CPython 3.11 would end it after main returned."""
    (tmp_path / "task.py").write_text("from mosaicd import TorchTask\nclass Interrupted(TorchTask):\n    def "
                                      "__init__(self, run, data_dir):\n        exec('raise KeyboardInterrupt')\n")
    proc = subprocess.run([sys.executable, "-m", "mosaicd", "simulate", "--task", "task.py:Interrupted", "--out",
                           str(tmp_path / "o")], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)


def test_node_says_at_once_that_its_barrier_is_unreachable(kit: Any) -> None:
    import time

    started = time.monotonic()
    proc = subprocess.Popen([*kit.by_hand, "node", "--barrier-url", f"http://127.0.0.1:{free_ports(1)[0]}",
                             "--port", "0", "--register-deadline", "6", "--log-json"], stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    first = json.loads(proc.stderr.readline())
    said_after = time.monotonic() - started
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 1
    assert first["event"] == "unreachable" and first["attempt"] == 1 and said_after < 5
    assert rest.count('"unreachable"') >= 2  # it keeps saying it until the deadline
    assert "did not answer within --register-deadline 6s" in rest


def test_a_bad_sweep_spec_is_a_usage_error(tmp_path: Path, kit: Any) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text('mode = "simulate"\nout = "x"\n[run]\nroundz = 3\n')
    proc = run(kit, "sweep", str(spec), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("mosaicd sweep: error:") and "roundz" in proc.stderr
    proc = run(kit, "report", str(tmp_path / "absent"), cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.startswith("mosaicd report: error:")
