"""`mosaicd sweep SPEC --jobs N`: N runs of a sweep at once on this machine, each in a process of its own.

Each run is a `sweep_worker` process given the run's ticket; it reports its rounds as JSON lines on its stdout,
which the sweep reads into its one progress view. The results are those of the runs one after another: a run's
models depend on its settings alone (`--threads` fixes its torch threads), not on what runs beside it.

Ctrl-C (or SIGTERM) reaches the sweep alone (the workers run in process groups of their own, away from the
terminal's signals): it stops starting runs, passes one SIGINT to every worker, which ends its run as Ctrl-C
ends `simulate` (an unfinished simulation keeps its checkpoint, for the same command to continue), and waits for
them, saying so, up to `STOP_DEADLINE_S` before it kills what is left.

A run whose settings ask for `--device cuda` (no index) gets one GPU: CUDA_VISIBLE_DEVICES names one of the
GPUs this sweep sees (its own CUDA_VISIBLE_DEVICES, else every GPU torch counts), round robin over the slots.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mosaicd.experiments.sweep_runs import Run, SweepBook
from mosaicd.experiments.sweep_worker import round_progress, write_ticket
from mosaicd.progress import RoundProgress

STOP_DEADLINE_S = 120.0


def default_jobs(mode: str, threads: int, nodes: int, cores: int | None = None) -> int:
    """Runs at once that the cores allow: a simulation takes `threads` cores, a cluster one per node."""
    cores = cores or os.cpu_count() or 1
    each = max(1, threads) if mode == "simulate" else max(1, nodes)
    return max(1, cores // each)


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them: its own list, else torch's count."""
    environ = os.environ if environ is None else environ
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_for(device: str, slot: int, gpus: list[str]) -> str | None:
    """The CUDA_VISIBLE_DEVICES of a run in `slot` (0 .. jobs-1): one GPU, round robin, for `--device cuda`;
    None (leave the environment alone) for the CPU, an explicit `cuda:N`, or where no GPU is seen."""
    if device != "cuda" or not gpus:
        return None
    return gpus[slot % len(gpus)]


@dataclass
class _Worker:
    run: Run
    slot: int
    process: subprocess.Popen[str]
    started: float = field(default_factory=time.monotonic)
    end: dict[str, Any] | None = None
    buffer: str = ""


