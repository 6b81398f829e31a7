"""--compress on real processes on loopback (issue #37): for every codec `mosaicd cluster` gives `mosaicd simulate`'s
models bit for bit, signed as every cluster is; nodes.csv and /metrics count the bytes on the wire and the float32
bytes before compression; a simulation stopped and resumed carries each node's error feedback on."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.experiments.cluster import Cluster, run_cluster
from mosaicd.experiments.simulate import run_simulation

QUADRATIC = dict(nodes=5, rounds=8, fragments=4, fanout=2, dim=512, seed=3, eval_every=4)


def node_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "nodes.csv", newline="") as f:
        return list(csv.DictReader(f))


def sent(out: Path) -> tuple[int, int]:
    """(bytes on the wire, float32 bytes before compression) that every node sent, from nodes.csv."""
    rows = node_rows(out)
    return sum(int(r["bytes_out"]) for r in rows), sum(int(r["raw_bytes_out"]) for r in rows)


@pytest.mark.slow  # 6 loopback clusters of 6 processes and 6 simulations: ~45 s on 2 idle cores
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "topk:0.1", "topk:0.5"])
def test_simulate_equals_cluster_for_every_codec(tmp_path: Path, codec: str) -> None:
    run = dict(QUADRATIC, compress=codec)
    cluster = run_cluster(Settings(**run, out=tmp_path / "cluster"), progress=False, timeout=120)
    simulate = run_simulation(Settings(**run, out=tmp_path / "simulate"), progress=False)
    assert cluster["status"] == simulate["status"] == "finished"
    assert cluster["model_sha256"] == simulate["model_sha256"] and len(cluster["model_sha256"]) == 5
    assert cluster["settings"]["compress"] == codec
    wire, raw = sent(tmp_path / "cluster")
    assert (wire, raw) == sent(tmp_path / "simulate")
    assert raw == 8 * 5 * 2 * 512 * 4  # rounds x nodes x fanout x the model's float32 bytes (every fragment twice)
    ratio = {"none": (1.0, 1.15), "fp16": (0.5, 0.65), "bf16": (0.5, 0.65), "int8": (0.25, 0.4),
             "topk:0.1": (0.2, 0.35), "topk:0.5": (1.0, 1.15)}[codec]
    assert ratio[0] <= wire / raw <= ratio[1], (codec, wire / raw)
    if codec != "none":  # the codec changed the models: the test compares compressed runs, not plain ones
        plain = run_simulation(Settings(**QUADRATIC, out=tmp_path / "plain"), progress=False)
        assert plain["model_sha256"] != simulate["model_sha256"]


@pytest.mark.slow  # 2 loopback clusters of 6 processes and 2 simulations: ~16 s on 2 idle cores
@pytest.mark.parametrize(("codec", "aggregator"), [("topk:0.25", "trimmed-mean"), ("int8", "clipped")])
def test_robust_aggregators_on_compressed_messages_equal_simulate(tmp_path: Path, codec: str, aggregator: str) -> None:
    """A robust rule reads a sparse message's missing coordinates as the newest values heard; an attacker's
    crafted fragments are compressed as any others."""
    run = dict(QUADRATIC, compress=codec, aggregator=aggregator, byzantine=1, attack="sign-flip")
    cluster = run_cluster(Settings(**run, out=tmp_path / "cluster"), progress=False, timeout=120)
    simulate = run_simulation(Settings(**run, out=tmp_path / "simulate"), progress=False)
    assert cluster["status"] == simulate["status"] == "finished"
    assert cluster["model_sha256"] == simulate["model_sha256"] and len(cluster["model_sha256"]) == 5


@pytest.mark.slow  # one loopback cluster of 6 processes: ~8 s on 2 idle cores
def test_metrics_count_the_bytes_on_the_wire_and_before_compression(tmp_path: Path, kit: Any) -> None:
    settings = Settings(**QUADRATIC, compress="int8", linger=20.0, out=tmp_path / "run")
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    try:
        kit.wait_lingering(cluster, result, 60)
        scraped = {}
        for name in ("mosaic_sent_bytes_total", "mosaic_sent_uncompressed_bytes_total"):
            scraped[name] = sum(float(line.rsplit(" ", 1)[1]) for p in cluster.node_ports
                                for line in kit.http("GET", f"http://127.0.0.1:{p}/metrics").body.decode().splitlines()
                                if line.startswith(name + " "))
    finally:
        cluster.stop()
        thread.join(timeout=30)
    wire, raw = sent(tmp_path / "run")
    assert scraped == {"mosaic_sent_bytes_total": wire, "mosaic_sent_uncompressed_bytes_total": raw}
    assert wire < 0.4 * raw


@pytest.mark.parametrize("codec", ["int8", "topk:0.25"])
def test_a_stopped_simulation_resumes_with_its_error_feedback(tmp_path: Path, codec: str) -> None:
    """Ctrl-C after round 5 (checkpoint every 2 rounds), then --resume: the uninterrupted run's models. Without the
    carried error feedback the resumed nodes would send other values."""
    run = dict(QUADRATIC, rounds=10, compress=codec, checkpoint_rounds=2)
    whole = run_simulation(Settings(**run, out=tmp_path / "whole"), progress=False)

    def stop(done: Any) -> None:
        if done.round == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_simulation(Settings(**run, out=tmp_path / "stopped"), progress=False, on_round=stop, advise=False)
    resumed = run_simulation(Settings(**run, out=tmp_path / "stopped"), progress=False, resume=True)
    assert resumed["status"] == "finished" and resumed["model_sha256"] == whole["model_sha256"]
    fresh = run_simulation(Settings(**dict(run, error_feedback=False), out=tmp_path / "no-feedback"), progress=False)
    assert fresh["model_sha256"] != whole["model_sha256"]  # error feedback changes the models: it is carried
