"""The barrier's console for people (not --log-json): where to look, registration, one line per round (at most one
every few seconds), the result. It reads the barrier's state once a second; the logs keep only warnings."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from mosaicd.daemon.http.membership import is_wildcard
from mosaicd.progress import ProgressPrinter, RoundProgress, clock, metrics_text

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier

EVERY_S = 1.0          # how often it looks
WAITING_EVERY_S = 5.0  # while registering: a line when the count changed, at most this often
ROUND_EVERY_S = 2.0    # a round line at most this often (fast runs: the newest round then)
SLOW_PHASE_S = 0.5     # a round line names the mean seconds of each phase once one of them takes this long


def local_url(host: str, port: int, scheme: str) -> str:
    """The barrier's URL from this machine (a wildcard address is reached on the loopback)."""
    shown = "127.0.0.1" if is_wildcard(host) else host
    return f"{scheme}://{shown}:{port}"


def where_lines(barrier: Barrier, url: str) -> list[str]:
    run = barrier.run
    options = barrier.options
    per_address = f" ({options.nodes_per_address} per address)" if options.nodes_per_address > 1 else ""
    how = (f"the nodes that register until none new comes for {options.expect_settle:g}s (or twice the longest "
           "pause between them)" if options.expect_settle else
           f"the nodes {options.expect_dns} resolves to{per_address}" if options.expect_dns else f"{run.nodes} nodes")
    rounds = f"{run.rounds} rounds" if str(run.sync) == "barrier" else f"{run.rounds} iterations each, asynchronous"
    return [f"mosaic barrier: run {run.run_id}: {str(run.task)}, {rounds}, K={run.fragments} "
            f"fragments, s={run.fanout} peers each, over {how}",
            f"  dashboard: {url}/   status: mosaicd status {url}   results: {barrier.options.out}/"]


def waiting_line(barrier: Barrier) -> str:
    state = barrier.state
    of = f" of {state.expected}" if state.expected else ""
    missing = state.registration.unregistered(state.pending)
    refused = barrier.refusals.text()
    return f"waiting for nodes: {len(state.pending)}{of} registered" + (
        f"; not yet: {', '.join(missing)}" if missing else "") + (f"; {refused}" if refused else "")


def resumed_line(barrier: Barrier) -> str | None:
    """A barrier started again on its run's OUT: where the run goes on, from what, and how long it ran before."""
    if not barrier.resumed:
        return None
    ran = time.time() - barrier.recorder.origin  # the time the run ran before (summary.json's wall_s)
    before = f", after {clock(ran)} of it before" if ran >= 1 else ""
    return (f"resumed with {barrier.state.round} of {barrier.run.rounds} rounds done, from the journal in "
            f"{barrier.options.out}/{before}: the nodes still waiting for the barrier go on with it")


def end_line(barrier: Barrier, started: float) -> str:
    """`started`: when the run began (time.time(); a resumed run's: its first start, less the time it stood)."""
    state, out = barrier.state, barrier.options.out
    files = f"results in {out}/ (summary.json, rounds.csv, nodes.csv)"
    if (summary := barrier.ending.collected) is not None:  # --sync async: the members' reports collected
        steps = (summary.get("asynchronous") or {}).get("steps") or {}
        dropped = f", {len(summary['dropped'])} left out" if summary.get("dropped") else ""
        row = barrier.recorder.rounds[-1] if barrier.recorder.rounds else None
        return (f"{summary.get('status')}: {len(steps)} nodes reported {sum(steps.values())} iterations in "
                f"{clock(time.time() - started)}{dropped}; {metrics_text(row) or 'no evaluation'}; {files}")
    if state.phases.finished:
        row = barrier.recorder.rounds[-1] if barrier.recorder.rounds else None
        return (f"finished: {min(state.round, barrier.run.rounds)} rounds in {clock(time.time() - started)}, "
                f"{len(state.live)}/{len(state.addresses)} nodes to the end; {metrics_text(row) or 'no evaluation'}; "
                f"{files}")
    if barrier.stopped_by_members():
        return (f"{barrier.failure}: started again with --out {out} (and its members with their state directories: "
                f"compose `up` again), the barrier resumes the run where it stopped; {files}")
    return f"failed: {barrier.failure or 'the run ended early'}; {files}"


