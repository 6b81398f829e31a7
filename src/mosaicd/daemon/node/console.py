"""A node's console for people (not --log-json): a progress line per round, at most one every few seconds, printed by
the one progress printer (`progress.ProgressPrinter`) as `mosaicd cluster` and the barrier's console print theirs, so
that every member of a peer list shows where the run is (rounds done, train loss, members live, time left)."""

from __future__ import annotations

import math
import time

from mosaicd.progress import ProgressPrinter, RoundProgress

ROUND_EVERY_S = 2.0  # plain lines (a file, a pipe): one at most this often, and the last round's at once


class NodeConsole:
    """This node's rounds as plain progress lines (never a live bar: the node's warnings share its console)."""

    def __init__(self, label: str, rounds: int, enabled: bool) -> None:
        console = None
        if enabled:
            from rich.console import Console

            console = Console(stderr=True, force_terminal=False)
        self.printer = ProgressPrinter(enabled=enabled, console=console)
        self.label, self.rounds, self.said = label, rounds, -math.inf
        self.printer.start_run(label, rounds)

    def __enter__(self) -> NodeConsole:
        self.printer.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.printer.end_run(self.label)
        self.printer.close()

    def round_done(self, round: int, loss: float | None, live: int, members: int) -> None:
        """Round `round` is done (its release heard): a line, unless one was said less than `ROUND_EVERY_S` ago."""
        now = time.monotonic()
        if now - self.said < ROUND_EVERY_S and round + 1 < self.rounds:
            return
        self.said = now
        self.printer.on_round(RoundProgress(round, self.rounds, loss=loss if loss is not None and math.isfinite(loss)
                                            else None, live=live, members=members), self.label)
