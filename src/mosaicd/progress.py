"""Progress of runs: the per-round record runs report (`RoundProgress`) and the one printer (`ProgressPrinter`).

`run_simulation` and `run_cluster` take `on_round`, a callable given one `RoundProgress` per finished round;
with `progress=True` they also feed their own `ProgressPrinter`. `mosaicd sweep` passes its own callback
(the run's log file, the sweep's printer) and `progress=False`.

The printer is built on `rich`: on a terminal a live `rich.progress.Progress` (one line per run, plus one for
the sweep's position when there is a sweep): a bar, rounds done/total, the time elapsed and left, and the
latest loss and metrics. Anywhere else (a file, a pipe, CI) it prints plain lines, one per update (a sweep:
at most one every `plain_every` seconds besides its messages), with no escape sequences.

Rounds are counted from 0, as in rounds.csv, the dashboard and the logs: a line says the round that just finished
and the count done, `round 11 (12/60 done)`, and the metrics name the round they were measured at,
`accuracy @ round 9: node-avg ...` (the cluster's barrier evaluates in the background, a round or two behind).

Time left comes from the recent rounds (the last `window` ones), not from the time since the start, which
holds the start-up (loading data, spawning processes) and made a 60 s run announce half an hour.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Column


@dataclass(frozen=True)
class RoundProgress:
    """One finished round of a run, as given to `on_round`."""

    round: int                         # the round that finished (0-based)
    rounds: int                        # rounds in the run
    loss: float | None = None          # mean training loss over the nodes in that round (None: not known here)
    row: dict[str, Any] | None = None  # the evaluation row (rounds.csv's columns), see below; else None
    live: int | None = None            # cluster mode: live members and members, from the barrier
    members: int | None = None
    notes: str = ""                    # what went wrong since the last line (the barrier's console): stragglers...
    # simulate: `row` is given exactly at the evaluation rounds (`--eval-every`, and the last round).
    # cluster: the barrier evaluates in the background, so a row comes with the first round reported after it
    # is ready (row["round"] says which round it evaluates); the last round always comes with the final row.

    @property
    def done(self) -> int:
        """Rounds done, this one included."""
        return self.round + 1


OnRound = Callable[[RoundProgress], None]
LABEL_WIDTH, BAR_WIDTH = 30, 20


def metrics_text(row: dict[str, Any] | None) -> str:
    """`accuracy @ round 9: node-avg 0.8123 avg-model 0.8301 consensus 0.0123` (empty without a row): the
    round is the one the models were taken at (0-based)."""
    if not row:
        return ""

    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "n/a"

    at = f" @ round {row['round']}:" if isinstance(row.get("round"), int) else ""
    return (f"{row.get('metric', 'metric')}{at} node-avg {num('node_average', '.4f')} avg-model "
            f"{num('average_model', '.4f')} consensus {num('consensus_distance', '.4g')}")


def round_text(done: int, rounds: int) -> str:
    """`round 11 (12/60 done)`: the round that finished, counted from 0, and the count of rounds done."""
    return f"round {done - 1} ({done}/{rounds} done)" if done > 0 else f"round - (0/{rounds} done)"


def clock(seconds: float) -> str:
    """`42s`, `3m07s`, `1h05m`."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


@dataclass
class _Run:
    label: str
    rounds: int
    window: int
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    loss: float | None = None
    metrics: str = ""
    members: str = ""
    notes: str = ""
    points: deque[tuple[float, int]] = field(default_factory=deque)  # (when, rounds done) of recent updates
    first_round_s: float | None = None                               # start-up and first round
    start_up_s: float | None = None                                  # that less one round at the recent rate
    task: TaskID | None = None

    def update(self, p: RoundProgress, now: float) -> None:
        self.rounds = p.rounds
        if p.done > self.done:
            if self.first_round_s is None:
                self.first_round_s = now - self.started
            if self.points and now - self.points[-1][0] < 1e-3:  # several rounds reported at once (cluster)
                self.points[-1] = (self.points[-1][0], p.done)
            else:
                self.points.append((now, p.done))
            while len(self.points) > 2 and self.points[-1][1] - self.points[1][1] >= self.window:
                self.points.popleft()
            self.done = p.done
        if p.loss is not None and math.isfinite(p.loss):
            self.loss = p.loss
        if p.row:
            self.metrics = metrics_text(p.row)
        if p.members is not None:
            self.members = f"members {p.live}/{p.members}"
        self.notes = p.notes

    def seconds_per_round(self) -> float | None:
        """Mean duration of the last `window` rounds; None until two rounds are done (the first holds start-up)."""
        if len(self.points) < 2:
            return None
        (t0, d0), (t1, d1) = self.points[0], self.points[-1]
        return (t1 - t0) / (d1 - d0) if d1 > d0 else None

    def eta(self) -> float | None:
        rate = self.seconds_per_round()
        return None if rate is None else rate * max(0, self.rounds - self.done)

    def detail(self) -> str:
        parts = [self.metrics, f"train loss {self.loss:.4f}" if self.loss is not None else "", self.members,
                 self.notes]
        return " | ".join(p for p in parts if p)