class BarrierConsole:
    """Feeds `ProgressPrinter` from the barrier's state: the same plain round lines `mosaicd cluster` prints."""

    def __init__(self, barrier: Barrier, url: str) -> None:
        self.barrier, self.url = barrier, url
        self.printer = ProgressPrinter()
        self.resumed_at = barrier.state.round if barrier.resumed else None
        self.registered: tuple[int, int] = (-1, -1)  # registered, refused: as last said
        self.said_waiting = -WAITING_EVERY_S
        self.rounds_done, self.said_round, self.row_round = self.resumed_at or 0, -ROUND_EVERY_S, -1

    def look(self, final: bool = False) -> None:
        barrier, state, now = self.barrier, self.barrier.state, time.monotonic()
        if state.phases.registering:
            seen = (len(state.pending), barrier.refusals.total)
            if seen != self.registered and now - self.said_waiting >= WAITING_EVERY_S:
                self.registered, self.said_waiting = seen, now
                self.printer.message(waiting_line(barrier))
            return
        if self.said_round < 0 and state.addresses:
            if self.resumed_at is None:
                self.printer.message(f"registration closed: {len(state.addresses)} nodes; " + (
                    "round 0 starts" if str(barrier.run.sync) == "barrier" else "they train asynchronously, and "
                    "the barrier collects their reports once they are done"))
            # one clock: the round lines' elapsed counts from the run's start, as the end line's time does
            self.printer.start_run("", barrier.run.rounds, time.monotonic() - (time.time() - barrier.recorder.origin))
            self.said_round = now - ROUND_EVERY_S
        done = min(state.round, barrier.run.rounds)
        last = done >= barrier.run.rounds  # the last round's line at once; the result comes once the run is done
        if done > self.rounds_done and (final or last or now - self.said_round >= ROUND_EVERY_S):
            notes = self.notes(self.rounds_done, done)
            self.rounds_done, self.said_round = done, now
            self.printer.on_round(RoundProgress(done - 1, barrier.run.rounds, loss=self.loss(done - 1),
                                                row=self.new_row(), live=len(state.live),
                                                members=len(state.addresses), notes=notes))

    def notes(self, since: int, upto: int) -> str:
        """What an operator needs of the rounds in [since, upto) (the rounds this line covers): the stragglers
        they were released without, the members dropped, the messages refused, and the slowest phase."""
        entries = [e for e in self.barrier.history if since <= e["round"] < upto]
        stragglers = sorted({r for e in entries for r in e.get("stragglers") or []})
        dropped = sorted({r for e in entries for r in e.get("dropped") or []})
        left = sorted({r for e in entries for r in e.get("left") or []})
        joined = sorted({r for e in entries for r in e.get("joined") or []})
        refused: dict[str, int] = {}
        for e in entries:
            for reason, count in (e.get("refused") or {}).items():
                refused[reason] = refused.get(reason, 0) + count
        parts = [f"stragglers {stragglers}" if stragglers else "", f"dropped {dropped}" if dropped else "",
                 f"left {left}" if left else "", f"joined {joined}" if joined else "",
                 "refused " + ", ".join(f"{n} {why}" for why, n in refused.items()) if refused else ""]
        if entries:
            phases = {p: e[f"{p}_s"] for p in ("train", "send", "wait") for e in entries[-1:] if f"{p}_s" in e}
            if phases and max(phases.values()) >= SLOW_PHASE_S:  # where the time goes, once it is noticeable
                parts.append("mean " + " ".join(f"{p} {v:.1f}s" for p, v in phases.items()))
        return " | ".join(p for p in parts if p)

    def loss(self, round: int) -> float | None:
        for entry in reversed(self.barrier.history):
            if entry["round"] == round:
                return entry.get("loss")
        return None

    def new_row(self) -> dict[str, Any] | None:
        rows = self.barrier.recorder.rounds
        if rows and isinstance(rows[-1].get("round"), int) and rows[-1]["round"] > self.row_round:
            self.row_round = rows[-1]["round"]
            return rows[-1]
        return None

    async def run(self) -> None:
        """Until the run ends: its lines, then the result."""
        for line in where_lines(self.barrier, self.url):
            self.printer.message(line)
        if (line := resumed_line(self.barrier)) is not None:
            self.printer.message(line)
        while not self.barrier.done.is_set():
            self.look()
            try:
                await asyncio.wait_for(self.barrier.done.wait(), EVERY_S)
            except TimeoutError:
                pass
        self.look(final=True)
        self.printer.message(end_line(self.barrier, self.barrier.recorder.origin))
