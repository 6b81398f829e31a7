"""deploy/multihost across three Docker engines, each a host with its own IP (tests/hosts/hostlab.py): the barrier's
project on host 0, a nodes project with --scale on every host, exactly as the files' comments say. The models
equal `mosaicd simulate`'s, on plain links and on shaped ones (tbf 100 Mbit/s on every host, 20 ms more each way
through the relay). Seconds per round are printed (`pytest -s`); tests/hosts/measure.py prints the figures of
docs/deploy.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from hostlab import ComposePerHost, HostsLab, seconds_per_round, simulated_hashes

pytestmark = [pytest.mark.docker, pytest.mark.netns, pytest.mark.slow]

SCALE = {0: 2, 1: 2, 2: 2}
SETTINGS = {"MOSAIC_TASK": "quadratic", "MOSAIC_ROUNDS": "8", "MOSAIC_FRAGMENTS": "4", "MOSAIC_FANOUT": "3",
            "MOSAIC_EVAL_EVERY": "4", "MOSAIC_SEED": "5", "MOSAIC_BARRIER_LINGER": "30"}


def run_across(lab: HostsLab, tmp: Path, image: str) -> tuple[dict, list[float]]:
    run = ComposePerHost(lab, tmp, image, SCALE, settings=SETTINGS)
    try:
        run.up()
        summary = run.wait_final(timeout=300)
        assert summary["status"] == "finished", f"{summary.get('error')}\n{run.logs()}"
        status = run.status()  # the barrier lingers
        hosts = {m["address"].rsplit(":", 1)[0] for m in status["members"]}
        assert hosts == {lab.ip(k) for k in SCALE}, status["members"]  # every host's nodes took part
        durations = seconds_per_round(run.history())
    finally:
        run.down()
    nodes = sum(SCALE.values())
    assert sorted(summary["model_sha256"], key=int) == [str(i) for i in range(nodes)] and summary["dropped"] == []
    assert summary["model_sha256"] == simulated_hashes(summary, tmp / "simulated")
    return summary, durations


def test_compose_per_host_across_three_engines_equals_simulate(links: HostsLab, host_image: str,
                                                               tmp_path: Path) -> None:
    _, durations = run_across(links, tmp_path, host_image)
    print(f"compose per host, 3 hosts, plain links: {statistics.median(durations):.3f} s per round (median)")


def test_compose_per_host_on_shaped_links_completes_with_the_same_models(links: HostsLab, host_image: str,
                                                                         tmp_path: Path) -> None:
    for k in range(3):
        links.shape(k, "100mbit", burst="64kb")  # tbf needs a burst of rate / HZ at least
    links.delay(0.02, tmp_path / "tproxy.log")
    _, durations = run_across(links, tmp_path, host_image)
    assert links.redirected() > 0, "no connection between hosts went through the delaying relay"
    assert all(links.shaped(k)["bytes"] > 0 for k in range(3)), [links.shaped(k) for k in range(3)]
    print(f"compose per host, 3 hosts, 100 Mbit/s + 20 ms: {statistics.median(durations):.3f} s per round (median)")
