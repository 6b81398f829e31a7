"""What an operator reads: the console of `docker compose up --scale node=N`, counted line by line.

    .venv/bin/python bench/console_lines.py --nodes 60 --rounds 20 --image mosaic:test
    .venv/bin/python bench/console_lines.py --nodes 60 --rounds 20 --image mosaic:before --file OLD/compose.yaml

Runs `compose.yaml` as a person would (the default console, not JSON; settings only through `MOSAIC_*`: digits,
K=4, s=4, H=5, evaluation every 5 rounds), waits for the run to end, then reads `compose logs` and counts: the
barrier's lines, the nodes' lines, the nodes' warning lines by kind, the round lines that carry an evaluation,
and the most lines one node printed of one kind within 10 s. Another commit's console (`--file` its
compose.yaml, `--image` its image) is measured the same way: like for like on one host. Writes OUT/console.log (the
whole console) and OUT/console.json; the last line of stdout is the JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from compose_scale import barrier_status, compose_run, compose_run_arguments, compose_up, free_port

# `compose logs --timestamps`: "node-3  | 2026-11-26T18:00:00.123456789Z <the line>"
LINE = re.compile(r"^(?P<service>[\w.-]+?)[-_](?P<index>\d+)\s+\| (?P<at>\S+) (?P<text>.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # compose v2 clears each line it prints (ESC [2K)
LEVEL = re.compile(r"\[(?P<level>\w+)\s*\] (?P<event>\S+)")
JSON_EVENT = re.compile(r'"event": ?"(?P<event>[^"]+)".*"level": ?"(?P<level>\w+)"|'
                        r'"level": ?"(?P<level2>\w+)".*"event": ?"(?P<event2>[^"]+)"')


def kind_of(text: str) -> tuple[str, str] | None:
    """(level, event) of a structured log line, for people or JSON; None for a plain line (the barrier's console)."""
    m = LEVEL.search(text[:80])
    if m:
        return m["level"], m["event"]
    m = JSON_EVENT.search(text)
    if m:
        return (m["level"] or m["level2"]), (m["event"] or m["event2"])
    return None


def count(console: str, window_s: float = 10.0) -> dict:
    barrier, nodes, warnings, rounds_with_eval = 0, 0, Counter(), 0
    seen: dict[tuple[str, str], list[float]] = {}
    for raw in console.splitlines():
        m = LINE.match(ANSI.sub("", raw))
        if not m or m["service"].endswith("secret"):
            continue
        if m["service"].endswith("barrier"):
            barrier += 1
            if re.search(r"round \d+", m["text"]) and re.search(r"accuracy|node_average|avg", m["text"]):
                rounds_with_eval += 1
            continue
        nodes += 1
        kind = kind_of(m["text"])
        if kind and kind[0] in ("warning", "error"):
            warnings[kind[1]] += 1
            at = datetime.fromisoformat(m["at"][:26].rstrip("Z") + "+00:00").timestamp()
            seen.setdefault((m["index"], kind[1]), []).append(at)
    densest = 0
    for times in seen.values():
        times.sort()
        start = 0
        for end, t in enumerate(times):
            while t - times[start] >= window_s:
                start += 1
            densest = max(densest, end - start + 1)
    return {"barrier_lines": barrier, "node_lines": nodes, "node_warning_lines": sum(warnings.values()),
            "node_warnings_by_kind": dict(warnings.most_common()), "barrier_round_lines_with_evaluation":
            rounds_with_eval, f"most_lines_of_one_kind_by_one_node_in_{window_s:g}s": densest}


def recount(path: Path) -> None:
    """The figures of a console.log written before (`--recount OUT/console.log`)."""
    print(json.dumps(count(path.read_text())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    compose_run_arguments(parser, "mosaicconsole", "console-lines", 1800)
    parser.add_argument("--recount", type=Path, help="count a console.log this script wrote, and run nothing")
    args = parser.parse_args()
    if args.recount:
        recount(args.recount)
        return
    if args.nodes < 1:
        parser.error(f"--nodes {args.nodes}: must be >= 1")
    out = args.out.resolve()
    port = free_port()
    compose, env, version, _ = compose_run(args, "console_lines", port, MOSAIC_BARRIER_LINGER="10")
    load = [os.getloadavg()[0]]
    t0 = time.time()
    status: dict | None = None
    try:
        print(f"console_lines: up --scale node={args.nodes}, {args.rounds} rounds ({version})", flush=True)
        compose_up(compose, env, args.nodes, "console_lines")
        last = ""
        while time.time() - t0 < args.timeout:
            status = barrier_status(f"http://127.0.0.1:{port}") or status
            load.append(os.getloadavg()[0])
            if status:
                line = f"{status['phase']}: rounds done {min(status['round'], status['rounds'])}/{status['rounds']}"
                if line != last:
                    print(f"{time.time() - t0:6.0f}s {line} (load {load[-1]:.1f})", flush=True)
                    last = line
                if status["phase"] in ("finished", "failed"):
                    break
            time.sleep(2)
        else:
            print(f"console_lines: the run did not end within {args.timeout:g} s", flush=True)
        # the nodes' last words: every container ends by itself once the run is over
        deadline = time.time() + 120
        while time.time() < deadline:
            containers = subprocess.run([*compose, "ps", "-q"], env=env, capture_output=True,
                                        text=True).stdout.split()
            states = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", *containers],
                                    capture_output=True, text=True).stdout.split() if containers else []
            if "true" not in states:
                break
            time.sleep(2)
        console = subprocess.run([*compose, "logs", "--no-color", "--timestamps"], env=env, capture_output=True,
                                 text=True).stdout
    finally:
        subprocess.run([*compose, "down", "-v"], env=env, capture_output=True)
    (out / "console.log").write_text(console)
    figures = {"nodes": args.nodes, "rounds": args.rounds, "image": args.image, "file": str(args.file),
               "compose": version, "phase": (status or {}).get("phase"), "wall_s": round(time.time() - t0, 1),
               "load_max": round(max(load), 1), "load_mean": round(sum(load) / len(load), 1), **count(console)}
    (out / "console.json").write_text(json.dumps(figures, indent=2))
    for key, value in figures.items():
        print(f"{key:50s} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
