"""A first mistake gets one line that says what next (issue 58, item 8): a mistyped flag names the flag and the
one it is close to before anything else, and a missing secret says the command that makes one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mosaicd.cli import main
from mosaicd.daemon.http.auth import load_secret

MOSAICD = [sys.executable, "-m", "mosaicd"]


@pytest.mark.parametrize(("argv", "first"), [
    (["simulate", "--fragmets", "4"], "mosaicd simulate: error: unrecognized argument: --fragmets (did you mean "
                                      "--fragments?)"),
    (["cluster", "--nodez=8", "--rounds", "3"], "mosaicd cluster: error: unrecognized argument: --nodez (did you "
                                                "mean --nodes?)"),
    (["simulate", "--host", "0.0.0.0"], "mosaicd simulate: error: --host does not apply to `mosaicd simulate` (it is "
                                        "a setting of: node, barrier)"),
    (["runs", "--jsn"], "mosaicd runs: error: unrecognized argument: --jsn (did you mean --json?)"),
    (["cluster", "--pin-nodes", "sometimes"], "mosaicd cluster: error: --pin-nodes: expected one of auto, on, off, "
                                              "got 'sometimes'"),
    (["simulate", "--pin-nodes", "on"], "mosaicd simulate: error: unrecognized argument: --pin-nodes (did you mean "
                                        "--nodes?)"),
])
def test_a_mistyped_flag_is_named_first_with_its_suggestion_not_under_the_usage(
        argv: list[str], first: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2
    assert lines == [first, f"mosaicd {argv[0]} --help lists every flag"], lines


def test_a_missing_secret_says_the_command_that_makes_one_and_that_command_makes_a_usable_secret(
        tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("".join(f"127.0.0.1:{9100 + i}\n" for i in range(4)))
    member = [*MOSAICD, "--peer-list", str(peers), "--port", "9100", "--out", str(tmp_path / "out")]
    without = subprocess.run(member, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    missing = subprocess.run([*member, "--secret-file", str(tmp_path / "secret")], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
    made = []
    for proc in (without, missing):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode in (1, 2) and len(lines) == 1 and "--secret-file" in lines[0], proc.stderr
        made += re.findall(r"make one with `([^`]+)`", lines[0])
    assert len(made) == 2 and made[1].endswith(f"> {tmp_path / 'secret'}"), made
    assert not (tmp_path / "out").exists()
    for command in made:  # each as shown, run in a shell: a secret that the members accept
        subprocess.run(command, shell=True, check=True, cwd=tmp_path, timeout=10)
        assert len(load_secret(tmp_path / "secret") or b"") >= 16
        (tmp_path / "secret").unlink()
