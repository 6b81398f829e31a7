"""How long a node takes to exit once told to stop (SIGTERM), whatever it was doing.

    .venv/bin/python bench/stop_exit.py --trials 8

Each trial starts a peer list of `--nodes` digits nodes on loopback (`mosaicd node --peer-list`, --insecure),
lets it run a random 12-16 s (registration, then rounds with long local training, so that the signal often lands
in the middle of a round's training), sends SIGTERM to one member that is not rank 0 and times its exit from the
outside; then stops the others. The issue's aim is 2 s (Docker kills a container 10 s after SIGTERM). Prints one
line per trial with the load, then the median and the largest; the last line of stdout is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = sorted(s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    return ports


def trial(folder: Path, nodes: int, local_steps: int, rng: random.Random) -> tuple[float, int]:
    ports = free_ports(nodes)
    peers = folder / "peers.txt"
    peers.write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    procs = []
    for port in ports:
        with open(folder / f"node-{port}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "mosaicd", "node", "--peer-list", str(peers), "--port", str(port), "--host",
                 "127.0.0.1", "--out", str(folder / f"out-{port}"), "--insecure", "--task", "digits", "--rounds",
                 "1000", "--fragments", "2", "--fanout", "2", "--eval-every", "0", "--local-steps", str(local_steps)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    try:
        time.sleep(12 + 4 * rng.random())
        victim = procs[nodes // 2]
        if victim.poll() is not None:
            raise SystemExit(f"stop_exit: the node on port {ports[nodes // 2]} ended before it was told to stop; "
                             f"see {folder}")
        told = time.monotonic()
        victim.send_signal(signal.SIGTERM)
        try:
            victim.wait(30)
        except subprocess.TimeoutExpired:
            victim.kill()
            victim.wait()
        return time.monotonic() - told, victim.returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=20, help="H: longer rounds of training")
    parser.add_argument("--seed", type=int, default=0, help="when in the run each signal lands")
    args = parser.parse_args()
    if args.trials < 1 or args.nodes < 3:
        parser.error("--trials >= 1 and --nodes >= 3")
    rng = random.Random(args.seed)
    seconds, loads = [], []
    with tempfile.TemporaryDirectory(prefix="mosaic-stop-exit-") as tmp:
        for i in range(args.trials):
            folder = Path(tmp) / f"trial-{i}"
            folder.mkdir()
            took, code = trial(folder, args.nodes, args.local_steps, rng)
            seconds.append(took)
            loads.append(os.getloadavg()[0])
            print(f"trial {i}: exited {took:.2f} s after SIGTERM, code {code}, load {loads[-1]:.1f}", flush=True)
    figures = {"trials": args.trials, "median_s": round(statistics.median(seconds), 2),
               "max_s": round(max(seconds), 2), "within_2s": sum(s <= 2.0 for s in seconds),
               "load_min": round(min(loads), 1), "load_max": round(max(loads), 1),
               "seconds": [round(s, 2) for s in seconds]}
    print(f"exit after SIGTERM: median {figures['median_s']} s, largest {figures['max_s']} s, "
          f"{figures['within_2s']}/{args.trials} within 2 s (load {figures['load_min']}-{figures['load_max']})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