class _Pool:
    def __init__(self, book: SweepBook, jobs: int, timeout: float | None,
                 on_round: Callable[[Run, RoundProgress], None] | None) -> None:
        self.book, self.jobs, self.timeout, self.on_round = book, jobs, timeout, on_round
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, _Worker] = {}  # by stdout fd
        self.gpus: list[str] | None = None

    def free_slot(self) -> int:
        taken = {w.slot for w in self.workers.values()}
        return next(i for i in range(self.jobs) if i not in taken)

    def start(self, run: Run) -> None:
        spec = self.book.spec
        self.book.start(run)
        ticket = write_ticket(spec.out, run, spec.mode, self.timeout)
        slot = self.free_slot()
        env = dict(os.environ)
        if run.settings.device == "cuda":
            if self.gpus is None:
                self.gpus = visible_gpus()
            gpu = gpu_for(run.settings.device, slot, self.gpus)
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
        err = open(ticket.with_suffix(".err"), "w")
        try:
            process = subprocess.Popen([sys.executable, "-m", "mosaicd.experiments.sweep_worker", str(ticket)],
                                       stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                       env=env, process_group=0)
        finally:
            err.close()
        assert process.stdout is not None
        os.set_blocking(process.stdout.fileno(), False)
        worker = _Worker(run, slot, process)
        self.workers[process.stdout.fileno()] = worker
        self.selector.register(process.stdout, selectors.EVENT_READ, worker)

    def read(self, wait: float) -> list[_Worker]:
        """Take in the workers' lines for up to `wait` seconds; the workers whose output ended."""
        ended: list[_Worker] = []
        for key, _ in self.selector.select(timeout=wait):
            worker: _Worker = key.data
            stream: IO[str] = key.fileobj  # type: ignore[assignment]
            chunk = stream.read()
            if chunk:
                worker.buffer += chunk
                *lines, worker.buffer = worker.buffer.split("\n")
                for line in lines:
                    self.line(worker, line)
            elif chunk == "":  # end of file: the worker exited (or closed its stdout)
                self.selector.unregister(stream)
                ended.append(worker)
        return ended

    def line(self, worker: _Worker, text: str) -> None:
        try:
            line = json.loads(text)
        except ValueError:
            return  # not one of its lines (a library's print): its stderr file and run.log hold the rest
        if "end" in line:
            worker.end = line
            return
        p = round_progress(line)
        self.book.printer.on_round(p, worker.run.name)
        if self.on_round is not None:
            self.on_round(worker.run, p)

    def finish(self, worker: _Worker) -> bool:
        """The worker's run ended: record it; whether it finished."""
        assert worker.process.stdout is not None
        del self.workers[worker.process.stdout.fileno()]
        code = worker.process.wait()
        worker.process.stdout.close()
        end = worker.end or {}
        err = self._err(worker)
        if code == 0 and err.is_file() and not err.stat().st_size:
            err.unlink()
        if code == 0 and end.get("end") == "done":
            summary = json.loads((worker.run.folder(self.book.spec.out) / "summary.json").read_text())
            self.book.done(worker.run, summary)
            return True
        if code == 130 or end.get("end") == "interrupted":
            raise KeyboardInterrupt
        error = end.get("error") or f"its process exited {code}: {_tail(self._err(worker))}"
        self.book.fail(worker.run, error)
        return False

    def _err(self, worker: _Worker) -> Path:
        return self.book.spec.out / ".sweep" / f"{worker.run.name}.err"

    def stop(self) -> None:
        """Ctrl-C: one SIGINT to every worker, then wait for them (saying so), then kill what is left."""
        going = list(self.workers.values())
        if not going:
            return
        for worker in going:
            _signal(worker.process, signal.SIGINT)
        names = ", ".join(w.run.name for w in going)
        self.book.printer.message(f"sweep: stopping {len(going)} run{'s' * (len(going) != 1)} ({names}): waiting "
                                  f"up to {STOP_DEADLINE_S:g}s for each to save its state", always=True)
        deadline = time.monotonic() + STOP_DEADLINE_S
        for worker in going:
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.book.printer.message(f"sweep: {worker.run.name} did not stop within {STOP_DEADLINE_S:g}s: "
                                          "killed (the next sweep redoes or continues it)", always=True)
                _signal(worker.process, signal.SIGKILL)
                worker.process.wait()
        self.selector.close()


def _signal(process: subprocess.Popen[str], number: int) -> None:
    try:
        os.killpg(process.pid, number)  # the worker and whatever it started (a cluster's nodes)
    except ProcessLookupError:
        pass


def _tail(path: Path, chars: int = 400) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no output)"
    return text[-chars:].replace("\n", " | ") or "(no output)"


def run_at_once(book: SweepBook, jobs: int, keep_going: bool, timeout: float | None,
                on_round: Callable[[Run, RoundProgress], None] | None) -> None:
    """Run `book.to_run`, `jobs` at a time, until all ended, a failure stops it (without `keep_going`: the runs
    going on finish, none starts) or Ctrl-C (KeyboardInterrupt, re-raised once every worker has stopped)."""
    pool = _Pool(book, jobs, timeout, on_round)
    waiting = deque(book.to_run)
    stopping = False
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while waiting or pool.workers:
            while waiting and not stopping and len(pool.workers) < jobs:
                pool.start(waiting.popleft())
            for worker in pool.read(0.5):
                if not pool.finish(worker) and not keep_going and not stopping:
                    stopping = True
                    book.stop_at_failure(len(waiting))
    except KeyboardInterrupt:
        pool.stop()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
