"""`mosaicd simulate` and `mosaicd cluster` on a GPU (issue 59, item 6): the figures a GPU run gives, prepared so that
a machine with one runs it as it is; on the CPU (`--device cpu --small`) it runs in CI to keep it working.

Cases, each run in a fresh process (`simulate` or `cluster`, as the commands run them) on `--device`:

- digits: `simulate` exact and `--batched` (16 nodes, K=4, s=4, H=5);
- teacher: `simulate` exact and `--batched` at 1,000 nodes (K=4, s=4, H=5, Dirichlet 0.3, as bench/scale.py);
- wide: a model of ResNet-18's size, exact and `--batched` (8 nodes, K=4, s=4, H=1). No ResNet task exists in
  the project (and nothing is downloaded here): the student is `WideTeacher` below, an MLP of 11,088,778 values
  (ResNet-18 for 10 classes has 11.2M) on the teacher task's data, loaded as a task of one's own
  (`--task bench/gpu.py:WideTeacher`). Its time is matrix products, not convolutions: a ResNet's would differ;
- cluster: `mosaicd cluster` of the digits case, every node process on the one GPU; its models are compared
  with the exact `simulate`'s on the same device (`cluster == simulate`: the project's bit-for-bit promise, there).

On the CPU, `--batched` stacks only MLPs (the teacher, the wide model): digits' CNN trains one model after
another there (`TorchTask.stacked_train`), so its pair measures the same thing twice; on a GPU every model stacks.

Figures per case: wall seconds, seconds per round (the median round between the first, which pays the warm-up,
and the last, which evaluates), microseconds per node-round, the peak memory of the run's processes (resident,
summed over its process tree, sampled: pages shared between processes count in each) and on a GPU the device
memory in use (nvidia-smi, less what was in use before) and torch's peak allocation of a `simulate`; per pair,
the batched speed-up (exact's seconds per round over batched's) and the gap of the final metrics. With
`--cpu-reference` each exact `simulate` case runs on the CPU too, in the same run, and the device's speed-up over
it is given. A case that fails is said and the others still run; the script then exits 1.

    python bench/gpu.py                          # on a GPU (default device: cuda where torch sees one, else cpu)
    python bench/gpu.py --device cpu --small     # the CI size: every case, a few rounds
    python bench/gpu.py --cases digits,cluster --cpu-reference --json gpu.json

The table goes to stdout, the figures to `--json` (default gpu-figures.json) and, as the last line of stdout, JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from torch import nn

from mosaicd.experiments.cluster import POLL_S
from mosaicd.learning.tasks.teacher import CLASSES, DIM, TeacherTask

HERE = Path(__file__).resolve()
MIB = 1024 * 1024
WIDE = 2048  # WideTeacher's width for ResNet-18's size; --small uses SMALL_WIDE
SMALL_WIDE = 64


class WideTeacher(TeacherTask):
    """The teacher task's data, learnt by an MLP of ResNet-18's size at the default width (32 -> w -> 2w -> 5w/16
    -> 10: 11,088,778 values at w=2048); `--task-option width=N` scales it."""

    name = "teacher-wide"

    def __init__(self, run: Any, data_dir: Path, width: int = WIDE) -> None:
        super().__init__(run, data_dir)
        self.width = int(width)

    def build_model(self) -> nn.Module:
        return wide_model(self.width)


def wide_model(w: int) -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, w), nn.ReLU(), nn.Linear(w, 2 * w), nn.ReLU(), nn.Linear(2 * w, 5 * w // 16),
                         nn.ReLU(), nn.Linear(5 * w // 16, CLASSES))


def cases(small: bool, rounds: int | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
    """The cases by name: (command, settings); a `-batched` case is its exact one with --batched."""
    rounds = rounds or (4 if small else 10)
    digits = dict(task="digits", nodes=4 if small else 16, fragments=4, fanout=2 if small else 4,
                  local_steps=1 if small else 5, rounds=rounds, eval_every=rounds)
    teacher = dict(task="teacher", nodes=32 if small else 1000, fragments=4, fanout=2 if small else 4,
                   local_steps=1 if small else 5, lr=0.1, partition="dirichlet", alpha=0.3, rounds=rounds,
                   eval_every=rounds)
    wide = dict(task=f"{HERE}:WideTeacher", task_options={"width": SMALL_WIDE if small else WIDE},
                nodes=4 if small else 8, fragments=4, fanout=2 if small else 4, local_steps=1, rounds=rounds,
                eval_every=rounds)
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, settings in (("digits", digits), ("teacher", teacher), ("wide", wide)):
        found[name] = ("simulate", settings)
        found[f"{name}-batched"] = ("simulate", {**settings, "batched": True})
    found["cluster"] = ("cluster", digits)
    return found


CHILD = r"""
import json, sys, time
command, out, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
from mosaicd.settings import Settings
marks = []
def on_round(progress):
    marks.append((progress.round, time.perf_counter()))
