"""`docker compose up --scale node=N`, measured on this host: time from `up` to the first round (and where it goes),
seconds per round, memory per container and in total, and whether every node took part in every round.

    MOSAIC_BASE=mosaic-base:bookworm docker compose build        # the image (offline base: see README)
    python bench/compose_scale.py --nodes 60 --rounds 20
    python bench/compose_scale.py --nodes 60 --per-container 4   # 15 containers of 4 nodes each

It runs compose.yaml as it is (only MOSAIC_* settings through the environment, the barrier's log as JSON lines so
that it can read them), samples every container's memory from its cgroup once a second, reads the round releases
from the barrier's log, and keeps the run's results. `--per-container N`: MOSAIC_NODES_PER_CONTAINER=N and
`--scale node=NODES/N` (`mosaicd node --nodes-per-process`: one process imports, N nodes forked from it); the memory
figures are per container (`node_*`) and per node (`per_node_*`: a container's over N).
compose.yaml puts the containers on the host's network, so the
host's neighbour (ARP) table plays no part: its thresholds are printed for the record (deploy/hostcheck.py).
`release_to_row_s`: from the last round's release to its evaluation row (bench/release_to_row.py).
It ends with `up -> first round` against --bound (60 s: issue #38's target for 60 nodes on this 2-core host) and the
machine's load average before and after: start-up is CPU-bound, so the figure is only as quiet as the machine was.
Before the run it times a node container's imports (`NODE_IMPORTS`, CPU seconds, best of 3 containers):
nodes x that / cores is a floor of `up -> first round` here that no orchestration goes below.
Writes OUT/scale.json, OUT/memory.csv, OUT/scale.png and OUT/results/; the last line of stdout is the JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
sys.path.insert(0, str(ROOT / "deploy"))
import hostcheck  # noqa: E402  (deploy/hostcheck.py: stdlib only, also run by users on the Docker host)
from release_to_row import release_to_row  # noqa: E402  (bench/release_to_row.py, beside this file)

COMPOSE_CLIS = {"v2": ["docker", "compose"], "v1": ["docker-compose"]}
FIRST_ROUND_BOUND_S = 60.0  # `up` to round 0 released, 60 nodes on this 2-core host (issue #38, Speed 4 item 4)


def compose_cli(wanted: str) -> tuple[list[str], str]:
    """The compose command and its version line: `wanted` (v1, v2), or v2 when installed, else v1."""
    for name in ([wanted] if wanted in COMPOSE_CLIS else ["v2", "v1"]):
        cli = COMPOSE_CLIS[name]
        if shutil.which(cli[0]):
            done = subprocess.run([*cli, "version"], capture_output=True, text=True)
            if done.returncode == 0:
                return cli, done.stdout.splitlines()[0].strip()
    sys.exit(f"compose_scale: --compose {wanted}: no such compose CLI installed")


def cgroup_dir(container: str) -> Path | None:
    for path in (Path("/sys/fs/cgroup/memory/docker") / container,             # cgroup v1, cgroupfs driver
                 Path("/sys/fs/cgroup/system.slice") / f"docker-{container}.scope",  # v2, systemd driver
                 Path("/sys/fs/cgroup/docker") / container):                  # v2, cgroupfs driver
        if path.is_dir():
            return path
    return None


def cpu_seconds_of(container: str) -> float:
    """CPU seconds one container's processes used so far (cgroup v1 cpuacct, or v2 cpu.stat)."""
    for path in (Path("/sys/fs/cgroup/cpuacct/docker") / container / "cpuacct.usage",):
        if path.exists():
            return int(path.read_text()) / 1e9
    folder = cgroup_dir(container)
    if folder is not None and (folder / "cpu.stat").exists():
        stat = dict(line.split() for line in (folder / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    return 0.0


def host_cpu_seconds() -> float:
    """CPU seconds this host spent busy (all cores, everything but idle and iowait), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def memory_of(path: Path) -> tuple[int, int]:
    """(resident anonymous memory, usage including page cache) of one container's cgroup, in bytes."""
    stat = dict(line.split() for line in (path / "memory.stat").read_text().splitlines())
    if (path / "memory.usage_in_bytes").exists():
        return int(stat["total_rss"]), int((path / "memory.usage_in_bytes").read_text())
    return int(stat["anon"]), int((path / "memory.current").read_text())


class MemorySampler(threading.Thread):
    def __init__(self, project: str, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.project, self.interval, self.t0 = project, interval, time.time()
        self.rows: list[tuple[float, int, float, float]] = []
        self.cpu: list[tuple[float, float, dict[str, float]]] = []  # (t, host CPU s, container -> CPU s)
        self.host_cpu0 = host_cpu_seconds()
        self.peak_rss: dict[str, int] = {}
        self.names: dict[str, str] = {}
        self.stop = threading.Event()

    def containers(self) -> dict[str, str]:
        out = subprocess.run(["docker", "ps", "--no-trunc", "--format", "{{.ID}} {{.Names}}", "--filter",
                              f"label=com.docker.compose.project={self.project}"], capture_output=True, text=True)
        return dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.strip())

    def run(self) -> None:
        listed = 0.0
        while not self.stop.is_set():
            if time.time() - listed > 5:
                self.names.update(self.containers())
                listed = time.time()
            rss_total = usage_total = alive = 0
            for cid in list(self.names):
                path = cgroup_dir(cid)
                try:
                    rss, usage = memory_of(path) if path else (0, 0)
                except (OSError, KeyError, ValueError):
                    continue
                if usage:
                    alive += 1
                    rss_total += rss
                    usage_total += usage
                    self.peak_rss[cid] = max(self.peak_rss.get(cid, 0), rss)
            self.rows.append((round(time.time() - self.t0, 2), alive, rss_total / MB, usage_total / MB))
            self.cpu.append((time.time() - self.t0, host_cpu_seconds() - self.host_cpu0,
                             {cid: cpu_seconds_of(cid) for cid in self.names}))
            self.stop.wait(self.interval)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def barrier_status(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/status", timeout=5) as resp:
            return json.load(resp)
    except OSError:
        return None


def log_events(compose: list[str], env: dict[str, str]) -> list[dict]:
    out = subprocess.run([*compose, "logs", "--no-color", "barrier"], env=env, capture_output=True, text=True)
    events = []
    for line in out.stdout.splitlines():
        _, _, text = line.partition("| ")
        try:
            event = json.loads(text)
        except ValueError:
            continue
        if isinstance(event, dict) and "timestamp" in event:
            event["t"] = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            events.append(event)
    return events


def container_starts(compose: list[str], env: dict[str, str], t0: float) -> list[float]:
    """When each node container started, in seconds since `up` (Docker's StartedAt), in order."""
    ids = subprocess.run([*compose, "ps", "-a", "-q", "node"], env=env, capture_output=True, text=True).stdout.split()
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.StartedAt}}", *ids], capture_output=True,
                         text=True).stdout.split() if ids else []
    return sorted(datetime.fromisoformat(t[:26].rstrip("Z") + "+00:00").timestamp() - t0 for t in out)


