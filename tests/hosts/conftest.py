"""The three-engine lab, shared by the container tests of tests/hosts: built once per session.

The image is built on the machine's own Docker engine exactly as tests/docker builds it (the same tag, so CI's
second build is a cache hit), saved once and loaded into each lab engine. MOSAIC_HOSTS_ENGINES=DIR keeps the lab
engines' data roots there between sessions (the image is then loaded only when it changed); by default they are
removed at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostlab import HostsLab, load_image, missing
from needs import lacking

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("MOSAIC_TEST_IMAGE", "mosaic:test")
BASE = os.environ.get("MOSAIC_BASE", "mosaic-base:bookworm")
KEEP = os.environ.get("MOSAIC_HOSTS_ENGINES")


def _sh(*args: str, timeout: float = 1800) -> None:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")


@pytest.fixture(scope="session")
def host_image() -> str:
    """mosaic:test, built on the machine's engine as tests/docker/test_docker.py builds it."""
    why = missing()
    if why:
        lacking("NETNS", why)
    if shutil.which("dockerd") is None or subprocess.run(["docker", "info"], capture_output=True,
                                                         timeout=60).returncode != 0:
        lacking("DOCKER", "no Docker engine answers `docker info`, or no dockerd to start the lab's engines (.ci/run "
                "installs and starts one)")
    _sh("deploy/build-test-image.sh", IMAGE, BASE, timeout=3600)  # waits for .ci/run's build under way
    return IMAGE


@pytest.fixture(scope="session")
def hosts(host_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostsLab]:
    """Three hosts with their own IPs and dockerd each, the image loaded in all three."""
    root = Path(KEEP) if KEEP else tmp_path_factory.mktemp("engines")
    try:
        with HostsLab(hosts=3) as lab:
            engines = lab.start_engines(root)
            load_image(engines, host_image, tmp_path_factory.mktemp("image") / "image.tar")
            yield lab
    finally:
        if not KEEP:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def links(hosts: HostsLab) -> Iterator[HostsLab]:
    """The lab, its links plain again (no tbf, no delay) when the test ends."""
    yield hosts
    hosts.undelay()
    for k in range(len(hosts.hosts)):
        hosts.unshape(k)