run = Settings.load(**settings, out=out)
started = time.perf_counter()
if command == "simulate":
    from mosaicd.experiments.simulate import run_simulation
    summary = run_simulation(run, progress=False, on_round=on_round)
else:
    from mosaicd.experiments.cluster import run_cluster
    summary = run_cluster(run, progress=False, on_round=on_round)
wall = time.perf_counter() - started
torch_peak = None
if "torch" in sys.modules and settings.get("device", "cpu").startswith("cuda"):
    import torch
    torch_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None
final = summary.get("final") or {}
print(json.dumps({"status": summary.get("status"), "wall_s": wall, "marks": marks, "torch_peak_mib": torch_peak,
                  "node_average": final.get("node_average"), "average_model": final.get("average_model"),
                  "models_sha256": summary.get("models_sha256"), "metric": final.get("metric")}))
"""


def gpu_used_mib() -> float | None:
    """Device memory in use on GPU 0 (nvidia-smi), or None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def tree_rss_mib(root: int) -> float:
    """Resident memory of `root` and its descendants (/proc), in MiB."""
    from procstat import stat_fields  # here, not at the top: a run's processes import this file as a task's

    parents, rss = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(f"/proc/{entry}/stat")
            if fields is not None:
                parents[int(entry)], rss[int(entry)] = int(fields[1]), int(fields[21])
    members, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in members} - members
        grew, members = bool(more), members | more
    return sum(rss.get(pid, 0) for pid in members) * os.sysconf("SC_PAGE_SIZE") / MIB


class Sampler:
    """The peak of a process tree's resident memory and of the GPU's memory in use, sampled while it runs."""

    def __init__(self, pid: int, gpu: bool, every: float = 0.2) -> None:
        self.pid, self.gpu, self.every = pid, gpu, every
        self.rss_mib, self.gpu_mib = 0.0, None
        self.base = gpu_used_mib() if gpu else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rss_mib = max(self.rss_mib, tree_rss_mib(self.pid))
            used = gpu_used_mib() if self.gpu else None
            if used is not None and self.base is not None:
                self.gpu_mib = max(self.gpu_mib or 0.0, used - self.base)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class CaseFailed(Exception):
    """A case that did not finish: the others still run (a GPU's time is short), the script exits 1 at the end."""


