"""One progress line per run: round, loss, latest metrics and time left."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    def __init__(self, total: int, enabled: bool = True, label: str = "") -> None:
        self.total, self.enabled, self.label = total, enabled, label
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.metrics = ""

    def update(self, round: int, loss: float | None = None, row: dict[str, Any] | None = None,
               extra: str = "") -> None:
        if not self.enabled:
            return
        done = round + 1
        elapsed = time.monotonic() - self.started
        left = elapsed / done * (self.total - done) if done else 0.0
        if row:
            metric = row.get("metric", "metric")
            self.metrics = (f" | {metric} node-avg {row.get('node_average', float('nan')):.4f}"
                            f" avg-model {row.get('average_model', float('nan')):.4f}"
                            f" consensus {row.get('consensus_distance', float('nan')):.4g}")
        loss_text = f" loss {loss:.4f}" if loss is not None else ""
        timing = f"{elapsed:.0f}s, ~{left:.0f}s left"
        line = f"{self.label}round {done}/{self.total}{loss_text}{self.metrics}{extra} | {timing}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
