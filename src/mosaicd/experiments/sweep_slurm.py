"""`mosaicd sweep SPEC --slurm`: the grid's unfinished runs as Slurm jobs, submitted with submitit.

A "simulate" sweep goes in as one job array, a run per array task (`sweep_worker`'s ticket: the run is the same
wherever it starts). A "cluster" sweep goes in as one multi-task job per run, a task per node, each task one
`mosaicd node` on a peer list derived from the job's hosts (as deploy/slurm/mosaic.sbatch does), rank 0 serving
the barrier and writing the run's files.

What it leaves in OUT besides the runs' folders:

    OUT/slurm/submissions.json   every submission: its job id, the runs in it (by array index) and when
    OUT/slurm/events.csv         the timeline the sweep saw while it waited: time, job, run, state
    OUT/slurm/<job>_<task>_*     submitit's files: the batch script, each task's log (.out/.err), its result

A run's summary.json names its job (`"placement": {"slurm_job": "123_4"}`), which `mosaicd runs` shows.

Nothing is retried silently: submitit's requeue (on a preemption signal) is refused by the job's `checkpoint`,
a run that times out or is cancelled (`scancel`: SIGTERM) ends unfinished, with its checkpoint kept, and the same
`mosaicd sweep SPEC --slurm` submits exactly the runs that are not done and not queued or running in Slurm.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaicd.experiments.sweep_runs import Run, Spec, SweepBook, run_state, write_settings
from mosaicd.experiments.sweep_worker import Ticket, read_ticket, run_read, write_ticket
from mosaicd.files import write_whole
from mosaicd.progress import RoundProgress
from mosaicd.settings import SettingsError

SLURM_DIR = "slurm"
POLL_S = 2.0
LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
               "STAGE_OUT", "SIGNALING", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"}


class RunCancelled(Exception):
    """The run's Slurm task got SIGTERM: `scancel`, or its time limit."""


# ---------------------------------------------------------------------------------------------- in the job


class SweepTask:
    """What a Slurm task runs (submitit pickles it by reference): one run of the sweep from its ticket."""

    def __call__(self, ticket: str, first_port: int = 0) -> str:
        read = read_ticket(ticket)
        signal.signal(signal.SIGTERM, _cancelled)  # after submitit's own handlers, which only log SIGTERM
        if read.mode == "cluster":
            return cluster_task(ticket, read, first_port)
        return str(run_read(read).get("status"))

    def checkpoint(self, ticket: str, first_port: int = 0) -> None:
        """submitit asks before it requeues a preempted task: None, so it does not (a person decides)."""
        return None


def _cancelled(signum: int, frame: object) -> None:
    raise RunCancelled(f"cancelled: the Slurm task got SIG{signal.Signals(signum).name.removeprefix('SIG')} "
                       f"(scancel or its time limit) at {time.strftime('%Y-%m-%dT%H:%M:%S')}")


def peer_lines(hosts: list[str], tasks_per_node: int, base: int) -> list[str]:
    """The run's peer list: for each host of the job, in Slurm's order, a line per local task (base + its id)."""
    return [f"{host}:{base + local}" for host in hosts for local in range(tasks_per_node)]


def first_ports(per_run: list[int], environ: dict[str, str] | None = None) -> list[int]:
    """Each cluster run's first port on its hosts (a run's tasks on a host take the next ones): consecutive blocks
    from MOSAIC_PORT_BASE if given, else from a block of 100 drawn at random in 10000-31999 (below Linux's
    ephemeral ports), so that runs of one sweep, or of two, that share a host rarely collide."""
    import random

    environ = os.environ if environ is None else environ
    given = environ.get("MOSAIC_PORT_BASE")
    base = int(given) if given else 10000 + random.randrange(220) * 100
    starts = [base + sum(per_run[:i]) for i in range(len(per_run))]
    if per_run and starts[-1] + per_run[-1] > 65536:
        raise SettingsError(f"MOSAIC_PORT_BASE {base}: the sweep's cluster runs need {sum(per_run)} ports from it, "
                            "past 65535")
    return starts


