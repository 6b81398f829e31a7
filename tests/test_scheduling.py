"""How CI's not-quick set is shared between xdist's workers (tests/conftest.py): the tests of the host's engines
(its one Docker engine, its namespaces, its Slurm) run in turn on one worker, the rest beside them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# two tests of the engines' group that need no engine running: they read the documentation and the compose files
TWO_ENGINE_TESTS = ["tests/docker/test_docker.py::test_the_secret_one_liners_are_the_documented_ones",
                    "tests/docker/test_docker.py::test_the_neighbour_table_rule_and_the_documented_sysctl_lines"]


def test_the_engines_tests_run_in_turn_on_one_worker() -> None:
    """They ran two at a time with nothing said, for two reasons: a conftest hook that marked them after xdist's
    worker had read the marks, and pytest 9.2, under which xdist 3.8 cannot group (pytest-dev/pytest-xdist#1386)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "-v", "-o", "addopts=", *TWO_ENGINE_TESTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")})
    ran = re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] (?:PASSED|SKIPPED|FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)
    assert len(ran) == 2, done.stdout[-3000:] + done.stderr[-2000:]
    assert all(test.endswith("@engines") for _, test in ran), ran
    assert len({worker for worker, _ in ran}) == 1, ran
