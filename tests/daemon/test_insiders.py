"""Issue 21 on real processes on loopback: `mosaicd cluster` is signed by default (its secret leaks nowhere), a
run with attackers and a robust aggregator gives `mosaicd simulate`'s models bit for bit, refusals by --max-norm
are counted in /metrics and nodes.csv, and an unprotected barrier says so once."""

from __future__ import annotations

import csv
import json
import stat
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaic_proto import CONTENT_TYPE, Fragmentation, FragmentBatch, Layout, PeerSampler, encode
from mosaicd import Settings
from mosaicd.experiments.cluster import Cluster, free_ports, run_cluster
from mosaicd.experiments.simulate import run_simulation
from mosaicd.protocol import byzantine_ranks

QUADRATIC = dict(nodes=5, rounds=8, fragments=4, fanout=2, dim=16, seed=3, eval_every=4)


def node_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "nodes.csv", newline="") as f:
        return list(csv.DictReader(f))


def by_reason(rows: list[dict[str, str]]) -> Counter:
    total: Counter = Counter()
    for row in rows:
        for part in row["refused_by_reason"].split():
            reason, count = part.split("=")
            total[reason] += int(count)
    return total


def scrape(kit: Any, port: int, prefix: str) -> float:
    """The sum of a /metrics family's samples whose line starts with `prefix`."""
    body = kit.http("GET", f"http://127.0.0.1:{port}/metrics").body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))


@pytest.mark.slow  # 6 loopback clusters of 6 processes and 6 simulations: ~40 s on 2 idle cores
@pytest.mark.parametrize(("aggregator", "attack"), [
    ("mean", None), ("mean", "sign-flip"), ("trimmed-mean", None), ("trimmed-mean", "noise"),
    ("clipped", None), ("clipped", "alie")])
def test_simulate_equals_cluster_with_robust_aggregation_and_attackers(tmp_path: Path, aggregator: str,
                                                                       attack: str | None) -> None:
    attackers = {} if attack is None else dict(byzantine=1, attack=attack, attack_scale=3.0)
    radius = {"clip_radius": 0.05} if aggregator == "clipped" else {}  # --clip-radius is clipped's only
    run = dict(QUADRATIC, aggregator=aggregator, **radius, **attackers)
    cluster = run_cluster(Settings(**run, out=tmp_path / "cluster"), progress=False, timeout=120)
    simulate = run_simulation(Settings(**run, out=tmp_path / "simulate"), progress=False)
    assert cluster["status"] == simulate["status"] == "finished"
    assert cluster["model_sha256"] == simulate["model_sha256"] and len(cluster["model_sha256"]) == 5
    ranks = list(byzantine_ranks(Settings(**run).run_config()))
    assert cluster["byzantine_ranks"] == simulate["byzantine_ranks"] == ranks
    assert len(cluster["byzantine_ranks"]) == (0 if attack is None else 1)
    for summary in (cluster, simulate):  # the metrics cover the honest nodes only, and say so
        assert summary["honest_only"] is (attack is not None)
        assert summary["final"]["nodes"] == [r for r in range(5) if r not in summary["byzantine_ranks"]]
        assert summary["final"].get("honest_only", False) is (attack is not None)
    if attack is not None:  # the attack moved the models: the test compares attacked runs, not clean ones
        clean = run_simulation(Settings(**dict(QUADRATIC, aggregator=aggregator, **radius), out=tmp_path / "clean"),
                               progress=False)
        honest = [str(r) for r in range(5) if r not in cluster["byzantine_ranks"]]
        assert [clean["model_sha256"][r] for r in honest] != [cluster["model_sha256"][r] for r in honest]


@pytest.mark.slow  # one loopback cluster of 6 processes and one simulation: ~8 s on 2 idle cores
def test_simulate_takes_max_norm_and_equals_cluster(tmp_path: Path) -> None:
    """--max-norm refuses the attacker's scaled fragments in both: the same models (per-round refusal counts depend
    on when a message came in a cluster: docs/security.md)."""
    run = dict(QUADRATIC, byzantine=1, attack="scale", attack_scale=1000.0, max_norm=10.0)
    cluster = run_cluster(Settings(**run, out=tmp_path / "cluster"), progress=False, timeout=120)
    simulate = run_simulation(Settings(**run, out=tmp_path / "simulate"), progress=False)
    assert cluster["model_sha256"] == simulate["model_sha256"] and len(cluster["model_sha256"]) == 5
    unguarded = run_simulation(Settings(**dict(run, max_norm=None), out=tmp_path / "unguarded"), progress=False)
    assert unguarded["model_sha256"] != simulate["model_sha256"]  # the guard changed what the honest nodes kept
    refused = by_reason(node_rows(tmp_path / "simulate"))["out_of_range"]
    attacker = byzantine_ranks(Settings(**run).run_config())[0]
    unsent = sum(int(r["fragments_unsent"]) for r in node_rows(tmp_path / "simulate") if int(r["node"]) == attacker)
    assert refused > 0 and unsent > 0


