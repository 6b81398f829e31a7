"""Large bodies at a node of a loopback cluster: does the node stay responsive and within its memory?

It starts a `mosaicd` `Cluster` without a secret (--insecure: the node decodes what it is sent; with a secret the
signature check refuses a stranger's body first) running protocol-only rounds, waits for --warmup rounds, then
posts --bodies CBOR bodies of --mib MiB each to node 0's POST /v1/fragments at once (one thread and connection
each). Each body is the shape that used to hold the loop: a CBOR array header that declares one item per byte,
then that many zero bytes (cbor2 built a list of ~200 million items from one 190 MiB body); `--shape frags`
puts the same array as the `frags` of a message whose other fields are this run's.

Meanwhile a prober GETs node 0's /healthz (a new connection each time, every --probe-every seconds) and a
sampler reads node 0's resident memory from /proc every 20 ms. It prints:

- /healthz worst latency while the bodies were in flight (until the last answer, plus --settle seconds), probes;
- node 0's peak RSS (sampled, and the kernel's VmHWM), its RSS before, and the peak's ratio to the bodies' bytes
  (and the growth's, peak less before: with a large --dim the node's own models weigh in);
- each body's answer (status, reason) and the rounds the barrier released per second during the posting window.

Usage: flock /tmp/bench.lock .venv/bin/python bench/bodies.py [--bodies 4] [--mib 190] [--shape array|frags]
           [--dim 100000] [--nodes 4] [--fragments 4] [--round-deadline 10]
The last line of stdout is one JSON object with these figures.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import cbor2

from mosaicd.experiments.cluster import Cluster
from mosaicd.settings import Settings


def junk_body(size: int, shape: str, status: dict[str, Any]) -> bytes:
    """`size` bytes of CBOR: an array of one zero per byte, bare or as the frags of a message of this run."""
    if shape == "array":
        return b"\x9b" + (size - 9).to_bytes(8, "big") + bytes(size - 9)
    header = {"v": 1, "run": status["run_id"], "round": status["round"], "sender": 1, "k": status["fragments"],
              "fp": bytes(8), "dtype": "<f4"}
    head = cbor2.dumps(header)[1:]
    prefix = bytes([0xA8]) + head + cbor2.dumps("frags")
    n = size - len(prefix) - 9
    return prefix + b"\x9b" + n.to_bytes(8, "big") + bytes(n)


def post(port: int, body: bytes, into: list[Any]) -> None:
    """POST one body on a raw socket; appends (status, reason, seconds)."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(b"POST /v1/fragments HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/cbor\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
            try:
                sock.sendall(body)
            except OSError:  # answered and closed before the whole body went out
                pass
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head else 0
        reason = json.loads(payload).get("reason") if payload.startswith(b"{") else None
    except OSError as exc:
        status, reason = 0, type(exc).__name__
    into.append((status, reason, round(time.monotonic() - started, 3)))


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def barrier_round(cluster: Cluster) -> int:
    """The barrier's round (its status, asked again while a loaded barrier does not answer in time)."""
    for _ in range(30):
        status = cluster.status(cluster.barrier_port) if cluster.barrier_port else None
        if status:
            return int(status.get("round", 0))
        time.sleep(0.2)
    raise SystemExit("the barrier does not answer")


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    settings = Settings(nodes=args.nodes, rounds=100_000, fragments=args.fragments, fanout=min(2, args.nodes - 1),
                        dim=args.dim, eval_every=0, train=False, round_deadline=args.round_deadline, insecure=True,
                        out=out)
    cluster = Cluster(settings, progress=False)
    cluster.fail_fast = False
    runner = threading.Thread(target=lambda: _run_quietly(cluster), daemon=True)
    runner.start()
    done = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while not (cluster.barrier_port and (cluster.status(cluster.barrier_port) or {}).get("round", 0)
                   >= args.warmup):
            if time.monotonic() > deadline:
                raise SystemExit("the cluster did not reach the warm-up rounds")
            time.sleep(0.2)
        port, pid = cluster.node_ports[0], cluster.procs["node-0"].pid
        node = get_json(f"http://127.0.0.1:{port}/v1/status")
        bodies = [junk_body(args.mib << 20, args.shape, node) for _ in range(args.bodies)]
        total = sum(len(b) for b in bodies)
        before = rss_kib(pid)["VmRSS"]
        latencies, samples = [], []

        def probe() -> None:
            while not done.is_set():
                t = time.monotonic()
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=60).read()
                except OSError:
                    pass
                latencies.append(time.monotonic() - t)
                time.sleep(args.probe_every)

        def sample() -> None:
            while not done.is_set():
                samples.append(rss_kib(pid)["VmRSS"])
                time.sleep(0.02)

        helpers = [threading.Thread(target=probe, daemon=True), threading.Thread(target=sample, daemon=True)]
        for h in helpers:
            h.start()
        answers: list[Any] = []
        round0, t0 = barrier_round(cluster), time.monotonic()
        posts = [threading.Thread(target=post, args=(port, body, answers)) for body in bodies]
        for p in posts:
            p.start()
        for p in posts:
            p.join()
        time.sleep(args.settle)
        round1, t1 = barrier_round(cluster), time.monotonic()
        done.set()
        for h in helpers:
            h.join()
        hwm = rss_kib(pid)["VmHWM"]
    finally:
        done.set()  # the helpers stop, whatever went wrong
        cluster.stop()
        runner.join(timeout=30)
    peak = max(samples) * 1024
    return {"bodies": args.bodies, "body_mib": args.mib, "shape": args.shape, "bodies_bytes": total,
            "healthz_worst_s": round(max(latencies), 3), "healthz_probes": len(latencies),
            "rss_before_mib": round(before / 1024, 1), "rss_peak_mib": round(peak / 2**20, 1),
            "vm_hwm_mib": round(hwm / 1024, 1), "peak_over_bodies": round(peak / total, 3) if total else None,
            "growth_over_bodies": round((peak - before * 1024) / total, 3) if total else None,
            "answers": sorted(answers), "rounds_per_s": round((round1 - round0) / (t1 - t0), 2)}


