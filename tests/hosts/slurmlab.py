"""A one-machine Slurm cluster for tests: munged, slurmctld and slurmd from Debian's packages (slurm-wlm, munge),
with every file in one folder and every daemon reached on 127.0.0.1.

    with SlurmLab(tmp_path, cpus=8) as slurm:      # writes slurm.conf, starts the three daemons, waits for `idle`
        slurm.sbatch("--wait", "-n", "4", "script.sh", env=...)
        slurm.scancel(job)

The node is called `localhost` (NodeAddr 127.0.0.1, slurmd -N localhost), so the names that jobs see in
SLURM_JOB_NODELIST resolve to loopback on any machine; the controller is this machine's short hostname at
127.0.0.1 (slurmctld refuses to run under another name). The ports are free ones picked at start; the munge key is
made here, and `SLURM_CONF` (in `env()`) points the client commands at this cluster, so nothing of the machine's
own /etc/slurm or /etc/munge is read or touched. `close()` cancels every job, then stops slurmd, slurmctld and
munged (TERM, then KILL) — always, as a context manager.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from mosaicd.experiments.cluster import ephemeral_start, free_ports

TOOLS = {"munged": "munge", "munge": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm",
         "sbatch": "slurm-wlm", "scontrol": "slurm-wlm", "scancel": "slurm-wlm", "sinfo": "slurm-wlm"}


class SlurmError(RuntimeError):
    """The lab could not start, or a Slurm command failed (with its output)."""


def missing() -> str | None:
    """Why a Slurm lab cannot run here (None: it can): root and the daemons' packages."""
    if os.geteuid() != 0:
        return "slurmd needs root"
    for tool, package in TOOLS.items():
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package}; .ci/run does)"
    return None


def require_slurm() -> None:
    """Skip the calling test, saying what is missing; fail it instead under MOSAIC_REQUIRE_SLURM=1 (CI)."""
    from needs import lacking  # tests/needs.py (on the path under pytest)

    why = missing()
    if why:
        lacking("SLURM", why)


def free_port_range(count: int, low: int = 20000, high: int | None = None) -> int:
    """A base port b in [low, high) with b .. b+count-1 all free on 127.0.0.1 now: below the ephemeral range, where
    outgoing connections take their ports (`high`: 30000, or the host's ephemeral start where that is lower)."""
    high = min(30000, ephemeral_start()) if high is None else high
    for _ in range(200):
        base = random.randrange(low, high - count)
        try:
            socks = []
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SlurmError(f"no {count} free consecutive ports in {low}..{high}")


class SlurmLab:
    def __init__(self, folder: Path, cpus: int = 8) -> None:
        self.dir = folder
        self.cpus = cpus
        self.conf = folder / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> SlurmLab:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOSAIC_"))}
        return {**base, "SLURM_CONF": str(self.conf), **extra}

    def start(self) -> None:
        d = self.dir
        for sub in ("munge", "ctld", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "munge").chmod(0o711)  # munged wants its socket's folder searchable by everyone
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = d / "munge" / "munge.sock"
        self._daemon("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                                f"--pid-file={d / 'munge' / 'munged.pid'}", f"--seed-file={d / 'munge' / 'seed'}",
                                f"--log-file={d / 'log' / 'munged.log'}"])
        self._wait(lambda: subprocess.run(["munge", "-S", str(self.munge_socket), "-n"], capture_output=True,
                                          timeout=10).returncode == 0, 20, "munged to answer")
        ctld_port, slurmd_port = free_ports(2)
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(f"""\
ClusterName=mosaiclab
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'ctld' / 'slurmctld.pid'}
SlurmdPidFile={d / 'spool' / 'slurmd.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait=20
NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=lab Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        env = self.env()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)], env)
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", "localhost"], env)
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", 60,
                   "the node to be idle")

    def _daemon(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        try:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=env, start_new_session=True)
        finally:
            log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmError(f"waiting for {what}: " + (f"{dead} exited" if dead else f"not within {timeout:g}s")
                                 + "\n" + self.logs())
            time.sleep(0.3)

    def logs(self, chars: int = 1500) -> str:
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or self.env(),
                              stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done

    def job_state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)."""
        return self._job_fields(job)[0].get("JobState", "UNKNOWN")

    def _job_fields(self, job: str) -> tuple[dict[str, str], str]:
        """`scontrol show job`'s JobState and ExitCode fields, and its whole text (for an error)."""
        text = self.run("scontrol", "show", "job", job, check=False).stdout
        return dict(f.split("=", 1) for f in text.split() if f.startswith(("JobState=", "ExitCode="))), text

    def job_end(self, job: str, timeout: float = 60) -> tuple[str, str]:
        """The job's final state and exit code ("143:0"). A cancelled job is CANCELLED at once but COMPLETING, with
        exit code 0:0, until its batch script has ended (and `sbatch --wait` may poll in that moment)."""
        deadline = time.monotonic() + timeout
        while True:
            fields, text = self._job_fields(job)
            state = fields.get("JobState", "UNKNOWN")
            if state not in ("PENDING", "RUNNING", "COMPLETING", "UNKNOWN"):
                return state, fields.get("ExitCode", "")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} still {state} {timeout:.0f} s on: {text[-1500:]}")
            time.sleep(0.1)

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def close(self) -> None:
        """Cancel every job of this cluster (and wait for them to go), then stop the daemons."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                jobs = self.jobs()
                if jobs:
                    self.run("scancel", *jobs, check=False)
                    deadline = time.monotonic() + 40
                    while self.jobs() and time.monotonic() < deadline:
                        time.sleep(0.5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