def run_case(command: str, settings: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    """One case in a fresh interpreter; its figures, or CaseFailed with the child's error."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, command, str(out), json.dumps(settings)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(child.pid, str(settings.get("device", "cpu")).startswith("cuda"))
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise CaseFailed(f"ran past {timeout:.0f} s") from None
    finally:
        sampler.stop()
    if child.returncode != 0 or not stdout.strip():
        raise CaseFailed(f"exit {child.returncode}: {stderr[-3000:]}")
    got = json.loads(stdout.strip().splitlines()[-1])
    if got["status"] != "finished":
        raise CaseFailed(f"the run ended {got['status']}: {stderr[-3000:]}")
    rounds, nodes = int(settings["rounds"]), int(settings["nodes"])
    marks = sorted(got.pop("marks"))
    if command == "cluster":
        per_round, per_round_from = cluster_per_round(marks, got["wall_s"], rounds)
    else:
        times = [t for _, t in marks]
        between = [b - a for a, b in zip(times[:-1], times[1:], strict=True)][:-1]  # rounds 1 .. R-2
        per_round, per_round_from = statistics.median(between), "median between rounds"
    return {**got, "wall_s": round(got["wall_s"], 3), "s_per_round": round(per_round, 6),
            "s_per_round_from": per_round_from,
            "us_per_node_round": round(1e6 * per_round / nodes, 1), "rss_peak_mib": round(sampler.rss_mib, 1),
            "gpu_mib": None if sampler.gpu_mib is None else round(sampler.gpu_mib, 1),
            "torch_peak_mib": None if got["torch_peak_mib"] is None else round(got["torch_peak_mib"], 1)}


def cluster_per_round(marks: list[tuple[int, float]], wall_s: float, rounds: int) -> tuple[float, str]:
    """A cluster's seconds a round, and how they were had. Its rounds are marked as its launcher sees them, every
    `POLL_S` or so: the rounds one look finds are marked microseconds apart, so only each look's last round keeps
    its time, and the figure is the slope between the first look and the last. The last round is left out: it is
    reported once the run's final evaluation and summary are written. With fewer than two looks, the run's wall
    time over its rounds (start-up and end included)."""
    marks = [m for m in marks if m[0] < rounds - 1]
    looks = [m for i, m in enumerate(marks) if i + 1 == len(marks) or marks[i + 1][1] - m[1] > POLL_S / 4]
    if len(looks) >= 2 and looks[-1][0] > looks[0][0]:
        return (looks[-1][1] - looks[0][1]) / (looks[-1][0] - looks[0][0]), f"slope over {len(looks)} looks"
    return wall_s / rounds, "wall time / rounds"


def model_values(small: bool) -> int:
    """The number of values of the wide case's model."""
    return sum(p.numel() for p in wide_model(SMALL_WIDE if small else WIDE).parameters())


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N [default: cuda where torch sees one, "
                        "else cpu]")
    parser.add_argument("--small", action="store_true", help="the CI size: a few nodes and rounds, a narrow wide "
                        "model (every case still runs)")
    parser.add_argument("--cases", default=None, help="comma-separated case names [default: all: "
                        + ", ".join(cases(False)) + "]")
    parser.add_argument("--cpu-reference", action="store_true", help="each exact simulate case on the CPU too: "
                        "the device's speed-up over it")
    parser.add_argument("--json", type=Path, default=Path("gpu-figures.json"), help="where the figures go "
                        "[default: gpu-figures.json]")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every case [default: 10; --small: 4]; "
                        "at least 3 (the first warms up, the last evaluates)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take [default: 600]")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.rounds is not None and args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: at least 3 (the first warms up, the last evaluates)")
    known = cases(args.small, args.rounds)
    names = list(known) if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--cases {unknown[0]}: no such case (the cases: {', '.join(known)})")
    if device != "cpu":
        try:
            from mosaicd.learning.tasks.torch_util import check_device

            check_device(device)
        except ValueError as exc:
            parser.error(str(exc))
    gpu_name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    print(f"device {device}{f' ({gpu_name})' if gpu_name else ''}, torch {torch.__version__}, "
          f"{'small' if args.small else 'full'} size; wide model: {model_values(args.small):,} values", flush=True)
    print(f"{'case':<16} {'command':<9} {'nodes':>6} {'wall s':>8} {'s/round':>9} {'us/node-round':>14} "
          f"{'RSS MiB':>9} {'GPU MiB':>9} {'torch MiB':>10}  metric", flush=True)
    with tempfile.TemporaryDirectory(prefix="mosaic-gpu-") as tmp:
        for name in names:
            command, settings = known[name]
            runs = [(name, device)] + ([(f"{name}@cpu", "cpu")] if args.cpu_reference and command == "simulate"
                                       and not settings.get("batched") and device != "cpu" else [])
            for label, on in runs:
                try:
                    got = run_case(command, {**settings, "device": on}, Path(tmp) / label.replace("@", "-"),
                                   args.timeout)
                except CaseFailed as exc:
                    failed[label] = str(exc)
                    print(f"{label:<16} {command:<9} {settings['nodes']:>6} failed: {exc}", flush=True)
                    continue
                results[label] = {"command": command, "device": on, "nodes": settings["nodes"],
                                  "rounds": settings["rounds"], **got}
                print(f"{label:<16} {command:<9} {settings['nodes']:>6} {got['wall_s']:>8.2f} "
                      f"{got['s_per_round']:>9.4f} {got['us_per_node_round']:>14.1f} {got['rss_peak_mib']:>9.0f} "
                      f"{fmt(got['gpu_mib'], '9.0f'):>9} {fmt(got['torch_peak_mib'], '10.0f'):>10}  "
                      f"{got['metric']} {fmt(got['node_average'], '.4f')}", flush=True)
    ratios: dict[str, Any] = {}
    for name in names:
        exact, batched, cpu = results.get(name), results.get(f"{name}-batched"), results.get(f"{name}@cpu")
        if exact and batched:
            ratios[f"{name}: batched speed-up (exact s/round / batched s/round)"] = round(
                exact["s_per_round"] / batched["s_per_round"], 2)
            ratios[f"{name}: batched final gap (node-average)"] = abs(exact["node_average"] - batched["node_average"])
        if exact and cpu:
            ratios[f"{name}: {device} speed-up over cpu (s/round)"] = round(cpu["s_per_round"] / exact["s_per_round"],
                                                                            2)
    if "cluster" in results and "digits" in results:
        ratios["cluster == simulate (digits, same models bit for bit)"] = (
            results["cluster"]["models_sha256"] == results["digits"]["models_sha256"])
        ratios["cluster s/round / simulate s/round (digits)"] = round(
            results["cluster"]["s_per_round"] / results["digits"]["s_per_round"], 2)
    print()
    for key, value in ratios.items():
        print(f"{key}: {value}")
    figures = {"device": device, "gpu": gpu_name, "torch": torch.__version__, "small": args.small,
               "wide_model_values": model_values(args.small), "cases": results, "failed": failed, "ratios": ratios,
               "bench_s": round(time.perf_counter() - started, 1)}
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    if failed:
        raise SystemExit(f"bench/gpu.py: {len(failed)} case(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