@dataclass
class _Sweep:
    runs: int             # runs in the sweep
    rounds_to_run: int    # rounds of the runs still to run
    runs_to_run: int
    parallel: int = 1     # runs going at once (`sweep --jobs`)
    started: float = field(default_factory=time.monotonic)
    done: int = 0         # runs finished, failed or skipped
    failed: int = 0       # of those, failed
    started_runs: int = 0
    rounds_done: int = 0  # rounds of the finished runs (those left short by a failure count as done)
    start_ups: list[float] = field(default_factory=list)
    rate: float | None = None  # seconds per round, the latest known
    task: TaskID | None = None
    last: str = ""        # the latest news of its runs (on a terminal: in its bar)


class ProgressPrinter:
    """The one progress display (see the module's docstring). Use as a context manager.

    A run: `start_run(label, rounds)`, then `on_round(p)` per round (pass `printer.on_round` as a run's
    `on_round`), then `end_run()`. A sweep: `start_sweep(...)` first, `message(...)` for its news lines,
    `skip_run()` for a run already done, and the same three calls per run it runs. Runs of a sweep may go on
    at once (`sweep --jobs`): then each call names its run's label (`on_round(p, label)`, `end_run(label)`).
    """

    def __init__(self, enabled: bool = True, console: Console | None = None, plain_every: float = 0.0,
                 window: int = 10) -> None:
        self.enabled, self.plain_every, self.window = enabled, plain_every, window
        self.console = console
        self.live = False
        self._progress: Progress | None = None
        self._detail: Column | None = None
        self._runs: dict[str, _Run] = {}
        self._sweep: _Sweep | None = None
        self._last_plain = -math.inf
        if not enabled:
            return
        if self.console is None:
            from rich.console import Console

            self.console = Console(stderr=True)
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            from rich.table import Column

            def fixed() -> Column:
                return Column(no_wrap=True)

            # the detail column takes what the terminal has left (set in _fit), so the rest is never squeezed
            self._detail = Column(no_wrap=True, overflow="ellipsis")
            self._progress = Progress(
                TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                      max_width=LABEL_WIDTH)),
                BarColumn(bar_width=BAR_WIDTH, table_column=fixed()),
                TextColumn("{task.fields[count]}", table_column=fixed()), TimeElapsedColumn(table_column=fixed()),
                TextColumn("{task.fields[left]}", table_column=fixed()),
                TextColumn("{task.fields[detail]}", table_column=self._detail),
                console=self.console, refresh_per_second=2)

    # ------------------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> ProgressPrinter:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

    # ------------------------------------------------------------------------------------------ a run

    @property
    def _run(self) -> _Run | None:
        """The run going on (the latest started, where several are)."""
        return next(reversed(self._runs.values()), None)

    def start_run(self, label: str, rounds: int, started: float | None = None) -> None:
        """`started`: when the run began (time.monotonic()), where it began before its first round (a barrier's
        registration, a resumed run's time before), so that its lines count from where its end line does."""
        run = self._runs[label] = _Run(label, rounds, self.window, time.monotonic() if started is None else started)
        if self._sweep is not None:
            self._sweep.started_runs += 1
        if self._progress is not None:
            if self._sweep is None:  # a sweep's runs are shown on its one bar (its detail: the run and its round)
                run.task = self._progress.add_task(label or "run", total=rounds, **self._fields(run))
            self._redraw_sweep()

    def on_round(self, p: RoundProgress, label: str | None = None) -> None:
        run = self._run if label is None else self._runs.get(label)
        if run is None:
            self.start_run(label or "", p.rounds)
            run = self._run
        assert run is not None
        now = time.monotonic()
        run.update(p, now)
        rate = run.seconds_per_round()
        sweep = self._sweep
        if sweep is not None and rate is not None:
            sweep.rate = rate
            if run.start_up_s is None and run.first_round_s is not None:
                run.start_up_s = max(0.0, run.first_round_s - rate)
                sweep.start_ups.append(run.start_up_s)
        if not self.enabled:
            return
        if self._progress is not None:
            if run.task is not None:
                self._progress.update(run.task, completed=run.done, total=run.rounds, **self._fields(run))
            self._redraw_sweep()
        elif sweep is None:
            self._plain(self._run_line(run))
        elif now - self._last_plain >= self.plain_every:
            self._plain(self._sweep_line(sweep))

    def end_run(self, label: str | None = None, failed: bool = False) -> None:
        run = self._run if label is None else self._runs.get(label)
        if run is None:
            return
        del self._runs[run.label]
        if self._sweep is not None:
            self._sweep.done += 1
            self._sweep.failed += failed
            self._sweep.rounds_done += run.rounds
        if self._progress is not None and run.task is not None:
            if self._sweep is not None:
                self._progress.remove_task(run.task)
            self._redraw_sweep()

    # ------------------------------------------------------------------------------------------ a sweep

    def start_sweep(self, runs: int, runs_to_run: int, rounds_to_run: int, parallel: int = 1) -> None:
        self._sweep = _Sweep(runs, rounds_to_run, runs_to_run, max(1, parallel))
        if self._progress is not None:
            self._sweep.task = self._progress.add_task("sweep", total=max(1, rounds_to_run),
                                                       **self._sweep_fields(self._sweep))

    def skip_run(self) -> None:
        if self._sweep is not None:
            self._sweep.done += 1
            self._redraw_sweep()

    def sweep_eta(self) -> float | None:
        """Seconds left in the sweep: its rounds left at the recent rate, plus the mean start-up of a run for each
        run not started yet, shared among the runs that go at once. None until a rate is known."""
        sweep = self._sweep
        if sweep is None or sweep.rate is None:
            return None
        rounds_left = max(0, sweep.rounds_to_run - sweep.rounds_done - self._rounds_going())
        start_up = sum(sweep.start_ups) / len(sweep.start_ups) if sweep.start_ups else 0.0
        return (rounds_left * sweep.rate + max(0, sweep.runs_to_run - sweep.started_runs) * start_up) / sweep.parallel

    def _rounds_going(self) -> int:
        return sum(run.done for run in self._runs.values())

    def message(self, text: str, always: bool = False) -> None:
        """A line of news (above the live display on a terminal); `always`: even when progress is off."""
        if not (self.enabled or always):
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self._plain(text, status=False)

    # ------------------------------------------------------------------------------------------ text

    @staticmethod
    def _left(eta: float | None) -> str:
        return "time left: measuring" if eta is None else f"~{clock(eta)} left"

    def _fields(self, run: _Run) -> dict[str, str]:
        return {"count": f"{run.done}/{run.rounds} rounds", "left": self._left(run.eta()), "detail": run.detail()}

    def _going(self) -> list[str]:
        """What the runs going on are at: one run's round and metrics, or each run's round where several go."""
        runs = list(self._runs.values())
        if len(runs) == 1:
            return [f"{runs[0].label}: {round_text(runs[0].done, runs[0].rounds)}", runs[0].detail()]
        return [f"{len(runs)} running: " + ", ".join(f"{r.label} {r.done}/{r.rounds}" for r in runs)] if runs else []

    @staticmethod
    def _count(sweep: _Sweep) -> str:
        return f"runs {sweep.done}/{sweep.runs}" + (f" ({sweep.failed} failed)" if sweep.failed else "")

    def _sweep_fields(self, sweep: _Sweep) -> dict[str, str]:
        detail = " | ".join(p for p in (*self._going(), sweep.last) if p)
        return {"count": self._count(sweep), "left": self._left(self.sweep_eta()), "detail": detail}

    def sweep_news(self, text: str, always: bool = False) -> None:
        """A sweep's line about one of its runs (started, finished): a line off a terminal (a log); on one, the
        sweep's bar shows it (`always`: a line there too, e.g. a failure)."""
        if self._sweep is not None and self._progress is not None and not always:
            self._sweep.last = text
            self._redraw_sweep()
            return
        self.message(text, always=always)

    def _fit(self) -> None:
        """Give the detail column the width the other columns leave on the terminal."""
        if self._progress is None:
            return
        tasks = self._progress.tasks
        used = BAR_WIDTH + len("0:00:00")
        used += min(LABEL_WIDTH, max((len(t.description) for t in tasks), default=0))
        for key in ("count", "left"):
            used += max((len(str(t.fields.get(key, ""))) for t in tasks), default=0)
        assert self._detail is not None
        self._detail.max_width = max(1, self._progress.console.width - used - 6)  # 6: one space between columns

    def _redraw_sweep(self) -> None:
        self._fit()
        sweep = self._sweep
        if self._progress is None or sweep is None or sweep.task is None:
            return
        self._progress.update(sweep.task, completed=min(sweep.rounds_done + self._rounds_going(),
                                                        max(1, sweep.rounds_to_run)),
                              **self._sweep_fields(sweep))

    def _run_line(self, run: _Run) -> str:
        detail = run.detail()
        return (f"{run.label + ': ' if run.label else ''}{round_text(run.done, run.rounds)}"
                f"{' | ' + detail if detail else ''} | {clock(time.monotonic() - run.started)} elapsed, "
                f"{self._left(run.eta())}")

    def _sweep_line(self, sweep: _Sweep) -> str:
        line = (f"{self._count(sweep)} | {clock(time.monotonic() - sweep.started)} elapsed, "
                f"{self._left(self.sweep_eta())}")
        going = [p for p in self._going() if p]
        return line + (" | " + " | ".join(going) if going else "")

    def _plain(self, text: str, status: bool = True) -> None:
        stream = self.console.file if self.console is not None else sys.stderr  # None: progress off, `always`
        stream.write(text + "\n")
        stream.flush()
        if status:
            self._last_plain = time.monotonic()
