"""Reading a run's folder: its files parsed back with the standard library only, so that the tools that look at
runs (`mosaicd runs`, `log`, `status FOLDER`) start at once and work on runs that ended, failed or crashed.

    OUT/summary.json       status, settings, progress, the newest evaluation ("final"); see `mosaicd.outputs`
    OUT/rounds.csv         one row per evaluated round (`read_rounds`)
    OUT/nodes.csv          one row per node and round (`last_node_rows`: each node's newest, from the file's end;
                           `node_losses_after`: a resumed run's losses of the rounds it has yet to evaluate)
    OUT/logs/barrier.log   a cluster's barrier, OUT/logs/node-<rank>.log its nodes (JSON lines)
    OUT/run.log            a sweep's run: one line per round
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JSON_COLUMNS = ("reported",)  # rounds.csv cells that hold a JSON object
LIST_COLUMNS = ("nodes", "per_node")  # rounds.csv cells that hold a list: its items separated by spaces
RUN_MARKER = "summary.json"
EARLIER = "earlier"  # where a barrier keeps the run its --out held when it starts a new one (`keep_earlier_run`)


def read_summary(out: Path | str) -> dict[str, Any] | None:
    """OUT/summary.json, or None where there is none or it cannot be read."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def read_rounds(out: Path | str) -> list[dict[str, Any]]:
    """The evaluation rows of OUT/rounds.csv, parsed back (numbers, booleans, the lists of `LIST_COLUMNS`);
    an empty cell is None. None of them if the file is missing."""
    rounds: list[dict[str, Any]] = []
    try:
        with open(Path(out) / "rounds.csv", newline="") as f:
            for row in csv.DictReader(f):
                rounds.append(parse_row(row))
    except OSError:
        pass
    return rounds


def parse_row(row: dict[str | None, str | None]) -> dict[str, Any]:
    return {k: _parse_list(v) if k in LIST_COLUMNS else _parse_json(v) if k in JSON_COLUMNS else parse_cell(v)
            for k, v in row.items() if k is not None}


def _parse_json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_cell(text: str | None) -> Any:
    """A CSV cell as it was written: int, float, bool, or the text; '' is None."""
    if text is None or text == "":
        return None
    if text in ("true", "false", "True", "False"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_list(text: str | None) -> list[Any] | None:
    return None if text is None or text == "" else [parse_cell(item) for item in text.split()]


def tail_lines(path: Path, count: int, chunk: int = 1 << 16) -> list[str]:
    """The last `count` lines of a text file, read from its end (a long run's CSV is never read whole)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = position = f.tell()
        data = b""
        while position > 0 and data.count(b"\n") <= count:
            position = max(0, position - chunk)
            f.seek(position)
            data = f.read(end - position)
    lines = data.decode(errors="replace").splitlines()
    return lines[-count:]  # the first line read may be cut: there are more than `count` unless at the start


def last_node_rows(out: Path | str, nodes: int) -> dict[int, dict[str, Any]]:
    """node -> its newest row of OUT/nodes.csv (from the last rows of the file; a node that stopped long before
    the end is not among them)."""
    path = Path(out) / "nodes.csv"
    try:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
        lines = tail_lines(path, 4 * max(1, nodes) + 1)
    except OSError:
        return {}
    if not header:
        return {}
    rows: dict[int, dict[str, Any]] = {}
    for values in csv.reader(io.StringIO("\n".join(lines))):
        if values == header or len(values) != len(header):
            continue
        row = parse_row(dict(zip(header, values, strict=True)))
        if isinstance(row.get("node"), int):
            rows[row["node"]] = row
    return rows


def node_losses_after(out: Path | str, round: int) -> dict[int, dict[int, float]]:
    """round -> node -> loss, from OUT/nodes.csv's rows of the rounds after `round` (read from the file's end, back
    to a row of `round` or before): the training losses of the rounds a resumed run has yet to evaluate."""
    path = Path(out) / "nodes.csv"
    try:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
        if not header or header[:3] != ["round", "node", "loss"]:
            return {}
        count = 256
        while True:  # rows are appended in round order: read back until one of `round` or before
            lines = tail_lines(path, count)
            rows = [v for v in csv.reader(io.StringIO("\n".join(lines))) if len(v) == len(header)
                    and v[0].isdigit() and v[1].isdigit()]
            if len(lines) < count or any(int(v[0]) <= round for v in rows):
                break
            count *= 4
    except OSError:
        return {}
    losses: dict[int, dict[int, float]] = {}
    for t, node, loss, *_ in rows:
        if int(t) > round:
            try:
                losses.setdefault(int(t), {})[int(node)] = float(loss or "nan")
            except ValueError:
                continue
    return losses


def find_runs(root: Path | str) -> Iterator[Path]:
    """Every run folder under `root` (itself included): a folder with a summary.json, looked into further only for
    the runs a barrier kept aside in it (`keep_earlier_run`)."""
    root = Path(root)
    for folder, dirs, files in os.walk(root):
        if RUN_MARKER in files:
            dirs[:] = [EARLIER] if EARLIER in dirs else []
            yield Path(folder)
        else:
            dirs.sort()


def rounds_done(summary: dict[str, Any]) -> int | None:
    """Rounds the run got through: its progress, else (summaries of an earlier version) what its rows say."""
    progress = summary.get("progress") or {}
    if isinstance(progress.get("rounds_done"), int):
        return progress["rounds_done"]
    if summary.get("status") == "finished":
        return (summary.get("settings") or {}).get("rounds")
    final = summary.get("final") or {}
    return final["round"] + 1 if isinstance(final.get("round"), int) else None


def started_at(summary: dict[str, Any], folder: Path) -> str | None:
    """When the run started (ISO 8601): its summary's, else summary.json's time less the run's wall time."""
    if isinstance(summary.get("started"), str):
        return summary["started"]
    try:
        when = (folder / RUN_MARKER).stat().st_mtime - float(summary.get("wall_s") or 0.0)
    except (OSError, TypeError, ValueError):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when))


