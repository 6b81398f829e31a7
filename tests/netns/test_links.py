"""A cluster of `mosaicd node --peer-list` processes on hosts with their own IPs (network namespaces, harness.py),
over links that delay, lose, partition and shape: what the protocol promises holds there too.

Root, iproute2 and iptables are needed; without them these tests skip, saying what is missing. `.ci/run` installs
them and sets MOSAIC_REQUIRE_NETNS=1, so that in CI they fail instead. The settings each scenario needs (round
deadline, request timeout, retries, drop-after) are explained in docs/networks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import Lab, NetnsCluster, require_netns

pytestmark = [pytest.mark.netns, pytest.mark.slow]  # about 20 s each (6 node processes on 2 cores)


@pytest.fixture(scope="module")
def netns() -> None:
    require_netns()


def simulate_hashes(tmp_path: Path, kit: Any, run: dict[str, Any]) -> dict[str, str]:
    """`mosaicd simulate` of the same run: summary.json's model_sha256."""
    out = tmp_path / "simulate"
    proc = subprocess.run([sys.executable, "-m", "mosaicd", "simulate", *kit.flags(run), "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["model_sha256"]


def node_columns(cluster: NetnsCluster, column: str) -> list[float]:
    return [float(row[column]) for row in cluster.rows()]


# protocol-only rounds of a 64 KiB model: every node sends 128 KiB a round, ~800 packets a round on every host
PROTOCOL = dict(nodes=6, fragments=4, fanout=2, dim=16384, train=False, eval_every=0, seed=5)


def test_delay_and_loss_change_nothing_but_time(netns: None, tmp_path: Path, kit: Any) -> None:
    """50 ms each way and 1% of packets lost into every host: TCP resends what is lost, so every fragment
    arrives and the models equal simulate's, bit for bit."""
    run = dict(PROTOCOL, rounds=10)
    # a lost SYN costs 1 s and a lost segment 200 ms or more (doubling): 10 s requests never give up on that
    network = dict(request_timeout=10, retries=2, round_deadline=60)
    with Lab(hosts=3) as lab:
        for host in range(3):
            lab.loss(host, 0.01)
        cluster = NetnsCluster(lab, tmp_path, kit.flags({**run, **network}), per_host=2, delay=0.05).start()
        codes = cluster.wait(timeout=150)
        lost = sum(lab.lost(host) for host in range(3))
    assert codes == dict.fromkeys(range(6), 0), {r: cluster.log_tail(r) for r, c in codes.items() if c != 0}
    assert lost > 0  # the rule did drop packets (about 1% of some 12,000)
    summary = cluster.summary()
    assert summary["status"] == "finished" and summary["dropped"] == [] and summary["events"] == []
    assert len(cluster.rows()) == 6 * run["rounds"]
    assert set(node_columns(cluster, "fragments_unsent")) == {0.0}  # nothing lost for good: compare the models
    assert summary["model_sha256"] == simulate_hashes(tmp_path, kit, run)


def test_partitioned_host_straggles_is_dropped_and_the_others_finish(netns: None, tmp_path: Path, kit: Any) -> None:
    """Host 2 (ranks 4 and 5) is cut off for three released rounds, then healed: its nodes are stragglers,
    dropped after --drop-after 2 missed rounds, and told so when the link heals; the others finish."""
    run = dict(PROTOCOL, rounds=30, dim=64)
    # sends to the cut host give up after 1 s (no retry); the 3 s deadline leaves the others 2 s to spare,
    # so only the cut host's nodes straggle
    network = dict(request_timeout=1, retries=0, round_deadline=3, drop_after=2, barrier_grace=30)
    cut = [4, 5]
    # the others may finish within seconds of the heal, before TCP's backoff lets a cut node's request through:
    # rank 0 keeps its barrier serving for 20 s after the run, so that the cut nodes hear that they were dropped
    linger = {0: ["--linger", "20"]}
    with Lab(hosts=3) as lab:
        cluster = NetnsCluster(lab, tmp_path, kit.flags({**run, **network}), per_host=2, delay=0.01,
                               extra=linger).start()
        cluster.wait_released(2, timeout=60)
        lab.cut(2)
        at = cluster.released()
        cluster.wait_released(at + 3, timeout=60)  # three rounds released without host 2
        lab.heal(2)
        codes = cluster.wait(timeout=90)
    assert all(codes[r] == 0 for r in range(4)), {r: cluster.log_tail(r) for r in range(4) if codes[r] != 0}
    for rank in cut:  # back on the network, it hears that it was dropped, and exits saying so
        assert codes[rank] not in (0, None), cluster.log_tail(rank)
        assert "dropped" in cluster.log_tail(rank, 20_000)
    summary = cluster.summary()
    assert summary["status"] == "finished"
    # the order is the order they were dropped in: a cut node's last arrival may have made one more round
    assert sorted(summary["dropped"]) == cut and summary["members"] == [0, 1, 2, 3]
    assert sorted(summary["model_sha256"], key=int) == ["0", "1", "2", "3"]
    events = summary["events"]
    # only the cut host's nodes straggle; they straggle before they are dropped, and both are dropped
    assert events and all(set(e["stragglers"]) <= set(cut) for e in events), events
    assert events[0]["dropped"] == [] and sorted(events[-1]["dropped"]) == cut, events
    assert all(at - 1 <= e["round"] <= at + 3 for e in events), (at, events)
    rounds: dict[int, set[int]] = {}
    for row in cluster.rows():
        rounds.setdefault(int(row["node"]), set()).add(int(row["round"]))
    assert all(rounds[r] == set(range(run["rounds"])) for r in range(4))  # the others reported every round
    assert all(max(rounds.get(r, {-1})) <= at + 1 for r in cut)


def test_host_cut_off_briefly_straggles_and_rejoins(netns: None, tmp_path: Path, kit: Any) -> None:
    """Host 2 cut off for one or two released rounds, --drop-after 5: its nodes straggle, are not dropped, and take
    up the run again when the link heals (the barrier answers a late arrival with the release it kept, for 3
    rounds); everyone finishes."""
    run = dict(PROTOCOL, rounds=20, dim=64)
    # At the heal host 2 may have missed rounds at+1 and at+2. Its late arrival at at+1 must reach the barrier
    # before at+4 is released (the barrier keeps 3 releases): two 5 s deadlines after the heal, room for TCP's
    # resend backoff and the arrival's retry backoff (each up to a few seconds). --drop-after 3 gave it one 4 s
    # deadline to be back at the open round: it was dropped once in CI and in 1 run of 3 on an idle machine.
    network = dict(request_timeout=1, retries=0, round_deadline=5, drop_after=5)
    with Lab(hosts=3) as lab:
        # rank 0's barrier serves 20 s after the run, so host 2's nodes, late after TCP's backoff, still hear the
        # final release (seen once on a loaded machine: they retried a gone barrier past the test's wait)
        cluster = NetnsCluster(lab, tmp_path, kit.flags({**run, **network}), per_host=2, delay=0.01,
                               extra={0: ["--linger", "20"]}).start()
        cluster.wait_released(2, timeout=60)
        lab.cut(2)
        at = cluster.released()  # round at + 1 may be released with host 2's arrivals sent before the cut;
        cluster.wait_released(at + 2, timeout=60)  # round at + 2 opened after it: host 2 cannot finish it
        lab.heal(2)
        codes = cluster.wait(timeout=90)
    assert codes == dict.fromkeys(range(6), 0), {r: cluster.log_tail(r) for r, c in codes.items() if c != 0}
    summary = cluster.summary()
    assert summary["status"] == "finished" and summary["dropped"] == [] and summary["members"] == list(range(6))
    events = summary["events"]
    assert events and all(set(e["stragglers"]) <= {4, 5} and not e["dropped"] for e in events), events
    assert len(summary["model_sha256"]) == 6


def test_dropped_host_rejoins_with_rejoin_dropped(netns: None, tmp_path: Path, kit: Any) -> None:
    """As the partition above, with --rejoin-dropped: host 2's nodes are dropped, and once the link heals they
    register again and are members from the next round boundary on; everyone finishes."""
    run = dict(PROTOCOL, rounds=60, dim=64)  # ~0.3 s rounds after the drop: the run is still going at the heal
    network = dict(request_timeout=1, retries=0, round_deadline=3, drop_after=2, barrier_grace=30,
                   rejoin_dropped=True)
    with Lab(hosts=3) as lab:
        cluster = NetnsCluster(lab, tmp_path, kit.flags({**run, **network}), per_host=2, delay=0.03).start()
        cluster.wait_released(2, timeout=60)
        lab.cut(2)
        at = cluster.released()
        cluster.wait_released(at + 3, timeout=60)
        lab.heal(2)
        codes = cluster.wait(timeout=90)
    assert codes == dict.fromkeys(range(6), 0), {r: cluster.log_tail(r) for r, c in codes.items() if c != 0}
    summary = cluster.summary()
    assert summary["status"] == "finished" and summary["members"] == list(range(6))
    events = summary["events"]
    dropped = next(e for e in events if e["dropped"])
    joined = [e for e in events if e.get("joined")]
    assert set(dropped["dropped"]) == {4, 5} and joined, events
    assert {r for e in joined for r in e["joined"]} == {4, 5} and joined[0]["round"] > dropped["round"], events
    assert all(set(e["stragglers"]) <= {4, 5} for e in events), events


def test_shaped_host_is_slower_and_changes_nothing_else(netns: None, tmp_path: Path, kit: Any) -> None:
    """Host 1 sends at 8 Mbit/s (tbf): its uploads queue behind the shaper, the run completes, the models equal
    simulate's. How much slower its rounds are is a figure of tests/netns/measure.py, not an assertion."""
    run = dict(PROTOCOL, nodes=4, rounds=6)
    network = dict(request_timeout=10, retries=2, round_deadline=60)
    with Lab(hosts=2) as lab:
        lab.shape(1, "8mbit")
        cluster = NetnsCluster(lab, tmp_path, kit.flags({**run, **network}), per_host=2).start()
        codes = cluster.wait(timeout=120)
        shaped = lab.shaped(1)
    assert codes == dict.fromkeys(range(4), 0), {r: cluster.log_tail(r) for r, c in codes.items() if c != 0}
    # everything host 1 sent went through the shaper, and it held packets back
    assert shaped["bytes"] > 2 * run["rounds"] * 128 * 1024 and shaped["overlimits"] > 0, shaped
    assert set(node_columns(cluster, "fragments_unsent")) == {0.0}
    assert cluster.summary()["model_sha256"] == simulate_hashes(tmp_path, kit, run)
