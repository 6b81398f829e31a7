"""What some tests need that a machine may lack (a Docker engine, a browser, root for network namespaces, Slurm).

Without it they skip, saying what is missing; where `.ci/run` sets MOSAIC_REQUIRE_<WHAT>=1 they fail instead, so
that CI never passes by skipping. The variables are read when this module is first imported (tests/conftest.py
imports it before any fixture clears the MOSAIC_* variables).
"""

from __future__ import annotations

import os
from typing import NoReturn

REQUIRED = frozenset(what for what in ("DOCKER", "BROWSER", "NETNS", "SLURM")
                     if os.environ.get(f"MOSAIC_REQUIRE_{what}") == "1")


def lacking(what: str, why: str) -> NoReturn:
    """Skip the calling test because `why`, or fail it where MOSAIC_REQUIRE_<what>=1."""
    import pytest

    if what in REQUIRED:
        pytest.fail(f"MOSAIC_REQUIRE_{what}=1 but {why}")
    pytest.skip(why)
