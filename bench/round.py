"""Protocol-only gossip rounds through the real cluster (processes + HTTP on loopback) vs a plain socket.

For every configuration (n nodes, K fragments, fanout s, quadratic task with d coordinates, training off,
evaluation only at the end) it runs `mosaicd`'s `Cluster` (one barrier and n node processes on 127.0.0.1)
for --rounds rounds and reports, over the rounds after the --warmup first ones (4: the bound below is measured
warm, and a node's first three checkpoints each create one of its three slot files, `daemon/node/checkpoint.py`,
which later rounds rewrite in place; those first rounds are reported apart, `warmup_seconds_per_round`):

- seconds per round: the mean interval between the barrier's successive round releases (from the barrier's
  log timestamps); the last release of a run (the final model collection) is never counted;
- bytes sent per node per round (nodes.csv bytes_out) against s * d * 4; every row must be within 1%
  (the spec: fragmentation changes who gets what, not how much), else the row is flagged;
- CPU seconds per round: user + system time of every cluster process (sampled from /proc every 0.1 s, taken
  at the same releases): on a shared machine, steadier than seconds per round;
- where a node's round time goes: mean send_s, wait_s and aggregate_s per node and round (nodes.csv);
- the 1-minute load average just before the run (rounds are CPU-bound: other load on the machine slows them);
- the time to move the same bytes (n * s * d * 4 per round) through one plain TCP socket pair on 127.0.0.1
  (sendall of d*4-byte buffers, a reader thread with recv_into; best of --socket-repeats, measured once per
  byte count) and the slowdown of a cluster round against it;
- the bound of the computation itself: the socket's seconds plus the same round's gossip computed in this
  process by `InMemoryNetwork` (plans and fragment-wise averaging of the same n, K, s, d: what `simulate` does,
  no bytes moved; `exchange.py`'s `per_round`) spread over the machine's cores, and the cluster against it;
- the same bound in CPU seconds (`bound_cpu_s`: the socket transfer's CPU seconds, both ends, plus the in-memory
  round's) and the cluster's CPU seconds per round against it (`cpu_vs_bound`): on a machine shared with other
  work, where wall seconds swing with the load, the figure that still says what the cluster adds.

Security modes (what authentication and encryption cost): `--secret-file PATH` signs every request with the
cluster secret (HMAC, `--secret-file` of mosaicd); `--tls` adds mutual TLS with certificates trustme makes for
the run (a CA and one certificate for 127.0.0.1; `pip install trustme`, in the test extra); `--compare` runs
every configuration in the three modes, plain, secret and secret+TLS, --repeats times in turn (plain, secret,
secret+TLS, plain, ...: load that comes and goes hits every mode alike), and prints each mode's median seconds
per round and its ratio to plain's median (the secret: --secret-file, else 32 random bytes), and the least
secret+TLS / plain can come to by CPU: plain's CPU seconds, the secret's extra, and the CPU seconds of encrypting
and decrypting the round's bytes through Python's ssl alone (`cipher_cpu_seconds`: two `SSLObject`s over memory
BIOs with the run's certificates, as asyncio's and uvloop's TLS transports use them), over plain's.

Event loops (`--event-loop uvloop,asyncio`): every run is made once per loop named, in turn with the modes and
repeats, and a table gives each (n, K, mode)'s median seconds and CPU seconds per round on each loop and their
ratio to the last loop named (uvloop / asyncio: below 1, uvloop is faster).

s is capped at n - 1 (a node has n - 1 possible receivers; the settings refuse s >= n).

Usage: .venv/bin/python bench/round.py [--nodes 8,16,32] [--fragments 1,16] [--fanout 8] [--dim 1000000]
                                       [--rounds 9] [--warmup 4] [--keep DIR]
                                       [--secret-file PATH] [--tls] [--compare [--repeats 3]]
                                       [--event-loop auto|uvloop|asyncio[,...]]
The last line of stdout is a JSON list with one row per configuration.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from exchange import per_round
from procstat import cpu_seconds, stat_fields

from mosaicd.experiments.cluster import Cluster
from mosaicd.settings import EventLoop, Settings

BYTES_TOLERANCE = 0.01
TARGET_VS_BOUND = 1.5  # issue #38 "Speed 4": a protocol round within 1.5x of its bound
TARGET_VS_BOUND_REAL_SIZE = 1.3  # issue 59 "Speed 5": a real-size model's round within 1.3x of its bound
REAL_SIZE_DIM = 11_000_000  # ... ResNet-18's values, the --dim that target is for
TARGET_TLS = 1.4  # and secret + mutual TLS within 1.4x of plain
MODES = ("plain", "secret", "secret+tls")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _loops(text: str) -> list[str]:
    loops = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in loops if x not in EventLoop._value2member_map_]
    if bad or not loops:
        raise argparse.ArgumentTypeError(f"expected {', '.join(EventLoop)} (comma-separated), got {text!r}")
    return loops


# -- the reference: a plain loopback socket pair -------------------------------------------------------------
def socket_seconds(total: int, chunk: int, repeats: int) -> tuple[float, float]:
    """Best time to push `total` bytes (as sendall()s of `chunk`-byte buffers) through TCP on 127.0.0.1, and the
    least CPU seconds it took (this process: the sending and the reading thread, the kernel's copies included)."""
    payload = os.urandom(chunk)
    best = best_cpu = float("inf")
    for _ in range(repeats):
        with socket.create_server(("127.0.0.1", 0)) as server:
            sender = socket.create_connection(server.getsockname())
            receiver, _ = server.accept()
        got = [0]

        def read(sock: socket.socket = receiver, got: list[int] = got) -> None:
            buf = memoryview(bytearray(chunk))
            while got[0] < total:
                n = sock.recv_into(buf)
                if not n:
                    break
                got[0] += n

        reader = threading.Thread(target=read)
        started, cpu_started = time.perf_counter(), time.process_time()
        reader.start()
        sent = 0
        while sent < total:
            piece = payload if total - sent >= chunk else payload[:total - sent]
            sender.sendall(piece)
            sent += len(piece)
        reader.join()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        sender.close()
        receiver.close()
        assert got[0] == total, (got[0], total)
        best, best_cpu = min(best, elapsed), min(best_cpu, cpu)
    return best, best_cpu


def compute_cpu(d: int, k: int, s: int, n: int) -> tuple[float, float]:
    """The in-memory round (`exchange.py`'s `per_round`), best of 2: (seconds, CPU seconds) per round. It runs on one
    thread, so its CPU seconds are its seconds on an idle core, whatever else the machine is doing."""
    seconds, cpu = [], []
    for _ in range(2):
        seconds.append(per_round(d, k, s, n, 3, False, cpu)[0])
    return min(seconds), min(cpu)


# -- CPU seconds of the cluster's processes, sampled while it runs ------------------------------------------


def _descendants_cpu(root: int, seen: dict[int, float]) -> float:
    """user + system seconds of every live descendant of `root` (kept per pid in `seen`, so that a process
    that has exited still counts with its last sample); Linux /proc only (0 elsewhere)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        fields = stat_fields(f"/proc/{entry}/stat")
        if fields is None:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = cpu_seconds(fields)
    for pid in cpu:
        p = parents.get(pid)
        while p is not None and p != root and p > 1:
            p = parents.get(p)
        if p == root:
            seen[pid] = cpu[pid]
    return sum(seen.values())


class CpuSampler:
    """Every `every` seconds, (wall time, CPU seconds of all descendants of this process so far)."""

    def __init__(self, every: float = 0.1) -> None:
        self.every, self.samples, self._seen = every, [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), _descendants_cpu(os.getpid(), self._seen)))
            self._stop.wait(self.every)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, when: float) -> float:
        """CPU seconds at wall time `when` (linear between the samples around it)."""
        before = [s for s in self.samples if s[0] <= when]
        after = [s for s in self.samples if s[0] >= when]
        if not before or not after:
            return float("nan")
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)


# -- one cluster configuration ----------------------------------------------------------------------------
def release_times(barrier_log: Path) -> dict[int, float]:
    """round -> wall time (s) of the barrier's release of that round, from its JSON log lines."""
    times: dict[int, float] = {}
    for line in barrier_log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "released" and not entry.get("finished"):
            ts = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
            times[int(entry["round"])] = ts
    return times


# -- security: the cluster secret and mutual TLS --------------------------------------------------------------
def make_secret(folder: Path) -> Path:
    path = folder / "secret"
    path.write_bytes(os.urandom(32))
    return path


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA and one certificate for 127.0.0.1 (every process shows it), made by trustme: the --tls-* settings."""
    try:
        import trustme
    except ImportError:
        sys.exit("bench/round.py: --tls and --compare need trustme (pip install trustme; it is in the test extra)")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"tls_ca": folder / "ca.pem", "tls_cert": folder / "member.pem", "tls_key": folder / "member.key"}
    ca.cert_pem.write_to_path(str(paths["tls_ca"]))
    cert.private_key_pem.write_to_path(str(paths["tls_key"]))
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(paths["tls_cert"]), append=i > 0)
    return paths


def cipher_cpu_seconds(total: int, chunk: int, certs: dict[str, Path]) -> float:
    """CPU seconds to encrypt and decrypt `total` bytes through TLS as the cluster's HTTPS does (Python's ssl:
    an `SSLObject` over memory BIOs on each side, as asyncio's and uvloop's transports use it, the run's
    certificates, mutual, the cipher the two agree on), best of 3: the least TLS can add to a round, whatever HTTP
    does above it."""
    import ssl

    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs["tls_ca"]))
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs["tls_ca"]))
    for context in (server, client):
        context.load_cert_chain(str(certs["tls_cert"]), str(certs["tls_key"]))
    server.verify_mode = ssl.CERT_REQUIRED
    payload, best = os.urandom(chunk), float("inf")
    for _ in range(3):
        bios = [ssl.MemoryBIO() for _ in range(4)]  # client -> server, server -> client
        ends = (client.wrap_bio(bios[1], bios[0], server_hostname="127.0.0.1"),
                server.wrap_bio(bios[0], bios[1], server_side=True))
        for _ in range(6):  # the handshake, each side in turn until both are done
            for end in ends:
                try:
                    end.do_handshake()
                except ssl.SSLWantReadError:
                    pass
        started, moved = time.process_time(), 0
        while moved < total:
            piece = payload if total - moved >= chunk else payload[:total - moved]
            ends[0].write(piece)  # encrypted into the client's outgoing BIO, record by record
            got = 0
            while got < len(piece):  # decrypted out of the server's incoming BIO, a record at a time
                got += len(ends[1].read(len(piece) - got))
            moved += len(piece)
        best = min(best, time.process_time() - started)
    return best


def security(mode: str, secret: Path | None, certs: dict[str, Path] | None) -> dict:
    """The settings of one mode: plain, secret, tls or secret+tls."""
    extra: dict = {}
    if "secret" in mode:
        extra["secret_file"] = secret
    else:  # else the cluster makes a secret of its own (secure by default) and "plain" would be signed too
        extra["insecure"] = True
    if "tls" in mode:
        assert certs is not None
        extra.update(certs, tls_client_auth=True)
    return extra


def run_config(n: int, k: int, s: int, d: int, rounds: int, warmup: int, out: Path, mode: str = "plain",
               event_loop: str = "auto", **extra: object) -> dict:
    settings = Settings.load(
        run_id=f"bench-round-n{n}-k{k}", nodes=n, rounds=rounds, fragments=k, fanout=s, dim=d, task="quadratic",
        train=False, eval_every=0, round_deadline=900.0, request_timeout=300.0, register_deadline=300.0,
        out=out, log_level="info", event_loop=event_loop, **extra)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with CpuSampler() as cpu:
        Cluster(settings, progress=False).run(timeout=1800)
    wall = time.perf_counter() - started

    releases = release_times(out / "logs" / "barrier.log")
    measured = [r for r in range(max(warmup, 1), rounds) if r in releases and r - 1 in releases]
    intervals = [releases[r] - releases[r - 1] for r in measured]
    warming = [releases[r] - releases[r - 1] for r in range(1, max(warmup, 1)) if r in releases and r - 1 in releases]
    cpu_per_round = (cpu.at(releases[measured[-1]]) - cpu.at(releases[measured[0] - 1])) / len(measured)

    with open(out / "nodes.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["round"]) >= warmup]
    expected = s * d * 4
    per_row = [int(r["bytes_out"]) for r in rows]
    bad = [(r["round"], r["node"], r["bytes_out"]) for r in rows
           if abs(int(r["bytes_out"]) / expected - 1) > BYTES_TOLERANCE]

    def mean(col: str) -> float:
        return statistics.fmean(float(r[col]) for r in rows)

    node_round = statistics.fmean(sum(float(r[c]) for c in ("train_s", "send_s", "wait_s", "aggregate_s"))
                                  for r in rows)
    bytes_node = statistics.fmean(per_row)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "n": n, "d": d, "K": k, "s": s, "mode": mode, "event_loop": event_loop,
        "rounds_measured": len(intervals),
        "seconds_per_round": statistics.fmean(intervals),
        "seconds_per_round_max": max(intervals),
        "warmup_seconds_per_round": statistics.fmean(warming) if warming else None,
        "cpu_s_per_round": cpu_per_round,
        "node_round_s": node_round,
        "bytes_per_node_round": bytes_node,
        "expected_bytes": expected,
        "bytes_ratio": bytes_node / expected,
        "bytes_rows_off": len(bad),
        "messages_per_node_round": mean("messages_out"),
        "send_s": mean("send_s"), "wait_s": mean("wait_s"), "aggregate_s": mean("aggregate_s"),
        "cluster_wall_s": wall,
        "load1": load_before,
        "models_sha256": summary.get("models_sha256"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=_ints, default=[8, 16, 32], help="comma-separated n values")
    parser.add_argument("--fragments", type=_ints, default=[1, 16], help="comma-separated K values")
    parser.add_argument("--fanout", type=int, default=8, help="s (capped at n - 1)")
    parser.add_argument("--dim", type=int, default=1_000_000, help="d of the quadratic task")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per run (the first --warmup not counted)")
    parser.add_argument("--warmup", type=int, default=4, help="rounds not counted: round 0, and the rounds whose "
                        "checkpoints create the nodes' slot files (reported apart)")
    parser.add_argument("--socket-repeats", type=int, default=5, help="socket transfers timed (best counts)")
    parser.add_argument("--keep", type=Path, help="keep every run's outputs under this directory")
    parser.add_argument("--secret-file", type=Path, help="sign every request with this cluster secret")
    parser.add_argument("--tls", action="store_true", help="mutual TLS between all processes (trustme certificates)")
    parser.add_argument("--compare", action="store_true", help="run each configuration plain, with a secret, and "
                        "with a secret and mutual TLS; print the ratios to plain")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, in turn (the median counts)")
    parser.add_argument("--event-loop", type=_loops, default=["auto"], metavar="LOOP[,LOOP]",
                        help="the cluster's --event-loop; several (uvloop,asyncio): each run on each, in turn, and "
                        "their ratios")
    args = parser.parse_args()
    if args.rounds <= max(args.warmup, 1):
        parser.error("--rounds must be more than --warmup (and at least 2)")
    if args.secret_file is not None and not args.secret_file.is_file():
        parser.error(f"--secret-file {args.secret_file}: no such file")
    if args.compare:
        modes: tuple[str, ...] = MODES
    else:
        modes = ("+".join(m for m, on in (("secret", args.secret_file), ("tls", args.tls)) if on) or "plain",)

    loops = args.event_loop
    print(f"bench/round.py: python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}; "
          f"d={args.dim}, rounds={args.rounds} (first {args.warmup} not counted), training off, eval at the end only; "
          f"modes: {', '.join(modes)}; event loops: {', '.join(loops)}", flush=True)
    root = args.keep or Path(tempfile.mkdtemp(prefix="mosaic-bench-round-"))
    root.mkdir(parents=True, exist_ok=True)
    secret = args.secret_file or (make_secret(root) if any("secret" in m for m in modes) else None)
    certs = make_certs(root) if any("tls" in m for m in modes) else None
    rows = []
    sockets: dict[int, tuple[float, float]] = {}  # total bytes -> (seconds, CPU seconds), measured once per n
    ciphers: dict[int, float] = {}  # total bytes -> CPU seconds of TLS's encryption and decryption of them
    computes: dict[tuple[int, int], tuple[float, float]] = {}  # (n, K) -> the in-memory round: seconds, CPU-s
    try:
        for n in args.nodes:
            s = min(args.fanout, n - 1)
            for k in args.fragments:
                for rep, mode, loop in ((rep, mode, loop) for rep in range(args.repeats) for mode in modes
                                        for loop in loops):
                    row = run_config(n, k, s, args.dim, args.rounds, args.warmup,
                                     root / f"n{n}-k{k}-{mode.replace('+', '-')}-{loop}-{rep}", mode, loop,
                                     **security(mode, secret, certs))
                    total = n * s * args.dim * 4
                    if total not in sockets:
                        sockets[total] = socket_seconds(total, args.dim * 4, args.socket_repeats)
                    row["socket_seconds"], row["socket_cpu_s"] = sockets[total]
                    row["slowdown_vs_socket"] = row["seconds_per_round"] / row["socket_seconds"]
                    if "tls" in mode and total not in ciphers:
                        assert certs is not None
                        ciphers[total] = cipher_cpu_seconds(total, args.dim * 4, certs)
                    row["tls_cipher_cpu_s"] = ciphers.get(total)
                    if (n, k) not in computes:
                        computes[n, k] = compute_cpu(args.dim, k, s, n)
                    row["compute_seconds"], row["compute_cpu_s"] = computes[n, k]
                    row["bound_seconds"] = row["socket_seconds"] + row["compute_seconds"] / (os.cpu_count() or 1)
                    row["vs_bound"] = row["seconds_per_round"] / row["bound_seconds"]
                    row["bound_cpu_s"] = row["socket_cpu_s"] + row["compute_cpu_s"]
                    row["cpu_vs_bound"] = row["cpu_s_per_round"] / row["bound_cpu_s"]
                    rows.append(row)
                    flag = "" if row["bytes_rows_off"] == 0 else f"  !! {row['bytes_rows_off']} rows off by >1%"
                    note = f"  (s capped at n-1={s})" if s != args.fanout else ""
                    warm = row["warmup_seconds_per_round"]
                    warm_note = f" (rounds 1-{args.warmup - 1}: {warm:.3f})" if warm is not None else ""
                    print(f"  done n={n:>3} K={k:>3} s={s} {mode} {loop}: {row['seconds_per_round']:.3f} s/round"
                          f"{warm_note}, "
                          f"{row['cpu_s_per_round']:.3f} CPU-s/round, cluster "
                          f"wall {row['cluster_wall_s']:.0f} s, load before {row['load1']:.1f}, models_sha256 "
                          f"{str(row['models_sha256'])[:12]}{note}{flag}",
                          flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)

    print()
    head = (f"{'n':>3} {'K':>3} {'s':>2} {'mode':>10} {'loop':>7} {'s/round':>8} {'max':>7} {'MB/node/rnd':>11} "
            f"{'ratio':>8} "
            f"{'msgs':>5} {'send_s':>7} {'wait_s':>7} {'aggr_s':>7} {'socket_s':>8} {'slowdown':>8} {'MB/s':>6} "
            f"{'compute_s':>9} {'bound_s':>7} {'vs_bound':>8} {'load':>5}")
    print(head)
    for r in rows:
        mbps = r["n"] * r["bytes_per_node_round"] / r["seconds_per_round"] / 1e6
        print(f"{r['n']:>3} {r['K']:>3} {r['s']:>2} {r['mode']:>10} {r['event_loop']:>7} "
              f"{r['seconds_per_round']:>8.3f} "
              f"{r['seconds_per_round_max']:>7.3f} "
              f"{r['bytes_per_node_round'] / 1e6:>11.3f} {r['bytes_ratio']:>8.5f} {r['messages_per_node_round']:>5.1f} "
              f"{r['send_s']:>7.3f} {r['wait_s']:>7.3f} {r['aggregate_s']:>7.3f} {r['socket_seconds']:>8.3f} "
              f"{r['slowdown_vs_socket']:>8.1f} {mbps:>6.0f} {r['compute_seconds']:>9.3f} {r['bound_seconds']:>7.3f} "
              f"{r['vs_bound']:>8.2f} {r['load1']:>5.1f}")
    for r in rows:
        print(f"n={r['n']} K={r['K']} {r['mode']} {r['event_loop']}: CPU seconds / the bound's "
              f"{r['cpu_s_per_round']:.3f} / {r['bound_cpu_s']:.3f} = {r['cpu_vs_bound']:.2f}x (socket "
              f"{r['socket_cpu_s']:.3f} + compute {r['compute_cpu_s']:.3f} CPU-s)")
        print(f"n={r['n']} K={r['K']} {r['mode']} {r['event_loop']}: round / its bound {r['vs_bound']:.2f}x, target "
              f"<= {TARGET_VS_BOUND}x (issue #38): {'met' if r['vs_bound'] <= TARGET_VS_BOUND else 'not met'}")
    off = [r for r in rows if r["bytes_rows_off"] or abs(r["bytes_ratio"] - 1) > BYTES_TOLERANCE]
    print("bytes check: every node-round within 1% of s*d*4" if not off else
          f"bytes check FAILED for {sorted({(r['n'], r['K']) for r in off})}")
    print("max: slowest measured round; MB/s: all nodes' bytes_out per second of round; socket_s: the same bytes "
          "through one TCP pair; compute_s: the same round's plans and averaging in one process (InMemoryNetwork, "
          "one core); "
          "bound_s: socket_s + compute_s / cores, the cost of the computation itself; load: 1-min load average "
          "before the run")
    runs: dict[tuple[int, int, str, str], list[dict]] = {}
    for r in rows:
        runs.setdefault((r["n"], r["K"], r["mode"], r["event_loop"]), []).append(r)
    median = {key: statistics.median(r["seconds_per_round"] for r in group) for key, group in runs.items()}
    cpu_median = {key: statistics.median(r["cpu_s_per_round"] for r in group) for key, group in runs.items()}
    bound_median = {key: statistics.median(r["vs_bound"] for r in group) for key, group in runs.items()}
    for (n, k, mode, loop), group in runs.items():
        if len(group) > 1:  # one run's bound moves with its compute_s: the median of the repeats is the figure
            each = ", ".join(f"{r['vs_bound']:.2f}" for r in group)
            targets = [(TARGET_VS_BOUND, "issue #38")] + (
                [(TARGET_VS_BOUND_REAL_SIZE, "issue 59, real size")] if args.dim >= REAL_SIZE_DIM else [])
            said = "; ".join(f"<= {target}x ({issue}): "
                             f"{'met' if bound_median[n, k, mode, loop] <= target else 'not met'}"
                             for target, issue in targets)
            print(f"n={n} K={k} {mode} {loop}: round / its bound, median of {len(group)} runs "
                  f"{bound_median[n, k, mode, loop]:.2f}x ({each}); {said}")
    for r in rows:
        plain = (r["n"], r["K"], "plain", r["event_loop"])
        base, cpu_base = median.get(plain), cpu_median.get(plain)
        r["vs_plain"] = r["seconds_per_round"] / base if base else None
        r["cpu_vs_plain"] = r["cpu_s_per_round"] / cpu_base if cpu_base else None
        other = (r["n"], r["K"], r["mode"], loops[-1])  # the last loop named: asyncio in `uvloop,asyncio`
        r["vs_last_loop"] = r["seconds_per_round"] / median[other] if len(loops) > 1 else None
        r["cpu_vs_last_loop"] = r["cpu_s_per_round"] / cpu_median[other] if len(loops) > 1 else None
    if len(modes) > 1:
        print()
        print(f"{'n':>3} {'K':>3} {'mode':>10} {'loop':>7} {'runs':>4} {'median s/round':>14} {'vs plain':>8} "
              f"{'CPU-s/round':>11} {'vs plain':>8}  {'every run s/round':<30}")
        for (n, k, mode, loop), group in runs.items():
            base, cpu_base = median.get((n, k, "plain", loop)), cpu_median.get((n, k, "plain", loop))
            ratio = f"{median[n, k, mode, loop] / base:>8.3f}" if base else f"{'-':>8}"
            cpu_ratio = f"{cpu_median[n, k, mode, loop] / cpu_base:>8.3f}" if cpu_base else f"{'-':>8}"
            each = " ".join(f"{r['seconds_per_round']:.3f}" for r in group)
            print(f"{n:>3} {k:>3} {mode:>10} {loop:>7} {len(group):>4} {median[n, k, mode, loop]:>14.3f} {ratio} "
                  f"{cpu_median[n, k, mode, loop]:>11.3f} {cpu_ratio}  {each}")
        for (n, k, mode, loop) in runs:
            base = median.get((n, k, "plain", loop))
            if mode == "secret+tls" and base:
                ratio = median[n, k, mode, loop] / base
                print(f"n={n} K={k} {loop}: secret+tls / plain {ratio:.3f}x (CPU "
                      f"{cpu_median[n, k, mode, loop] / cpu_median[n, k, 'plain', loop]:.3f}x), target <= "
                      f"{TARGET_TLS}x (issue #38): {'met' if ratio <= TARGET_TLS else 'not met'}")
                plain_cpu = cpu_median[n, k, "plain", loop]
                secret_extra = max(0.0, cpu_median.get((n, k, "secret", loop), plain_cpu) - plain_cpu)
                cipher = runs[n, k, mode, loop][0]["tls_cipher_cpu_s"]
                print(f"n={n} K={k} {loop}: secret+tls / plain can be no less than "
                      f"{(plain_cpu + secret_extra + cipher) / plain_cpu:.3f}x "
                      f"by CPU: plain's {plain_cpu:.3f} CPU-s, the secret's "
                      f"{secret_extra:+.3f}, TLS's encryption and decryption of the round's bytes alone {cipher:.3f} "
                      f"(Python's ssl over memory BIOs, as the event loops' TLS transports use it)")
        print("vs plain: the mode's median seconds (CPU seconds of all cluster processes) per round over plain's "
              "(same n, K, loop); the modes ran in turn, --repeats times. On a shared machine the CPU seconds are "
              "the steadier figure: wall time also counts other jobs' load")
    if len(loops) > 1:
        last = loops[-1]
        print()
        print(f"{'n':>3} {'K':>3} {'mode':>10} {'loop':>7} {'median s/round':>14} {'vs ' + last:>10} "
              f"{'CPU-s/round':>11} {'vs ' + last:>10} {'vs_bound':>8}")
        for (n, k, mode, loop) in runs:
            other = (n, k, mode, last)
            print(f"{n:>3} {k:>3} {mode:>10} {loop:>7} {median[n, k, mode, loop]:>14.3f} "
                  f"{median[n, k, mode, loop] / median[other]:>10.3f} {cpu_median[n, k, mode, loop]:>11.3f} "
                  f"{cpu_median[n, k, mode, loop] / cpu_median[other]:>10.3f} {bound_median[n, k, mode, loop]:>8.2f}")
        print(f"vs {last}: the loop's median seconds (CPU seconds) per round over {last}'s, same n, K and mode, "
              "the runs made in turn; vs_bound: the median of the runs' round against the bound")
    keys = ("n", "d", "K", "s", "mode", "seconds_per_round", "cpu_s_per_round", "bytes_per_node_round",
            "expected_bytes", "bytes_ratio",
            "send_s", "wait_s", "aggregate_s", "socket_seconds", "slowdown_vs_socket", "compute_seconds",
            "bound_seconds", "vs_bound", "socket_cpu_s", "compute_cpu_s", "bound_cpu_s", "cpu_vs_bound", "load1",
            "event_loop", "tls_cipher_cpu_s", "models_sha256")
    keys += ("vs_plain", "cpu_vs_plain") if len(modes) > 1 else ()
    keys += ("vs_last_loop", "cpu_vs_last_loop") if len(loops) > 1 else ()
    print(json.dumps([{k: (round(r[k], 6) if isinstance(r[k], float) else r[k]) for k in keys} for r in rows]))
    if off:
        sys.exit(1)


if __name__ == "__main__":
    main()
