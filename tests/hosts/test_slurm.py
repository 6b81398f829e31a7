"""deploy/slurm/mosaic.sbatch against a real Slurm: munged, slurmctld and slurmd from Debian's packages on this
machine (tests/hosts/slurmlab.py), one node `localhost` running several tasks.

- a run as one job: `sbatch --wait` returns 0, rank 0 (the first peer in sorted order) wrote the results to the
  shared MOSAIC_OUT, and the model hashes equal `mosaicd simulate`'s with the same settings;
- a run that cannot start (--fanout too large): `sbatch --wait` returns non-zero and summary.json says why;
- `scancel` mid-run: the job ends CANCELLED with the script's exit code 143, summary.json says "interrupted" (a
  person stopped it, not a failure: resumable), no task is left.

Root, slurm-wlm and munge are needed; without them the tests skip, or fail under MOSAIC_REQUIRE_SLURM=1 (.ci/run).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pageblocks import SLURM_PAGE, block
from slurmlab import SlurmLab, free_port_range, require_slurm

from mosaicd.experiments.sweep_runs import model_hashes

pytestmark = [pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "mosaic.sbatch"
TASKS = 4
RUN = ["--task", "quadratic", "--fragments", "2", "--fanout", "2", "--eval-every", "4", "--seed", "3",
       "--dim", "64", "--round-deadline", "60", "--request-timeout", "10", "--log-json"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    require_slurm()
    with SlurmLab(tmp_path_factory.mktemp("slurm"), cpus=2 * TASKS) as lab:
        yield lab


def job_env(slurm: SlurmLab, out: Path) -> dict[str, str]:
    """What the submitting user's shell holds: mosaicd on PATH, the results folder, loopback addresses."""
    return slurm.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", MOSAIC_OUT=str(out),
                     MOSAIC_HOST="127.0.0.1", MOSAIC_PORT_BASE=str(free_port_range(TASKS)))


def sbatch(slurm: SlurmLab, out: Path, args: list[str], *sbatch_args: str) -> list[str]:
    out.parent.mkdir(parents=True, exist_ok=True)  # where the job's own log goes
    return ["sbatch", "--parsable", "--nodes", "1", "--ntasks", str(TASKS), "--cpus-per-task", "1",
            "--output", str(out.parent / f"{out.name}-job-%j.log"), *sbatch_args, str(SCRIPT), *args]


def read_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def simulated_hashes(kit, summary: dict, tmp: Path) -> dict[str, str]:
    """`mosaicd simulate` with the run's settings (as summary.json records them)."""
    from mosaicd.settings import Settings

    run = {k: v for k, v in Settings.model_validate(summary["settings"]).run_fields().items() if v is not None}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    subprocess.run([sys.executable, "-m", "mosaicd", "simulate", *kit.flags(run), "--out", str(tmp), "--quiet"],
                   check=True, env=env, capture_output=True, timeout=300)
    return json.loads((tmp / "summary.json").read_text())["model_sha256"]


def job_log(out: Path) -> str:
    logs = (sorted(out.parent.glob(f"{out.name}-job-*.log")) + sorted(out.parent.glob("mosaic-*.log"))
            + sorted((out / "logs").glob("task-*.log")))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in logs)


