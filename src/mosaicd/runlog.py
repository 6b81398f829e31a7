"""`mosaicd log RUN [--node R] [--follow]`: a run's log, from its folder.

RUN is a run's folder (its --out), or its name under runs/. Without --node: a cluster's barrier log
(OUT/logs/barrier.log: one line per round released, with the newest evaluation and the round it was measured
at), else a sweep run's run.log; `--node R`: rank R's (OUT/logs/node-R.log). JSON lines are shown as
`time level event key=value ...` (`--raw`: as written). `--follow` goes on printing as the run writes, and
ends when its summary.json says it ended, after --idle seconds without a new line while it says "running"
(a run whose process is gone), or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from mosaicd.rundir import log_files, read_summary
from mosaicd.terminal import seconds

DEFAULT_DIR = Path("runs")
POLL_S = 0.25
SETTLE_S = 1.0  # after the run ended, lines still written within this long are shown


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run's folder (its --out), or its name under runs/")
    parser.add_argument("--node", metavar="R", type=int, default=None, help="rank R's log instead of the barrier's")
    parser.add_argument("--follow", "-f", action="store_true", help="go on printing new lines until the run ends "
                        "(or --idle seconds pass without one, or Ctrl-C)")
    parser.add_argument("--idle", type=seconds, default=300.0, help="with --follow: stop after this many seconds "
                        "without a new line [default: 300]")
    parser.add_argument("--raw", action="store_true", help="the lines as written (JSON), not formatted")


def run_folder(run: str) -> Path:
    """RUN as a folder: the path given, else runs/RUN. FileNotFoundError naming both."""
    for folder in (Path(run), DEFAULT_DIR / run):
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"{run}: no such run folder (nor {DEFAULT_DIR / run}); `mosaicd runs` lists them")


def pick_log(folder: Path, node: int | None) -> Path:
    """The log to show: rank `node`'s, else the barrier's, else a sweep run's run.log."""
    logs = log_files(folder)
    if node is not None:
        name = f"node-{node}"
    else:
        name = next((n for n in ("barrier", "run") if n in logs), "barrier")
    if name in logs:
        return logs[name]
    if not logs:
        summary = read_summary(folder) or {}
        why = " (a simulate run logs to its console only)" if summary.get("mode") == "simulate" else ""
        raise FileNotFoundError(f"{folder}: no logs here{why}")
    raise FileNotFoundError(f"{folder}: no {name}.log; its logs: {', '.join(logs)}")


def format_line(line: str, raw: bool = False) -> str:
    """A structlog JSON line as `YYYY-MM-DD HH:MM:SS.mmm info released round=4 ...`; other lines as they are."""
    if raw or not line.startswith("{"):
        return line
    try:
        event: dict[str, Any] = json.loads(line)
    except ValueError:
        return line
    if not isinstance(event, dict):
        return line
    stamp = str(event.pop("timestamp", ""))
    stamp = f"{stamp[:10]} {stamp[11:23]}" if len(stamp) >= 19 else stamp
    level, name = event.pop("level", ""), event.pop("event", "")
    rest = " ".join(f"{k}={_value(v)}" for k, v in event.items())
    return " ".join(p for p in (stamp, f"{level:7s}" if level else "", str(name), rest) if p)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return json.dumps(value, separators=(",", ":"))


def _ended(folder: Path) -> bool:
    summary = read_summary(folder)
    return summary is not None and summary.get("status") not in (None, "running")


def show(path: Path, folder: Path, follow: bool, idle: float, raw: bool, out: TextIO = sys.stdout) -> str:
    """Print the log (and, following, what is written to it until the run ends); returns why it stopped."""
    position, pending = 0, ""
    last_news, ended_at = time.monotonic(), None
    while True:
        try:
            with open(path, errors="replace") as f:
                f.seek(0, 2)
                if f.tell() < position:  # the log was started again (a new run in this folder)
                    position, pending = 0, ""
                f.seek(position)
                data = f.read()
                position = f.tell()
        except FileNotFoundError:
            data = ""
        if data:
            lines = (pending + data).split("\n")
            pending = lines.pop()  # a line not finished yet
            for line in lines:
                out.write(format_line(line, raw) + "\n")
            out.flush()
            last_news = time.monotonic()
        if not follow:
            if pending:
                out.write(format_line(pending, raw) + "\n")
            return "end of the log"
        now = time.monotonic()
        if ended_at is None and _ended(folder):
            ended_at = now
        if ended_at is not None and now - ended_at >= SETTLE_S and now - last_news >= SETTLE_S:
            if pending:
                out.write(format_line(pending, raw) + "\n")
            return f"the run ended ({(read_summary(folder) or {}).get('status')})"
        if now - last_news >= idle:
            return f"no new line for {idle:g}s and the run's summary does not say it ended; stopped following"
        time.sleep(POLL_S)


def main(args: argparse.Namespace) -> int:
    folder = run_folder(args.run)
    try:
        path = pick_log(folder, args.node)
    except FileNotFoundError:
        if not args.follow or _ended(folder):
            raise
        path = folder / "logs" / (f"node-{args.node}.log" if args.node is not None else "barrier.log")  # to come
    why = show(path, folder, args.follow, args.idle, args.raw)
    if args.follow:
        print(f"mosaicd log: {why}", file=sys.stderr)
    return 0