@pytest.mark.slow  # one loopback cluster of 5 processes: ~8 s on 2 idle cores
def test_max_norm_refusals_are_counted_in_metrics_and_nodes_csv(tmp_path: Path, kit: Any) -> None:
    run = dict(QUADRATIC, rounds=6, byzantine=1, attack="scale", attack_scale=1000.0)
    settings = Settings(**run, max_norm=10.0, linger=20.0, out=tmp_path / "run")
    attacker = byzantine_ranks(settings.run_config())[0]
    honest = [r for r in range(5) if r != attacker]
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    try:
        kit.wait_lingering(cluster, result, 60)
        refused = {r: scrape(kit, cluster.node_ports[r], 'mosaic_refused_messages_total{reason="out_of_range"}')
                   for r in range(5)}
    finally:
        cluster.stop()
        thread.join(timeout=30)
    rows = node_rows(tmp_path / "run")
    # the attacker's messages, from its plan: its report counts those refused at once as unsent, and those a
    # receiver buffered (for its next round) and refused once its own norms were known as sent
    sampler = PeerSampler(settings.sampler, settings.fanout, settings.seed)
    planned = [len(sampler.plan(t, attacker, settings.fragments, list(range(5)))) for t in range(settings.rounds)]
    sent, sent_before_last = sum(planned), sum(planned[:-1])
    assert sent > 0
    # every message of the attacker was refused by an honest node, and each refusal counted once in /metrics ...
    assert sum(refused[r] for r in honest) == sent and refused[attacker] == 0
    # ... and in nodes.csv, by reason (a refusal is reported with the node's next arrival: those of the last
    # round come after the last report)
    counted = by_reason([row for row in rows if int(row["node"]) in honest])
    assert sent_before_last <= counted["out_of_range"] <= sent
    assert all(int(row["refused"]) == sum(by_reason([row]).values()) for row in rows)


@pytest.mark.slow  # one loopback cluster of 4 processes: ~6 s on 2 idle cores
def test_default_cluster_is_signed_and_its_secret_appears_nowhere(tmp_path: Path, kit: Any) -> None:
    out = tmp_path / "run"
    settings = Settings(nodes=3, rounds=4, fragments=2, fanout=1, dim=8, eval_every=2, linger=5.0, out=out)
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    seen: list[str] = []
    try:
        port = kit.wait_until(lambda: cluster.node_ports and cluster.secret_file and cluster.node_ports[0], 30,
                              "the cluster's ports")
        secret_file = cluster.secret_file
        assert secret_file is not None and out not in secret_file.parents
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
        secret = secret_file.read_text().strip()
        assert len(secret) >= 16
        kit.wait_until(lambda: kit.status(port).get("rank", -1) >= 0, 30, "node-0 registered")
        fr = Fragmentation.build(Layout.flat(8), 2, settings.seed)
        forged = encode(FragmentBatch(settings.run_id, 1, 1, 2, fr.fingerprint, {0: np.ones(4, np.float32)}))
        reply = kit.http("POST", f"http://127.0.0.1:{port}/v1/fragments", forged, CONTENT_TYPE)
        assert reply.status == 401 and reply.json()["reason"] == "unsigned"
        registration = kit.http("POST", f"http://127.0.0.1:{cluster.barrier_port}/v1/register",
                                json.dumps({"address": "127.0.0.1:9"}).encode(), "application/json")
        assert registration.status == 401
        for p in [cluster.barrier_port, *cluster.node_ports]:
            for path in ("/v1/status", "/metrics", "/v1/history"):
                seen.append(kit.http("GET", f"http://127.0.0.1:{p}{path}").body.decode())
    finally:
        thread.join(timeout=150)
        cluster.stop()
    assert result.get("summary", {}).get("status") == "finished", result
    assert result["summary"]["model_sha256"] == kit.reference_hashes(settings)
    assert not secret_file.exists() and not secret_file.parent.exists()  # deleted at the end
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "barrier.log" for p in files) and any(p.name == "summary.json" for p in files)
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    assert not any(secret in text for text in seen)


def test_an_unprotected_barrier_on_loopback_warns_once(tmp_path: Path, kit: Any) -> None:
    port = free_ports(1)[0]
    proc = subprocess.Popen([*kit.by_hand, "barrier", "--host", "127.0.0.1", "--port", str(port), "--nodes", "2",
                             "--fanout", "1", "--log-json", "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        kit.wait_until(lambda: kit.http("GET", f"http://127.0.0.1:{port}/healthz").status == 200
                       if _listening(port) else False, 30, "the barrier listening")
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0].decode()
    warnings = [json.loads(line) for line in output.splitlines() if line.startswith("{") and '"no_secret"' in line]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning" and "--secret-file" in warnings[0]["detail"]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