def test_a_run_as_one_job_equals_simulate(kit, slurm: SlurmLab, tmp_path: Path) -> None:
    """deploy/slurm/README.md's first run, its block as written (pageblocks.py): only the paths substituted."""
    out, rounds = tmp_path / "shared" / "run", 8
    out.parent.mkdir(parents=True)
    paths = {"/shared/mosaic/.venv/bin": str(Path(sys.executable).parent), "/shared/runs/first": str(out),
             "deploy/slurm/": f"{SCRIPT.parent}/"}
    text = block(SLURM_PAGE, "slurm-first-run", **paths)
    done = subprocess.run(["bash", "-c", text], env=job_env(slurm, out), cwd=out.parent, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.stdout.split()[-1] == "0", f"{done.stdout}{done.stderr}\n{job_log(out)}\n{slurm.logs()}"
    job = done.stdout.split("Submitted batch job ")[1].split()[0]
    assert slurm.job_state(job) == "COMPLETED"
    assert "--export=ALL" in text and f"--rounds {rounds}" in text

    summary = read_summary(out)
    assert summary["status"] == "finished" and summary["dropped"] == [], summary.get("error")
    assert summary["settings"]["nodes"] == TASKS
    peers = (out / "peers.txt").read_text().split()
    base = int(peers[0].rsplit(":", 1)[1])
    assert peers == [f"localhost:{base + i}" for i in range(TASKS)]  # one port per local task
    with open(out / "nodes.csv", newline="") as f:
        seen = {(int(r["round"]), int(r["node"])) for r in csv.DictReader(f)}
    assert seen == {(t, i) for t in range(rounds) for i in range(TASKS)}
    assert sorted(summary["model_sha256"], key=int) == [str(i) for i in range(TASKS)]
    assert summary["model_sha256"] == simulated_hashes(kit, summary, tmp_path / "simulated")
    assert sorted(p.name for p in (out / "logs").glob("task-*.log")) == [f"task-{i}.log" for i in range(TASKS)]
    assert not list(out.glob(".secret-*")), "the job's own secret is removed when it ends"


def test_an_asynchronous_run_as_one_job_finishes_with_every_member_s_steps(slurm: SlurmLab, tmp_path: Path) -> None:
    """`--sync async` through the same script: the members run as an asynchronous peer list (no barrier), rank 0
    collects their reports into the shared MOSAIC_OUT and writes summary.json; the job ends 0."""
    out = tmp_path / "shared" / "async"
    args = ["--sync", "async", "--task", "quadratic", "--fragments", "2", "--fanout", "2", "--rounds", "30",
            "--eval-every", "10", "--seed", "3", "--dim", "64", "--request-timeout", "10", "--log-json"]
    done = slurm.run(*sbatch(slurm, out, args, "--wait"), check=False, timeout=300, env=job_env(slurm, out))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{job_log(out)}\n{slurm.logs()}"
    summary = read_summary(out)
    assert summary["status"] == "finished" and summary["dropped"] == [], summary.get("error")
    assert summary["settings"]["sync"] == "async" and summary["asynchronous"]["steps"] == {
        str(i): 30 for i in range(TASKS)}
    assert sorted(summary["model_sha256"], key=int) == [str(i) for i in range(TASKS)]
    assert all((out / "nodes" / str(i) / "model.npy").exists() for i in range(TASKS))
    assert (out / "rounds.csv").read_text().splitlines()[0].startswith("round")


def test_a_run_that_cannot_start_fails_the_job(slurm: SlurmLab, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*RUN, "--rounds", "5", "--fanout", str(TASKS)]  # the last --fanout wins: more than n - 1 peers
    done = slurm.run(*sbatch(slurm, out, args, "--wait"), check=False, timeout=300, env=job_env(slurm, out))
    assert done.returncode != 0, job_log(out)
    summary = read_summary(out)
    assert summary["status"] == "failed", summary
    assert f"--fanout {TASKS} needs at least {TASKS + 1} nodes" in summary["error"], summary["error"]
    assert slurm.job_state(done.stdout.strip().split(";")[0]) == "FAILED"


def test_scancel_ends_the_run_with_an_interrupted_summary(slurm: SlurmLab, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    waiting = subprocess.Popen(sbatch(slurm, out, [*RUN, "--rounds", "1000000", "--eval-every", "2"], "--wait"),
                               env=job_env(slurm, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "summary.json").exists() and read_summary(out).get("final")):  # an evaluation in
            assert waiting.poll() is None and time.monotonic() < deadline, job_log(out)
            time.sleep(0.3)
        jobs = slurm.jobs()
        assert len(jobs) == 1 and slurm.job_state(jobs[0]) == "RUNNING"
        assert read_summary(out)["status"] == "running"
        slurm.run("scancel", jobs[0])
        code = waiting.wait(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
        waiting.wait(timeout=10)
    # Slurm marks the job cancelled at once and takes the script's exit code when the script has ended: a poll of
    # `sbatch --wait` in between reads 0 (deploy/slurm/README.md); the job's record then holds 143
    assert code in (0, 143), job_log(out)
    assert slurm.job_end(jobs[0]) == ("CANCELLED", "143:0"), job_log(out)
    summary = read_summary(out)
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"], summary  # rank 0 stopped the run
    assert summary["model_sha256"] == {} and summary["final"] and summary["progress"]["rounds_done"] > 0, summary
    assert not list(out.glob(".secret-*"))
    ports = {int(p.rsplit(":", 1)[1]) for p in (out / "peers.txt").read_text().split()}

    def open_ports() -> list[str]:
        listening = subprocess.run(["ss", "-Htln"], capture_output=True, text=True).stdout
        return [line for line in listening.splitlines() if any(f"127.0.0.1:{p} " in line for p in ports)]
    # Slurm calls the job CANCELLED at once; its tasks exit moments later: rank 0 once every member has heard
    # that the run failed (it waits 5 s at most), well before KillWait's 20 s (seconds more on a loaded host)
    deadline = time.monotonic() + 15
    while open_ports() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not open_ports(), f"the job's tasks still listen 15 s after scancel: {open_ports()}\n{job_log(out)}"


# ---------------------------------------------------------------------------------------------- sweeps

SWEEP = """
mode = "{mode}"
out = "{out}"
[run]
task = "quadratic"
nodes = {nodes}
dim = 16
eval_every = 50
threads = 1
checkpoint_rounds = 20
{run}
[grid]
{grid}
"""

# Three short runs and a longer one, the run cancelled: it is held (`held`) from its first checkpoint to its
# scancel, so it still runs then however fast the host; its rounds only outlast the moment it takes to hold it.
ARRAY_SWEEP = SWEEP.format(mode="simulate", out="array", nodes=5, run="fragments = 2",
                           grid="rounds = [300, 600, 900, 10000]")


def mosaicd(slurm: SlurmLab, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = slurm.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", MOSAIC_HOST="127.0.0.1",
                    MOSAIC_PORT_BASE=str(free_port_range(8)))
    return subprocess.run([sys.executable, "-m", "mosaicd", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def submissions(out: Path) -> list[dict]:
    return json.loads((out / "slurm" / "submissions.json").read_text())


def without_wall_times(report: str) -> list[list[str]]:
    """report.md's table rows, less the columns of time measured (which differ from one run to the next)."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines() if line.startswith("|")]
    header = next(r for r in rows if any("wall" in c for c in r))
    keep = [i for i, c in enumerate(header) if "wall" not in c and "(s)" not in c]
    return [[r[i] for i in keep if i < len(r)] for r in rows]


def task_processes(task: str) -> list[int]:
    """The processes of Slurm array task `task` (JOB_INDEX) on this host: those whose environment names it. The
    lab's slurmd, which started them, is not among them: its environment names no task."""
    job, _, index = task.partition("_")
    wanted = {f"SLURM_ARRAY_JOB_ID={job}".encode(), f"SLURM_ARRAY_TASK_ID={index}".encode()}
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                environ = set((proc / "environ").read_bytes().split(b"\0"))
            except OSError:  # gone meanwhile
                continue
            if wanted <= environ:
                found.append(int(proc.name))
    return found


@contextlib.contextmanager
def held(pids: list[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) while the block runs, then continued (SIGCONT): a task kept from its end
    whatever this host's speed. A SIGTERM sent to them meanwhile is delivered when they continue."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_sweep_as_a_job_array_equals_the_local_sweep_and_reruns_only_a_cancelled_task(
        kit, slurm: SlurmLab, tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(ARRAY_SWEEP)
    out = tmp_path / "array"
    submitted = mosaicd(slurm, tmp_path, "sweep", str(spec), "--slurm", "--no-wait")
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert "sweep: submitted 4 runs as slurm job " in submitted.stderr, submitted.stderr
    [array] = submissions(out)
    job = array["job"]
    assert sorted(array["runs"].values()) == [f"{job}_{i}" for i in range(4)]  # one array, a run per task
    victim = "rounds=10000"
    kit.wait_until(lambda: (out / "runs" / victim / "simulate-checkpoint.npz").exists(), 120,
                   f"{victim}'s first checkpoint in its Slurm task")
    with held(kit.wait_until(lambda: task_processes(array["runs"][victim]), 30, f"{victim}'s processes")):
        listed = mosaicd(slurm, tmp_path, "sweep", str(spec), "--dry-run")
        assert f"(slurm job {array['runs'][victim]})" in listed.stdout, listed.stdout
        slurm.run("scancel", array["runs"][victim])

    gathered = mosaicd(slurm, tmp_path, "sweep", str(spec))  # waits for the array, gathers, submits nothing
    assert gathered.returncode == 1, gathered.stderr[-3000:]
    result = json.loads(gathered.stdout.splitlines()[-1])
    assert result["failed_runs"] == [victim] and result["done"] == 3, result
    assert "cancelled: the Slurm task got SIGTERM" in gathered.stderr, gathered.stderr[-3000:]
    assert "--slurm` submits it again and it continues from its checkpoint" in gathered.stderr
    assert len(submissions(out)) == 1
    listed = mosaicd(slurm, tmp_path, "sweep", str(spec), "--dry-run")
    assert f"resume   array/runs/{victim}\n" in listed.stdout, listed.stdout
    summary = json.loads((out / "runs" / victim / "summary.json").read_text())
    assert summary["placement"]["slurm_job"] == array["runs"][victim] and summary["placement"]["device"] == "cpu"

    again = mosaicd(slurm, tmp_path, "sweep", str(spec), "--slurm")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["skipped"] == 3
    assert [list(s["runs"]) for s in submissions(out)] == [list(array["runs"]), [victim]]  # only that run again
    with open(out / "slurm" / "events.csv") as f:
        events = [(r["run"], r["state"]) for r in csv.DictReader(f)]
    assert (victim, "UNFINISHED") in events and events.count((victim, "FINISHED")) == 1

    local = mosaicd(slurm, tmp_path, "sweep", str(spec), "--out", "local", "--jobs", "2", "--quiet")
    assert local.returncode == 0, local.stderr[-3000:]
    assert model_hashes(out) == model_hashes(tmp_path / "local") and len(model_hashes(out)) == 4
    runs = json.loads(mosaicd(slurm, tmp_path, "runs", str(out), "--json").stdout)
    # submitit submits a grid of one run as a plain job, not an array of one
    assert {r["slurm_job"] for r in runs} == {*(j for n, j in array["runs"].items() if n != victim),
                                              submissions(out)[1]["runs"][victim]}
    tables = []
    for folder in (out, tmp_path / "local"):
        made = mosaicd(slurm, tmp_path, "report", str(folder))
        assert made.returncode == 0, made.stderr[-2000:]
        tables.append(without_wall_times((folder / "report" / "report.md").read_text()))
    assert tables[0] == tables[1] and len(tables[0]) >= 4


def test_a_cluster_sweep_runs_a_multi_task_job_per_run(slurm: SlurmLab, tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SWEEP.format(mode="cluster", out="jobs", nodes=3, run="rounds = 6",
                                 grid="fragments = [1, 2]\nseed = [3]"))
    done = mosaicd(slurm, tmp_path, "sweep", str(spec), "--slurm", "--slurm-option", "cpus_per_task=1")
    assert done.returncode == 0, done.stderr[-3000:] + job_log(tmp_path / "jobs")
    made = submissions(tmp_path / "jobs")
    assert len(made) == 2 and all(len(s["runs"]) == 1 for s in made)  # a job of 3 tasks per run
    out = tmp_path / "jobs"
    for name in ("fragments=1,seed=3", "fragments=2,seed=3"):
        assert sorted(p.name for p in (out / "runs" / name / "logs").glob("task-*.log")) == \
            [f"task-{i}.log" for i in range(3)]
        summary = json.loads((out / "runs" / name / "summary.json").read_text())
        assert summary["placement"]["slurm_job"] == made[0]["runs"].get(name, \
            made[1]["runs"].get(name))
    local = mosaicd(slurm, tmp_path, "sweep", str(spec), "--out", "local", "--jobs", "1", "--quiet")
    assert local.returncode == 0, local.stderr[-3000:]
    assert model_hashes(out) == model_hashes(tmp_path / "local") and len(model_hashes(out)) == 2