def barrier_health(compose: list[str], env: dict[str, str]) -> dict:
    """The barrier container's health check as Docker saw it during the run: its status, and how many of its
    checks failed (it must stay healthy while it serves, however loaded the host)."""
    ids = subprocess.run([*compose, "ps", "-q", "barrier"], env=env, capture_output=True, text=True).stdout.split()
    if not ids:
        return {}
    out = subprocess.run(["docker", "inspect", "-f", "{{json .State.Health}}", ids[0]], capture_output=True,
                         text=True).stdout.strip()
    state = json.loads(out) if out.startswith("{") else {}
    return {"status": state.get("Status"), "failing_streak": state.get("FailingStreak"),
            "failed_in_last_checks": sum(1 for c in state.get("Log") or [] if c.get("ExitCode") != 0)}


def plot(path: Path, rows: list, marks: dict[str, float], releases: list[float], nodes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([r[0] for r in rows], [r[2] / 1024 for r in rows], label="resident (sum over containers)")
    ax.plot([r[0] for r in rows], [r[3] / 1024 for r in rows], label="with page cache", alpha=0.6)
    for t in releases:
        ax.axvline(t, color="grey", lw=0.5, alpha=0.5)
    for name, t in marks.items():
        ax.axvline(t, color="red", lw=1, ls="--")
        ax.text(t, ax.get_ylim()[1] * 0.95, f" {name}", color="red", fontsize=8, va="top")
    ax.set_xlabel("seconds since `up` (grey: round releases)")
    ax.set_ylabel("GiB")
    ax.set_title(f"docker compose up --scale node={nodes}: memory of barrier + nodes")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compose_run_arguments(parser: argparse.ArgumentParser, project: str, out: str, timeout: float) -> None:
    """The flags of a script that runs compose.yaml as it is (this one, console_lines.py)."""
    parser.add_argument("--nodes", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--image", default=os.environ.get("MOSAIC_IMAGE", "mosaic:latest"))
    parser.add_argument("--project", default=project)
    parser.add_argument("--compose", choices=["auto", "v2", "v1"], default="auto",
                        help="docker compose (v2) or docker-compose (v1); auto: v2 when installed")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / out)
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds the whole run may take")
    parser.add_argument("--file", type=Path, default=ROOT / "compose.yaml",
                        help="the compose file (another layout to compare, e.g. compose.yaml of an earlier commit, "
                             "with that commit's image)")


def compose_run(args: argparse.Namespace, script: str, port: int, **settings: str
                ) -> tuple[list[str], dict[str, str], str, Path]:
    """compose.yaml as it is, run for `args` (`compose_run_arguments`): its command, its environment (only the
    MOSAIC_* settings given here), the compose CLI's version line and an emptied OUT/results folder."""
    if subprocess.run(["docker", "image", "inspect", args.image], capture_output=True).returncode:
        sys.exit(f"{script}: no image {args.image}; build it first (see bench/compose_scale.py's docstring)")
    results = args.out.resolve() / "results"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    cli, version = compose_cli(args.compose)
    compose = [*cli, "-p", args.project, "-f", str(args.file.resolve()), "--project-directory", str(ROOT)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    env.update(MOSAIC_IMAGE=args.image, MOSAIC_RESULTS=str(results), MOSAIC_BARRIER_PORT=str(port),
               MOSAIC_ROUNDS=str(args.rounds), MOSAIC_EVAL_EVERY=str(args.eval_every), **settings)
    return compose, env, version, results


def compose_up(compose: list[str], env: dict[str, str], nodes: int, script: str) -> None:
    """`up -d --scale node=N`, or the end of `script` with compose's error."""
    up = subprocess.run([*compose, "up", "-d", "--no-build", "--scale", f"node={nodes}"], env=env,
                        capture_output=True, text=True)
    if up.returncode:
        sys.exit(f"{script}: up failed:\n{up.stderr[-3000:]}")


# what a node container imports before its first round (the entry point, the node's daemon, the default task's
# model: torch), in a container of the image; the process's whole CPU seconds, the interpreter's start included
NODE_IMPORTS = ("import resource, mosaicd.cli, mosaicd.daemon.node.run, mosaicd.learning.tasks.digits; "
                "r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)")


def import_cpu_seconds(image: str, repeats: int = 3) -> float:
    """The fewest CPU seconds a node container of `image` spends importing what it needs before its first round
    (`NODE_IMPORTS`), of `repeats` containers run one after the other: nodes x this / cores is a floor of `up` to
    the first round that no orchestration can go below (every node imports its own, in its own container)."""
    seconds = []
    for _ in range(repeats):
        run = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python", image, "-c", NODE_IMPORTS],
                             capture_output=True, text=True, timeout=120)
        if run.returncode:
            sys.exit(f"compose_scale: the node's imports failed in {image}:\n{run.stderr[-2000:]}")
        seconds.append(float(run.stdout.split()[-1]))
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    compose_run_arguments(parser, "mosaicscale", "compose-scale", 3600)
    parser.add_argument("--port", type=int, default=0, help="the barrier's port on the host (0: a free one)")
    parser.add_argument("--per-container", type=int, default=1,
                        help="nodes in each node container (MOSAIC_NODES_PER_CONTAINER); --nodes must be a multiple")
    parser.add_argument("--bound", type=float, default=FIRST_ROUND_BOUND_S,
                        help="seconds from `up` to the first round's release that the run should keep within "
                             "(issue #38's target for 60 nodes on this host)")
    args = parser.parse_args()
    if args.nodes < 1:
        parser.error(f"--nodes {args.nodes}: must be >= 1")
    if args.per_container < 1 or args.nodes % args.per_container:
        parser.error(f"--per-container {args.per_container}: must be >= 1 and divide --nodes {args.nodes}")
    containers = args.nodes // args.per_container
    neighbours = hostcheck.check_neighbour_table(args.nodes)
    thresholds = neighbours.thresholds
    print(f"compose_scale: this host's neighbour table thresholds (gc_thresh1/2/3): {thresholds}", flush=True)

    out = args.out.resolve()
    port = args.port or free_port()
    compose, env, cli_version, results = compose_run(args, "compose_scale", port, MOSAIC_BARRIER_LINGER="30",
                                                     MOSAIC_LOG_JSON="true",
                                                     MOSAIC_NODES_PER_CONTAINER=str(args.per_container))
    peak_file = Path("/sys/fs/cgroup/memory/docker/memory.max_usage_in_bytes")
    try:
        peak_file.write_text("0")  # cgroup v1: reset the peak of all containers together
    except OSError:
        peak_file = Path("/nonexistent")

    imports_cpu = import_cpu_seconds(args.image)
    print(f"compose_scale: a node container's imports take {imports_cpu:.2f} CPU-s (best of 3 containers)", flush=True)
    load_before = os.getloadavg()  # the machine's load: start-up is CPU-bound, so the figure is only as quiet as it
    sampler = MemorySampler(args.project)
    t0 = sampler.t0
    sampler.start()
    try:
        print(f"compose_scale: up --scale node={containers} ({args.per_container} nodes each), {args.rounds} rounds",
              flush=True)
        compose_up(compose, env, containers, "compose_scale")
        t_started = time.time() - t0
        url = f"http://127.0.0.1:{port}"
        status, last = None, ""
        while time.time() - t0 < args.timeout:
            status = barrier_status(url) or status
            if status:
                line = (f"{status['phase']}: registered {status['registered']}/{status['expected'] or '?'}, "
                        f"rounds done {min(status['round'], status['rounds'])}/{status['rounds']}")
                if line != last:
                    print(f"{time.time() - t0:6.0f}s {line}", flush=True)
                    last = line
                if status["phase"] in ("finished", "failed"):
                    break
            time.sleep(1)
        time.sleep(2)
        load_after = os.getloadavg()
        kernel_peak = int(peak_file.read_text()) if peak_file.exists() else None
        events = log_events(compose, env)
        health = barrier_health(compose, env)
        started = container_starts(compose, env, t0)
    finally:
        sampler.stop.set()
        subprocess.run([*compose, "down", "-v"], env=env, capture_output=True)
    if not status or status["phase"] != "finished":
        sys.exit(f"compose_scale: the run did not finish: {status}")

    closed = next(e["t"] - t0 for e in events if e["event"] == "registration_closed")
    registered = [e["t"] - t0 for e in events if e["event"] == "registered"]
    releases = [(e["round"], e["t"] - t0) for e in events if e["event"] == "released"]
    times = [t for _, t in releases]
    durations = [b - a for a, b in zip([closed, *times], times, strict=False)][: args.rounds]
    eval_rounds = {r for r in range(args.rounds) if (r + 1) % args.eval_every == 0 or r == args.rounds - 1}
    collected = {r + 1 for r in eval_rounds}  # the release after an evaluated round collects the models
    later = durations[1:]
    steady = [d for (r, _), d in zip(releases, durations, strict=False) if r >= 1 and r not in collected]
    with open(results / "nodes.csv") as f:
        per_round: dict[int, set[int]] = {}
        for row in csv.DictReader(f):
            per_round.setdefault(int(row["round"]), set()).add(int(row["node"]))
    summary = json.loads((results / "summary.json").read_text())
    everyone = all(per_round.get(r) == set(range(args.nodes)) for r in range(args.rounds))
    stragglers = sum(len(e.get("stragglers", [])) for e in events if e["event"] == "stragglers")

    names = sampler.names
    # CPU spent until round 0 was released: the host's, and per container (the barrier, the median node)
    at_first = next((c for c in sampler.cpu if c[0] >= times[0]), sampler.cpu[-1])
    node_cpu = [v for k, v in at_first[2].items() if "barrier" not in names.get(k, "") and v > 0]
    barrier_cpu = [v for k, v in at_first[2].items() if "barrier" in names.get(k, "")]
    node_peaks = [v for k, v in sampler.peak_rss.items() if "barrier" not in names.get(k, "")]
    barrier_peak = [v for k, v in sampler.peak_rss.items() if "barrier" in names.get(k, "")]
    with open(out / "memory.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "containers", "resident_mb", "with_page_cache_mb"])
        writer.writerows(sampler.rows)
    figures = {
        "nodes": args.nodes, "per_container": args.per_container, "node_containers": containers,
        "rounds": args.rounds, "task": summary["settings"]["task"],
        "compose": cli_version, "file": str(args.file),
        "gc_thresh": list(thresholds) if thresholds else None,
        "up_returned_s": round(t_started, 1),
        "up_to_first_node_container_started_s": round(started[0], 1) if started else None,
        "up_to_last_node_container_started_s": round(started[-1], 1) if started else None,
        "up_to_first_registered_s": round(min(registered), 1) if registered else None,
        "up_to_last_registered_s": round(max(registered), 1) if registered else None,
        "up_to_registration_closed_s": round(closed, 1),
        "up_to_first_round_s": round(times[0], 1),
        "up_to_first_round_bound_s": args.bound,
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after],
        "first_round_s": round(durations[0], 2),
        "cores": os.cpu_count(),
        "host_cpu_s_to_first_round": round(at_first[1], 1),
        "containers_cpu_s_to_first_round": round(sum(at_first[2].values()), 1),
        "node_cpu_s_to_first_round_median": round(statistics.median(node_cpu), 2) if node_cpu else None,
        "barrier_cpu_s_to_first_round": round(barrier_cpu[0], 2) if barrier_cpu else None,
        "node_imports_cpu_s": round(imports_cpu, 2),
        # the nodes' imports alone, spread over every core: what up -> first round cannot go below here
        "imports_floor_s": round(containers * imports_cpu / (os.cpu_count() or 1), 1),
        "largest_gap_between_registrations_s": round(max(b - a for a, b in zip(sorted(registered),
                                                         sorted(registered)[1:], strict=False)), 1)
        if len(registered) > 1 else None,
        "seconds_per_round_mean": round(statistics.mean(durations), 2),
        "seconds_per_round_after_first_mean": round(statistics.mean(later), 2) if later else None,
        "seconds_per_round_after_first_median": round(statistics.median(later), 2) if later else None,
        "seconds_per_round_without_collection_mean": round(statistics.mean(steady), 2) if steady else None,
        "seconds_per_round_max": round(max(durations), 2),
        "node_rss_peak_mb_max": round(max(node_peaks) / MB, 1),
        "node_rss_peak_mb_median": round(statistics.median(node_peaks) / MB, 1),
        "per_node_rss_peak_mb_median": round(statistics.median(node_peaks) / MB / args.per_container, 1),
        "per_node_rss_peak_mb_max": round(max(node_peaks) / MB / args.per_container, 1),
        "barrier_rss_peak_mb": round(barrier_peak[0] / MB, 1) if barrier_peak else None,
        "total_rss_peak_mb": round(max(r[2] for r in sampler.rows), 1),
        "total_with_page_cache_peak_mb": round(max(r[3] for r in sampler.rows), 1),
        "kernel_peak_all_containers_mb": round(kernel_peak / MB, 1) if kernel_peak else None,
        "barrier_health": health,
        "all_nodes_every_round": everyone,
        "members_at_end": len(status["live"]), "dropped": status["dropped"], "straggler_reports": stragglers,
        "final_node_average": summary["final"]["node_average"] if summary.get("final") else None,
        # from the last round's release to its evaluation row (bench/release_to_row.py: the barrier's log)
        **release_to_row(events),
        "round_seconds": [round(d, 2) for d in durations],
    }
    (out / "scale.json").write_text(json.dumps(figures, indent=2))
    plot(out / "scale.png", sampler.rows, {"up returned": t_started, "registered": closed, "round 0": times[0]},
         times, args.nodes)
    for key, value in figures.items():
        if key != "round_seconds":
            print(f"{key:45s} {value}")
    verdict = "within" if times[0] <= args.bound else "OVER"
    print(f"{'up -> first round':45s} {times[0]:.1f} s, {verdict} the bound of {args.bound:g} s ({args.nodes} nodes, "
          f"{os.cpu_count()} cores, load before {load_before[0]:.1f}, after {load_after[0]:.1f})")
    print(f"{'up -> first round, imports alone':45s} {figures['imports_floor_s']:.1f} s ({containers} x "
          f"{imports_cpu:.2f} CPU-s / {os.cpu_count()} cores): a floor of up -> first round on this host; the bound "
          f"needs each container's whole start (imports, registration, data, first round) in "
          f"{args.bound * (os.cpu_count() or 1) / containers:.2f} CPU-s per container, with Docker's own work besides")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
