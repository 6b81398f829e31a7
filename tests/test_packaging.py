"""The install's parts: the core (no torch, scikit-learn or matplotlib) runs the daemon and the quadratic task, and
a command that needs an extra names the pip command that installs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("torch", "sklearn", "scipy", "matplotlib")
# Every module the core commands import: the CLI (all its subcommands' parsers), the daemon, the runners.
CORE_IMPORTS = ("import mosaic_proto, mosaicd, mosaicd.cli, mosaicd.daemon.node.run, mosaicd.experiments.simulate, "
                "mosaicd.experiments.cluster, mosaicd.experiments.sweep, mosaicd.experiments.report, "
                "mosaicd.experiments.analysis, mosaicd.learning.tasks, mosaicd.learning.tasks.quadratic; "
                "mosaicd.cli.build_parser()")


def python(code: str, executable: str = sys.executable, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([executable, "-c", code], capture_output=True, text=True, timeout=120, **kwargs)


def test_core_modules_import_no_extra() -> None:
    for code in ("import mosaic_proto", "import mosaicd", CORE_IMPORTS):
        proc = python(f"{code}\nimport sys\nprint(sorted(m for m in {EXTRAS!r} if m in sys.modules))")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "[]", (code, proc.stdout)


@pytest.mark.parametrize(("blocked", "argv", "extra"), [
    ("torch", ["simulate", "--task", "digits", "--nodes", "4", "--rounds", "1"], "learning"),
    ("sklearn", ["simulate", "--task", "digits", "--nodes", "4", "--rounds", "1"], "learning"),
    ("torch", ["cluster", "--task", "cifar10", "--nodes", "4", "--rounds", "1"], "learning"),
    ("matplotlib", ["report", "nowhere"], "plots"),
    ("matplotlib", ["analyze"], "plots"),
])
def test_a_missing_extra_is_one_clear_line(tmp_path: Path, blocked: str, argv: list[str], extra: str) -> None:
    """`sys.modules[name] = None` makes `import name` fail as if it were not installed."""
    out = ["--out", str(tmp_path / "out")]
    proc = python(f"import sys; sys.modules[{blocked!r}] = None\nfrom mosaicd.cli import main\nmain({argv + out!r})",
                  cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'mosaic-learning[{extra}]'" in lines[0], proc.stderr
    assert blocked in lines[0] and lines[0].startswith(f"mosaicd {argv[0]}: error:")


def test_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "mosaicd", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("mosaicd 0."), proc


@pytest.mark.slow
def test_the_core_wheel_installs_and_runs_without_torch(tmp_path: Path) -> None:
    """The project's wheel in a fresh venv with only its core dependencies (pip's configured index; ~20 s)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # the venv's own modules
    run = dict(capture_output=True, text=True, timeout=600, env=env)

    def ok(*cmd: str | Path) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(c) for c in cmd], **run)  # type: ignore[call-overload]
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
        return proc

    ok(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src)
    wheel = next((tmp_path / "dist").glob("mosaic_learning-*.whl"))
    venv = tmp_path / "venv"
    ok(sys.executable, "-m", "venv", venv)
    bin_ = venv / "bin"
    ok(bin_ / "pip", "install", "-q", wheel)

    assert python("import torch", str(bin_ / "python"), env=env).returncode != 0  # really absent
    if sys.platform == "linux":  # the roles' event loop comes with the core there (--event-loop auto)
        assert python("import uvloop", str(bin_ / "python"), env=env).returncode == 0
    where = ok(bin_ / "python", "-c", "import mosaicd; print(mosaicd.__file__)").stdout
    assert where.startswith(str(venv)), where  # the wheel's, not the checkout's
    assert ok(bin_ / "mosaicd", "--version").stdout.strip() == f"mosaicd {wheel.name.split('-')[1]}"
    imported = ok(bin_ / "python", "-c", f"{CORE_IMPORTS}\nimport sys\n"
                  f"print(sorted(m for m in {EXTRAS!r} if m in sys.modules))")
    assert imported.stdout.strip() == "[]"
    # the quadratic task end to end: a barrier and node processes (`mosaicd barrier`, `mosaicd node`)
    ok(bin_ / "mosaicd", "cluster", "--task", "quadratic", "--nodes", "3", "--rounds", "2", "--fanout", "1",
       "--quiet", "--out", tmp_path / "quadratic")
    assert (tmp_path / "quadratic" / "summary.json").is_file()

    digits = subprocess.run([bin_ / "mosaicd", "simulate", "--task", "digits", "--nodes", "4", "--rounds", "1",
                             "--out", tmp_path / "digits"], **run)  # type: ignore[call-overload]
    assert digits.returncode in (1, 2), digits
    assert "mosaic-learning[learning]" in digits.stderr and "Traceback" not in digits.stderr, digits.stderr
    report = subprocess.run([bin_ / "mosaicd", "report", tmp_path / "quadratic"], **run)  # type: ignore[call-overload]
    assert report.returncode == 1 and "mosaic-learning[plots]" in report.stderr, report.stderr


def requirements_of(extras: set[str]) -> set[str]:
    """The distributions that `pip install '.[EXTRAS]'` brings by name, its own extras followed (pyproject.toml)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names, seen, todo = {re.split(r"[<>=!~;\[ ]", r)[0] for r in project["dependencies"]}, set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in project["optional-dependencies"][extra]:
            own = re.fullmatch(r"mosaic-learning\[(.+)\]", requirement)
            if own:
                todo += own.group(1).split(",")
            else:
                names.add(re.split(r"[<>=!~;\[ ]", requirement)[0])
    return names


def test_the_readmes_install_gives_every_tool_its_commands_outside_the_tests_run() -> None:
    """The quick start's install, then the README's other commands (`.venv/bin/mkdocs serve` among them): each
    tool they run comes with it (issue 58, item 8: mkdocs was in `[docs]` only, not in the `[all]` installed)."""
    import re

    readme = (ROOT / "README.md").read_text()
    before_tests, _, after = readme.partition("\n## Tests\n")
    outside_tests = before_tests + after[after.index("\n## "):]
    install = re.search(r"\.venv/bin/pip install [^`\n]*-e '\.\[([a-z,]+)\]'", before_tests)
    assert install, "the quick start installs with .venv/bin/pip install ... -e '.[EXTRAS]'"
    tools = set(re.findall(r"\.venv/bin/([a-z0-9_-]+)", outside_tests)) - {"pip", "mosaicd", "python", "python3"}
    assert "mkdocs" in tools, "the README names its documentation command"
    given = requirements_of(set(install.group(1).split(",")))
    assert tools <= given, f"the README's install ({install.group(0)}) lacks {sorted(tools - given)}"