def run_entry(folder: Path, root: Path | None = None) -> dict[str, Any] | None:
    """One run as `mosaicd runs` lists it (None: no readable summary.json)."""
    summary = read_summary(folder)
    if summary is None:
        return None
    settings = summary.get("settings") or {}
    final = summary.get("final") or {}
    name = str(folder.relative_to(root)) if root is not None and folder != root else folder.name
    return {
        "id": summary.get("run_id") or (name if name not in ("", ".") else folder.resolve().name),
        "status": summary.get("status"), "error": summary.get("error"), "mode": summary.get("mode"),
        "task": settings.get("task"), "nodes": settings.get("nodes"), "fragments": settings.get("fragments"),
        "fanout": settings.get("fanout"), "optimizer": settings.get("optimizer"),
        "optimizer_options": settings.get("optimizer_options"), "lr": settings.get("lr"),
        "rounds_done": rounds_done(summary), "rounds": settings.get("rounds"),
        "metric": final.get("metric"), "node_average": final.get("node_average"),
        "average_model": final.get("average_model"), "evaluated_round": final.get("round"),
        "started": started_at(summary, folder), "wall_s": summary.get("wall_s"), "folder": str(folder),
        "slurm_job": (summary.get("placement") or {}).get("slurm_job"),
    }


def list_runs(root: Path | str) -> list[dict[str, Any]]:
    """The runs under `root`, oldest first."""
    root = Path(root)
    entries = [e for e in (run_entry(f, root) for f in find_runs(root)) if e is not None]
    return sorted(entries, key=lambda e: (e["started"] or "", e["folder"]))


def log_files(out: Path | str) -> dict[str, Path]:
    """A run's logs by name: "barrier" and "node-<rank>" (cluster), "run" (a sweep's run)."""
    out = Path(out)
    logs = {p.stem: p for p in sorted((out / "logs").glob("*.log"), key=_log_order)} if (out / "logs").is_dir() \
        else {}
    if (out / "run.log").is_file():
        logs["run"] = out / "run.log"
    return logs


def _log_order(path: Path) -> tuple[int, int, str]:
    stem = path.stem
    if stem == "barrier":
        return 0, 0, stem
    rank = stem.removeprefix("node-")
    return (1, int(rank), stem) if rank.isdigit() else (2, 0, stem)