def cluster_task(ticket: str, read: Ticket, base: int) -> str:
    """One node of a cluster run: `mosaicd node --peer-list` with the run's settings, as mosaic.sbatch runs it."""
    import submitit

    from mosaicd.experiments.cluster import settings_env

    run, out = read.run, read.out
    job = submitit.JobEnvironment()
    per_node = job.num_tasks // job.num_nodes
    peers = "\n".join(peer_lines(list(job.hostnames), per_node, base)) + "\n"
    me = f"{job.hostnames[job.node]}:{base + job.local_rank}"
    folder = run.folder(out)
    peer_file = Path(ticket).with_suffix(f".peers-{job.global_rank}")
    write_whole(peer_file, peers)
    if job.global_rank == 0:
        write_whole(folder / "peers.txt", peers)
    env = settings_env(run.settings, out=str(folder), peer_list=str(peer_file), port=base + job.local_rank,
                       advertise=me, host=os.environ.get("MOSAIC_HOST", "0.0.0.0"), log_json=True,
                       secret_file=str(Path(ticket).with_suffix(".secret")))
    with open(folder / "logs" / f"task-{job.global_rank}.log", "ab") as log:  # as mosaic.sbatch's srun writes
        node = subprocess.Popen([sys.executable, "-m", "mosaicd", "node"], env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        code = node.wait()
    except RunCancelled:  # the node got the same SIGTERM from Slurm: it ends the run and says so
        code = node.wait()
        raise
    finally:
        peer_file.unlink(missing_ok=True)
        if job.global_rank == 0:  # the barrier's node ends last: every node has read the secret long before
            Path(ticket).with_suffix(".secret").unlink(missing_ok=True)
    if code != 0:
        raise RuntimeError(f"mosaicd node ({me}) exited {code}: see {folder / 'logs' / f'task-{job.global_rank}.log'}")
    return "finished"


# ---------------------------------------------------------------------------------------------- submitting


@dataclass
class LiveTask:
    job: str      # `123_4` (an array task) or `124`
    state: str    # squeue's: PENDING, RUNNING, ...


def _option_value(text: str) -> Any:
    return int(text) if text.isdigit() else text


def parse_options(items: list[str]) -> dict[str, Any]:
    """`--slurm-option KEY=VALUE` items: submitit's SlurmExecutor parameters (partition, time in minutes,
    cpus_per_task, gpus_per_node, mem, array_parallelism, account, qos, ...), any other sbatch option by its long
    name (`--slurm-option constraint=a100`, `--slurm-option reservation=x`)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("--").replace("-", "_")
        if not sep or not key:
            raise SettingsError(f"--slurm-option {item}: expected KEY=VALUE (e.g. --slurm-option partition=gpu)")
        options[key] = _option_value(value.strip())
    return options


class SlurmSweep:
    """The sweep's Slurm side: its submissions, what of them is still queued or running, and the waiting."""

    def __init__(self, spec: Spec, book: SweepBook | None = None) -> None:
        self.spec, self._book = spec, book
        self.dir = spec.out / SLURM_DIR

    @property
    def book(self) -> SweepBook:
        assert self._book is not None, "a SlurmSweep made to look at Slurm only"
        return self._book

    # -------------------------------------------------------------------------- what Slurm holds

    def submissions(self) -> list[dict[str, Any]]:
        try:
            return json.loads((self.dir / "submissions.json").read_text())
        except (OSError, ValueError):
            return []

    def _record(self, submission: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_whole(self.dir / "submissions.json", json.dumps([*self.submissions(), submission], indent=1) + "\n")

    def live(self) -> dict[str, LiveTask]:
        """The runs queued or running in Slurm now, by name (squeue: a job it no longer lists has ended)."""
        runs: dict[str, LiveTask] = {}
        for submission in self.submissions():
            states = squeue(submission["job"])
            for name, job in submission["runs"].items():
                state = states.get(job)
                if state in LIVE_STATES:
                    runs[name] = LiveTask(job, state)
        return runs

    # -------------------------------------------------------------------------- submitting

    def submit(self, runs: list[Run], options: dict[str, Any], timeout: float | None) -> list[str]:
        """Submit `runs` (none of them done or live); the job ids."""
        import submitit

        if not runs:
            return []
        for tool in ("sbatch", "squeue"):
            if shutil.which(tool) is None:
                raise SettingsError(f"--slurm: {tool} is not on PATH: run the sweep where Slurm's commands are (a "
                                    "login node of the cluster)")
        name = f"mosaic-sweep-{self.spec.out.name}"
        tickets = {run.name: str(write_ticket(self.spec.out, run, self.spec.mode, timeout).resolve())
                   for run in runs}
        submitted: dict[str, str] = {}
        if self.spec.mode == "simulate":
            executor = _executor(submitit, self.dir, slurm_parameters(name, "simulate", runs, options))
            jobs = executor.map_array(SweepTask(), [tickets[r.name] for r in runs])
            submitted = {run.name: job.job_id for run, job in zip(runs, jobs, strict=True)}
        else:
            parameters = [slurm_parameters(name, "cluster", [run], options) for run in runs]  # all checked first
            ports = first_ports([p["ntasks_per_node"] for p in parameters])
            for run, first_port, asked in zip(runs, ports, parameters, strict=True):
                executor = _executor(submitit, self.dir, asked)
                self._prepare_cluster_run(run, tickets[run.name])
                submitted[run.name] = executor.submit(SweepTask(), tickets[run.name], first_port).job_id
        arrays = sorted({job.split("_")[0] for job in submitted.values()})
        for array in arrays:
            self._record({"job": array, "runs": {n: j for n, j in submitted.items() if j.split("_")[0] == array},
                          "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": self.spec.mode,
                          "options": options})
        for run_name, job in submitted.items():
            self.event(job, run_name, "SUBMITTED")
        return arrays

    def _prepare_cluster_run(self, run: Run, ticket: str) -> None:
        """A cluster run starts from an empty folder with its settings and a secret for its nodes (mode 600)."""
        from mosaicd.daemon.http.auth import write_new_secret

        folder = run.folder(self.spec.out)
        if folder.exists():
            shutil.rmtree(folder)
        (folder / "logs").mkdir(parents=True)
        write_settings(run, folder)
        secret = Path(ticket).with_suffix(".secret")
        secret.unlink(missing_ok=True)
        write_new_secret(secret)

    def event(self, job: str, name: str, state: str) -> None:
        path = self.dir / "events.csv"
        new = not path.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["time", "job", "run", "state"])
            writer.writerow([time.strftime("%Y-%m-%dT%H:%M:%S%z"), job, name, state])

    # -------------------------------------------------------------------------- waiting

    def wait(self, live: dict[str, LiveTask]) -> None:
        """Follow the live runs to their end: each run's rounds from its summary.json, each change of state as a
        line (and a row of events.csv); then the finished ones into grid.csv, the others as failures."""
        book, printer = self.book, self.book.printer
        runs = {r.name: r for r in self.spec.runs}
        seen = {name: task.state for name, task in live.items()}
        started: set[str] = set()
        while True:
            for name, task in live.items():
                if seen.get(name) != task.state:
                    printer.message(f"sweep: {name}: slurm job {task.job} {task.state.lower()}")
                    self.event(task.job, name, task.state)
                    seen[name] = task.state
                if task.state == "RUNNING":
                    if name not in started:
                        started.add(name)
                        book.start(runs[name], elsewhere=True)
                    _follow(printer, runs[name], self.spec.out)
            ended = [name for name in seen if name not in live]
            for name in ended:
                self._gather(runs[name], seen.pop(name), name in started)
            if not seen:
                return
            time.sleep(POLL_S)
            now = self.live()
            live = {n: t for n, t in now.items() if n in seen}

    def _job_of(self, run: Run) -> str | None:
        return next((s["runs"][run.name] for s in reversed(self.submissions()) if run.name in s["runs"]), None)

    def _gather(self, run: Run, last: str, started: bool) -> None:
        state, summary = run_state(run, self.spec.out, self.spec.mode)
        job = self._job_of(run)
        if not started:
            self.book.start(run, elsewhere=True)
        if state == "done" and summary is not None:
            self.event(job or "?", run.name, "FINISHED")
            self.book.done(run, summary)
            return
        self.event(job or "?", run.name, "UNFINISHED")
        self._fail(run, job, state, summary, f"its job ended ({last.lower()} when last seen) without a summary")

    def unfinished(self, run: Run) -> None:
        """A run of this sweep neither done nor in Slurm: a failure, saying why and how to go on."""
        state, summary = run_state(run, self.spec.out, self.spec.mode)
        job = self._job_of(run)
        self.book.start(run, elsewhere=True)
        if job is not None:
            self.event(job, run.name, "UNFINISHED")
        self._fail(run, job, state, summary, "never submitted" if job is None else "no summary")

    def _fail(self, run: Run, job: str | None, state: str, summary: dict[str, Any] | None, otherwise: str) -> None:
        error = (summary or {}).get("error") or otherwise
        self.book.fail(run, (f"slurm job {job}: " if job else "") + f"{error}; `mosaicd sweep {self.spec.path} "
                       "--slurm` submits it again" + (" and it continues from its checkpoint" if state == "resume"
                                                      else ""))


def slurm_parameters(name: str, mode: str, runs: list[Run], options: dict[str, Any]) -> dict[str, Any]:
    """What the job (a simulate sweep's array, or one cluster run) asks Slurm for: the runs' --threads as CPUs per
    task, a GPU per task for `--device cuda` runs (Slurm sets CUDA_VISIBLE_DEVICES), no time limit but the
    partition's; a cluster run a task per node, on `nodes` hosts. The user's --slurm-option values win."""
    cuda = any(r.settings.device.startswith("cuda") for r in runs)
    wanted: dict[str, Any] = {"job_name": name, "time": None, "cpus_per_task": max(r.settings.threads for r in runs)}
    if mode == "cluster":
        [run] = runs
        hosts = int(options.get("nodes", 1))
        if hosts < 1 or run.settings.nodes % hosts:
            raise SettingsError(f"--slurm-option nodes={options.get('nodes')}: a cluster run of {run.settings.nodes} "
                                f"nodes ({run.name}) needs a number of hosts that divides it")
        wanted.update(nodes=hosts, ntasks_per_node=run.settings.nodes // hosts)
    if cuda:
        wanted["gpus_per_task"] = 1
    return {**wanted, **options}


def _executor(submitit: Any, folder: Path, parameters: dict[str, Any]) -> Any:
    """A SlurmExecutor with `parameters`: submitit's own where it knows them, the rest as sbatch options. No
    requeue on a time-out (max_num_timeout 0); the tasks run this Python (the same environment)."""
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=0, python=sys.executable)
    known = executor._valid_parameters()
    extra = {k: v for k, v in parameters.items() if k not in known}
    try:
        executor.update_parameters(**{k: v for k, v in parameters.items() if k in known},
                                   **({"additional_parameters": extra} if extra else {}))
    except ValueError as exc:
        raise SettingsError(f"--slurm-option: {exc}") from None
    return executor


def _follow(printer: Any, run: Run, out: Path) -> None:
    try:
        summary = json.loads((run.folder(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return
    done = (summary.get("progress") or {}).get("rounds_done") or 0
    if done > 0 and summary.get("status") == "running":
        printer.on_round(RoundProgress(done - 1, run.settings.rounds, row=summary.get("final")), run.name)


def squeue(job: str) -> dict[str, str]:
    """The states of a job's tasks (`123_4` -> RUNNING) that Slurm still lists; {} once it lists none."""
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%i|%T"], capture_output=True, text=True,
                              timeout=60)
    except FileNotFoundError:
        raise SettingsError("--slurm: squeue is not on PATH: run the sweep where Slurm's commands are (a login "
                            "node)") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"squeue -j {job} did not answer within 60s: is slurmctld up?") from None
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return {}  # the controller has forgotten it: it ended a while ago
        raise RuntimeError(f"squeue -j {job} exited {done.returncode}: {done.stderr.strip()}")
    states = {}
    for line in done.stdout.splitlines():
        task, _, state = line.partition("|")
        states[task.strip()] = state.strip()
    return states


def run_on_slurm(book: SweepBook, options: dict[str, Any], timeout: float | None, wait: bool,
                 submit: bool) -> None:
    """Submit the runs that are neither done nor live in Slurm (`submit`), then follow every live one (`wait`)."""
    slurm = SlurmSweep(book.spec, book)
    live = slurm.live()
    printer = book.printer
    if live:
        printer.message(f"sweep: {len(live)} run{'s' * (len(live) != 1)} queued or running in Slurm: "
                        + ", ".join(f"{n} ({t.job} {t.state.lower()})" for n, t in live.items()))
    todo = [r for r in book.to_run if r.name not in live]
    if submit:
        jobs = slurm.submit(todo, options, timeout)
        if jobs:
            printer.message(f"sweep: submitted {len(todo)} run{'s' * (len(todo) != 1)} as slurm job"
                            f"{'s' * (len(jobs) != 1)} {', '.join(jobs)} (their logs: {slurm.dir}/)", always=True)
        # a run that ended before squeue is asked is gathered at once
        live = {**{r.name: LiveTask("?", "SUBMITTED") for r in todo}, **slurm.live()}
    else:
        for run in todo:  # ended in Slurm unfinished (cancelled, failed, timed out), or never submitted
            slurm.unfinished(run)
    if not wait:
        if live:
            printer.message(f"sweep: not waiting (--no-wait): `mosaicd sweep {book.spec.path}` shows them and "
                            "gathers the finished", always=True)
        return
    if live:
        printer.message("sweep: waiting for the Slurm jobs (Ctrl-C stops waiting, not the jobs)")
        slurm.wait(live)

