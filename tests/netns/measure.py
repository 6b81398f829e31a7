"""The figures of docs/networks.md: round times of a peer-list cluster on namespace hosts over links that delay,
lose, shape and partition, against the same cluster on clean links measured in the same run.

    sudo .venv/bin/python tests/netns/measure.py [--rounds 20]

Three hosts with two nodes each (6 nodes), protocol-only rounds of a 64 KiB model (dim 16384, K=4, s=2: every
node sends 128 KiB a round). Per scenario: the round time (node 0's round log lines, after round 0), each send
phase and barrier wait (nodes.csv), packets the loss rule dropped; for the partition: the rounds and seconds from
the cut to the drop. Prints one line per scenario, then a JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import Lab, NetnsCluster, missing

RUN = dict(nodes=6, fragments=4, fanout=2, dim=16384, train=False, eval_every=0, seed=5)
PATIENT = dict(request_timeout=10, retries=2, round_deadline=60)
SCENARIOS: dict[str, dict[str, Any]] = {
    "clean": dict(delay=0.0),
    "delay 50ms": dict(delay=0.05),
    "delay 50ms + loss 1%": dict(delay=0.05, loss=0.01),
    "loss 1%": dict(delay=0.0, loss=0.01),
    "tbf 8mbit on host 1": dict(delay=0.0, shape="8mbit"),
}


def flags(values: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in values.items():
        name = key.replace("_", "-")
        out += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) else [f"--{name}", str(value)]
    return out


def round_times(log: Path) -> list[float]:
    """Seconds between node 0's consecutive "round" log lines."""
    stamps = [datetime.fromisoformat(x["timestamp"].replace("Z", "+00:00")).timestamp()
              for x in (json.loads(line) for line in log.read_text().splitlines() if line.startswith("{"))
              if x.get("event") == "round"]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 3), "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 3),
            "max": round(ordered[-1], 3)}


def scenario(tmp: Path, rounds: int, delay: float, loss: float = 0.0, shape: str | None = None) -> dict[str, Any]:
    with Lab(hosts=3) as lab:
        for host in range(3):
            if loss:
                lab.loss(host, loss)
        if shape:
            lab.shape(1, shape)
        cluster = NetnsCluster(lab, tmp, flags({**RUN, **PATIENT, "rounds": rounds}), delay=delay).start()
        codes = cluster.wait(timeout=300)
        lost = sum(lab.lost(h) for h in range(3)) if loss else 0
    if set(codes.values()) != {0}:
        raise SystemExit(f"a node failed: {codes}: {cluster.log_tail(0)}")
    rows = cluster.rows()
    sends = [float(r["send_s"]) for r in rows]
    shaped = [float(r["send_s"]) for r in rows if cluster.host_of(int(r["node"])) == 1]
    result = {"round_s": stats(round_times(tmp / "node-0.log")), "send_s": stats(sends),
              "wait_s": stats([float(r["wait_s"]) for r in rows]), "lost_packets": lost,
              "unsent": sum(int(r["fragments_unsent"]) for r in rows)}
    if shape:
        result["send_s_shaped_host"] = stats(shaped)
    return result


def partition(tmp: Path, rounds: int) -> dict[str, Any]:
    """Host 2 cut at round 3 for 3 released rounds (request timeout 1 s, no retry, deadline 3 s, drop after 2)."""
    network = dict(request_timeout=1, retries=0, round_deadline=3, drop_after=2, barrier_grace=30)
    with Lab(hosts=3) as lab:  # rank 0 serves 20 s after the run: the cut nodes hear they were dropped
        cluster = NetnsCluster(lab, tmp, flags({**RUN, **network, "rounds": rounds}), delay=0.01,
                               extra={0: ["--linger", "20"]}).start()
        cluster.wait_released(2, timeout=120)
        lab.cut(2)
        cut_at, cut_round = time.monotonic(), cluster.released()
        cluster.wait_released(cut_round + 3, timeout=120)
        lab.heal(2)
        healed_at = time.monotonic()
        codes = cluster.wait(timeout=120)
    events = cluster.summary()["events"]
    drop = next(e for e in events if e["dropped"])
    times = round_times(tmp / "node-0.log")
    return {"cut_after_round": cut_round, "events": [(e["round"], e["stragglers"], e["dropped"]) for e in events],
            "rounds_to_drop": drop["round"] - cut_round, "cut_s": round(healed_at - cut_at, 2),
            "round_s_while_cut": [round(t, 2) for t in times[cut_round:drop["round"] + 1]],
            "round_s_after": stats(times[drop["round"] + 1:]), "exit_codes": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    why = missing()
    if why:
        raise SystemExit(f"measure.py: {why}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mosaic-netns-") as tmp:
        for number, (name, spec) in enumerate(SCENARIOS.items()):
            where = Path(tmp) / f"s{number}"
            where.mkdir()
            results[name] = scenario(where, args.rounds, **spec)
            print(f"{name:24s} {json.dumps(results[name])}", flush=True)
        (Path(tmp) / "partition").mkdir()
        results["partition"] = partition(Path(tmp) / "partition", max(args.rounds, 20))
        print(f"{'partition':24s} {json.dumps(results['partition'])}", flush=True)
    clean = results["clean"]["round_s"]["median"]
    results["ratio_vs_clean"] = {name: round(results[name]["round_s"]["median"] / clean, 2) for name in SCENARIOS}
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