def _run_quietly(cluster: Cluster) -> None:
    try:
        cluster.run(timeout=3600)
    except BaseException:  # stopped by the bench: the run "fails", as intended
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=4, help="0: the same window without bodies (a control)")
    parser.add_argument("--mib", type=int, default=190)
    parser.add_argument("--shape", choices=("array", "frags"), default="array")
    parser.add_argument("--dim", type=int, default=100_000, help="the run's model size (floats): with 50000000 and "
                        "more, 190 MiB is not too large for a message of the run, and its CBOR heads refuse it")
    parser.add_argument("--nodes", type=int, default=4, help="members (fanout 2, or 1 with two)")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--round-deadline", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=3, help="rounds released before the bodies are posted")
    parser.add_argument("--probe-every", type=float, default=0.05)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds measured after the last answer")
    parser.add_argument("--keep", type=Path, help="keep the run's folder here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        row = measure(args, args.keep or Path(tmp) / "run")
    print(f"{row['bodies']} x {row['body_mib']} MiB ({row['shape']}): /healthz worst {row['healthz_worst_s']:.3f} s "
          f"over {row['healthz_probes']} probes; node RSS {row['rss_before_mib']} MiB before, peak "
          f"{row['rss_peak_mib']} MiB (VmHWM {row['vm_hwm_mib']} MiB) = {row['peak_over_bodies']} x the bodies' "
          f"{row['bodies_bytes'] / 2**20:.0f} MiB (growth {row['growth_over_bodies']} x); "
          f"{row['rounds_per_s']} rounds/s; answers {row['answers']}",
          file=sys.stderr)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
