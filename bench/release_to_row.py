"""How long after its release the last round's evaluation row is on disk, from a barrier's JSON log.

    mosaicd cluster --task digits --nodes 16 --rounds 10 --out OUT
    python bench/release_to_row.py OUT            # OUT/logs/barrier.log (a cluster's); or give the log file itself

`release_to_row_s`: from the release of the last round (the barrier's `released` line of round R - 1) to its row
(`evaluated` of round R - 1, logged once rounds.csv has it); `final_release_to_row_s`: from the final release (the
nodes' last arrivals) to that row; `rows_mtime_after_release_s`: rounds.csv's mtime against the same release.
The last line of stdout is the JSON object. Used by bench/compose_scale.py.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any


def when(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def release_to_row(events: list[dict[str, Any]], rows: Path | None = None) -> dict[str, float | None]:
    """The figures from the barrier's log events (JSON lines, parsed); `rows`: rounds.csv, for its mtime."""
    released = {e["round"]: e for e in events if e.get("event") == "released" and "timestamp" in e}
    evaluated = {e["round"]: e for e in events if e.get("event") == "evaluated" and "timestamp" in e}
    if not released:
        return {"release_to_row_s": None, "final_release_to_row_s": None, "rows_mtime_after_release_s": None}
    final = max(released)
    last = final - 1 if released[final].get("finished") else final
    row = evaluated.get(last)
    out: dict[str, float | None] = {"last_round": last}
    out["release_to_row_s"] = None if row is None or last not in released else \
        round(when(row) - when(released[last]), 3)
    out["final_release_to_row_s"] = None if row is None else round(when(row) - when(released[final]), 3)
    out["rows_mtime_after_release_s"] = None if rows is None or not rows.exists() or last not in released else \
        round(rows.stat().st_mtime - when(released[last]), 3)
    return out


def main() -> None:
    path = Path(sys.argv[1])
    log = path / "logs" / "barrier.log" if path.is_dir() else path
    events = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    rows = (path if path.is_dir() else log.parent.parent) / "rounds.csv"
    print(json.dumps(release_to_row(events, rows)))


if __name__ == "__main__":
    main()
