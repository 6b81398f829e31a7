"""The pages' runnable blocks, without a lab (seconds): the ones the lab tests run are there, parse as shell, and
name only files that exist. The lab tests (test_compose_hosts.py, test_swarm_hosts.py, test_slurm.py) run them."""

from __future__ import annotations

import re
import subprocess

import pytest
from pageblocks import DEPLOY_PAGE, ROOT, SLURM_PAGE, blocks

USED = {DEPLOY_PAGE: {"secret", "barrier", "nodes", "swarm-secret", "swarm-deploy"}, SLURM_PAGE: {"slurm-first-run"}}


@pytest.mark.parametrize("page", list(USED), ids=lambda p: p.name)
def test_the_marked_blocks_are_there_parse_and_name_existing_files(page) -> None:
    found = blocks(page)
    assert set(found) == USED[page]
    for name, text in found.items():
        subprocess.run(["bash", "-n", "-c", text], check=True, timeout=30)
        for path in re.findall(r"\bdeploy/[\w./-]+", text):
            assert (ROOT / path).exists(), f"{page.name}, block {name}: {path}"
