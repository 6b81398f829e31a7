"""No setting without an effect (`mosaicd.settings.effects`): every setting is in the table of what it needs, or
listed as always having one; each given where its needs do not hold is refused in one line naming both flags,
in every command, before any folder is made; a sweep axis void in some of its runs is refused naming the axis."""

from __future__ import annotations

import gc
import re
from pathlib import Path
from typing import Any

import pytest

from mosaicd.cli import applies, build_parser, main, subparsers
from mosaicd.experiments.sweep import load_spec
from mosaicd.settings import ALWAYS, COMMANDS, EFFECTS, Settings, SettingsError, flag_name

# setting: (a value away from its default, settings where it has no effect, settings where it has one)
CASES: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "task_options": ({"width": 3}, {"task": "digits"}, {"task": "mytasks:Wide"}),
    "samples_per_node": (40, {"task": "digits"}, {"task": "teacher"}),
    "dim": (8, {"task": "digits"}, {}),
    "curvature": ("diagonal", {"task": "digits"}, {}),
    "heterogeneous": (True, {"task": "digits"}, {}),
    "partition": ("dirichlet", {}, {"task": "digits"}),
    "alpha": (0.1, {"task": "digits"}, {"task": "digits", "partition": "dirichlet"}),
    "min_samples": (4, {"task": "digits", "partition": "shards"}, {"task": "digits", "partition": "dirichlet"}),
    "shards_per_node": (3, {"task": "digits"}, {"task": "digits", "partition": "shards"}),
    "threads": (2, {}, {"task": "digits"}),
    "device": ("cuda", {}, {"task": "digits"}),
    "eval_samples": (50, {}, {"task": "digits"}),
    "strategy": ("contiguous", {"fragments": 1}, {}),
    "trim": (2, {"aggregator": "clipped"}, {"aggregator": "trimmed-mean"}),
    "clip_radius": (0.5, {}, {"aggregator": "clipped"}),
    "attack": ("noise", {}, {"byzantine": 1}),
    "attack_scale": (2.0, {}, {"byzantine": 1}),
    "error_feedback": (False, {}, {"compress": "int8"}),
    "local_steps": (3, {"train": False}, {}),
    "lr": (0.1, {"train": False}, {}),
    "batch_size": (8, {}, {"task": "digits"}),
    "optimizer": ("adam", {"task": "digits", "local_steps": 0}, {"task": "digits"}),
    "optimizer_options": ({"dampening": 0.1}, {}, {"task": "digits"}),
    "lr_schedule": ("cosine", {"task": "digits", "train": False}, {"task": "digits"}),
    "lr_schedule_options": ({"T_max": 10}, {}, {"task": "digits", "lr_schedule": "cosine"}),
    "lr_warmup_steps": (2, {}, {"task": "digits"}),
    "clip_grad_norm": (1.0, {}, {"task": "digits"}),
    "momentum": (0.9, {"task": "digits", "optimizer": "adam"}, {"task": "digits"}),
    "weight_decay": (0.01, {}, {"task": "digits"}),
    "optimizer_state": ("reset", {"task": "digits"}, {"task": "digits", "momentum": 0.9, "local_steps": 2}),
    "batched": (True, {"train": False}, {}),
    "dns_settle": (5.0, {}, {"expect_dns": "nodes.example"}),
    "expect_settle": (2.0, {"expect_dns": "nodes.example"}, {}),
    "nodes_per_address": (4, {}, {"expect_dns": "nodes.example"}),
    "tls_client_auth": (True, {"tls_cert": "c.pem", "tls_key": "k.pem"},
                        {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem"}),
    "tls_ca": ("ca.pem", {}, {"tls_cert": "c.pem", "tls_key": "k.pem"}),
    "rejoin_max_age": (5, {"checkpoint_every": 0}, {}),
    "checkpoint_seconds": (5.0, {"checkpoint_rounds": 0}, {}),
    # asynchronous runs (--sync async): barrier-only settings, and what pairwise averaging (AD-PSGD) leaves out
    "round_deadline": (60.0, {"sync": "async"}, {}),
    "checkpoint_rounds": (5, {"sync": "async", "eval_every": 0}, {}),
    "max_norm": (3.0, {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "exchange": ("pairwise", {}, {"sync": "async"}),
    "async_send": ("aggregated", {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "fragments": (2, {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "fanout": (3, {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "sampler": ("oracle", {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "compress": ("int8", {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "aggregator": ("trimmed-mean", {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "byzantine": (1, {"sync": "async", "exchange": "pairwise"}, {"sync": "async"}),
    "time_budget": (5.0, {}, {"sync": "async"}),
    "nodes_per_process": (4, {}, {"barrier_url": "http://127.0.0.1:8000"}),
}


def test_every_setting_is_in_the_table_or_always_has_an_effect() -> None:
    fields = set(Settings.model_fields)
    assert not set(EFFECTS) & ALWAYS, "a setting is either conditional or always effective"
    assert set(EFFECTS) | ALWAYS == fields, (f"not in settings/effects.py: {fields - set(EFFECTS) - ALWAYS}; "
                                            f"not settings: {(set(EFFECTS) | ALWAYS) - fields}")
    assert set(CASES) == set(EFFECTS), "every entry of the table has a case here"
    for name, needs in EFFECTS.items():
        assert needs and all("--" in n.flags for n in needs), name


@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_a_setting_has_an_effect_only_where_the_table_says(name: str) -> None:
    value, void, effective = CASES[name]
    Settings.load(**effective, **{name: value})  # accepted where it has an effect
    Settings.load(**void)  # ... and the void context is valid without it
    with pytest.raises(SettingsError) as refused:
        Settings.load(**void, **{name: value})
    message = str(refused.value)
    flag = flag_name(name) if value is not False else "--no-" + flag_name(name)[2:]
    assert f"{flag} needs " in message and "\n" not in message, message
    assert len(set(re.findall(r"--[a-z][a-z-]*", message))) >= 2, f"names only one flag: {message}"


def command_for(names: list[str]) -> str:
    """The first run command that takes every one of `names`."""
    return next(c for c in ("simulate", "cluster", "barrier", "node") if set(names) <= applies()[c])


@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_a_void_setting_is_refused_by_the_command_before_any_folder_is_made(name: str, tmp_path: Path, kit: Any,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    value, void, _ = CASES[name]
    command = command_for([*void, name])
    out = tmp_path / "run"
    try:
        with pytest.raises(SystemExit) as stopped:
            main([command, *kit.flags({**void, name: value}), "--out", str(out)])
    finally:
        gc.enable()  # `mosaicd node` holds collection off until its imports are done (daemon/node/warmup.py)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and err.startswith(f"mosaicd {command}: error: ") and "\n" not in err, err
    assert " needs " in err and flag_name(name)[2:] in err, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_alpha_without_dirichlet_is_refused_in_every_command_and_by_toml_and_env(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for command in COMMANDS:
        try:
            with pytest.raises(SystemExit) as stopped:
                main([command, "--task", "digits", "--alpha", "0.1", "--out", str(tmp_path / command)])
        finally:
            gc.enable()
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "--alpha needs --partition dirichlet" in err, (command, err)
    config = tmp_path / "run.toml"
    config.write_text('task = "digits"\nalpha = 0.1\n')
    with pytest.raises(SettingsError, match="--alpha needs --partition dirichlet"):
        Settings.load(config=config)
    monkeypatch.setenv("MOSAIC_ALPHA", "0.1")
    with pytest.raises(SettingsError, match="--alpha needs --partition dirichlet"):
        Settings.load(task="digits")
    assert Settings.load(task="digits", partition="dirichlet").alpha == 0.1
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]  # no run folder was made


def test_the_help_says_what_a_setting_needs() -> None:
    text = subparsers(build_parser("simulate"))["simulate"].format_help()
    assert re.search(r"--alpha ALPHA.*?\(needs\s+a\s+--task\s+other\s+than\s+quadratic,\s+--partition\s+dirichlet\)",
                     text, re.S), text


SPEC = """
mode = "simulate"
out = "{out}"
[run]
task = "digits"
rounds = 2
{run}
[grid]
{grid}
"""


def test_a_sweep_axis_void_in_some_runs_is_refused_naming_it(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "alpha.toml"
    spec.write_text(SPEC.format(out=tmp_path / "sweep", run="", grid="alpha = [0.1, 1.0]"))
    with pytest.raises(SystemExit) as stopped:
        main(["sweep", str(spec)])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "[grid] alpha: no effect in 1 of 2 runs" in err, err
    assert "--alpha needs --partition dirichlet" in err and not (tmp_path / "sweep").exists()
    spec.write_text(SPEC.format(out=tmp_path / "sweep", run='partition = "dirichlet"\nalpha = 0.1',
                                grid='optimizer = ["sgd", "adam"]\nlocal_steps = [0, 1]'))
    with pytest.raises(SettingsError, match=r"\[grid\] optimizer: no effect in 1 of 4 runs .*local_steps = 0"):
        load_spec(spec)


def test_a_shared_setting_with_an_effect_in_some_runs_only_is_left_at_its_default_in_the_others(
        tmp_path: Path) -> None:
    spec = tmp_path / "partitions.toml"
    spec.write_text(SPEC.format(out=tmp_path / "sweep", run="alpha = 0.1", grid='partition = ["iid", "dirichlet"]'))
    runs = {r.point["partition"]: r.settings for r in load_spec(spec).runs}
    assert runs["dirichlet"].alpha == 0.1 and runs["iid"].alpha == Settings.model_fields["alpha"].default
    spec.write_text(SPEC.format(out=tmp_path / "sweep", run="alpha = 0.1", grid='seed = [0, 1]'))
    with pytest.raises(SettingsError, match=r"\[run\] alpha = 0.1.*--alpha needs --partition dirichlet"):
        load_spec(spec)  # void in every run: refused
