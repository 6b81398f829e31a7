"""The end of an asynchronous run (docs/spec.md, "Asynchronous mode"): the nodes' reports evaluated into rounds.csv
and summary.json, never on the data path.

Each node's report lies in OUT/nodes/<rank>/: `async.json` (its steps, training time, what it counted), `model.npy`
(its final model) and `grid.npz` (its model at each point of the time grid). `cluster --sync async`'s launcher finds
them there (each node's --out is that folder); the collector of a run across hosts fetches them from the members
first (`collect_reports`: rank 0 of a --peer-list, or the barrier of a compose run, `mosaicd barrier --sync async`)
and writes them there. All then call `summarize`. Shared by the node and the barrier roles, so it sits above both.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mosaicd.daemon.http.client import Client, HttpError, Refused
from mosaicd.files import replacing, write_whole
from mosaicd.outputs import RunRecorder, honest_nodes, robustness_summary, stopped_summary
from mosaicd.protocol import nominal_iterations, profile_spec
from mosaicd.settings import Settings

REPORT = "async.json"
MODEL = "model.npy"
GRID = "grid.npz"  # the node's models on the time grid (steps done and model at each point), its final model and report


def node_folder(out: Path, rank: int) -> Path:
    return Path(out) / "nodes" / str(rank)


def write_report(folder: Path, report: dict[str, Any], model: np.ndarray, steps: np.ndarray,
                 models: np.ndarray) -> None:
    """A node's report in `folder`: the report last, so that a reader that finds it finds the model too."""
    folder.mkdir(parents=True, exist_ok=True)
    with replacing(folder / MODEL) as f:
        np.save(f, np.asarray(model, np.float32))
    with replacing(folder / GRID) as f:
        np.savez(f, steps=np.asarray(steps, np.int64), models=np.asarray(models, np.float32),
                 model=np.asarray(model, np.float32), report=np.array(json.dumps(report)))
    write_whole(folder / REPORT, json.dumps(report))


def read_report(out: Path, rank: int) -> dict[str, Any] | None:
    """Node `rank`'s async.json in OUT, None until it is there."""
    path = node_folder(out, rank) / REPORT
    return json.loads(path.read_text()) if path.exists() else None


def _grid(out: Path, finals: dict[int, np.ndarray]) -> list[dict[int, np.ndarray]]:
    """Each point of the time grid: every node's model then (a node finished before it: its final model)."""
    grids = {}
    for rank in finals:
        with np.load(node_folder(out, rank) / GRID) as kept:
            grids[rank] = kept["models"]
    points = max((len(g) for g in grids.values()), default=0)
    return [{r: grids[r][k] if k < len(grids[r]) else finals[r] for r in finals} for k in range(points)]


def summarize(out: Path, settings: Settings, recorder: RunRecorder, reports: dict[int, dict[str, Any]],
              lost: list[int], **notes: Any) -> dict[str, Any]:
    """The reported nodes' models on the time grid and their final ones evaluated: rounds.csv's rows and
    summary.json (`lost`: the ranks given up, `dropped`; `notes`: more of summary.json's keys)."""
    from mosaicd.learning.evaluation import network_metrics
    from mosaicd.learning.tasks import build_task

    s = settings
    run = s.run_config()
    task = build_task(run, s.data_dir)
    vectors = {rank: np.load(node_folder(out, rank) / MODEL) for rank in sorted(reports)}
    honest, says = honest_nodes(run, sorted(reports))
    period = max(n["eval_period_s"] for n in reports.values())
    last = -1
    for k, models in enumerate(_grid(out, vectors), start=1):  # rows as simulate's: `round` the iterations
        last = k * s.eval_every - 1  # an unslowed node has done by then, less one; `time_s` the grid's time
        recorder.network_round(last, {**network_metrics(task, [models[i] for i in honest]), "nodes": honest,
                                      **says, "time_s": round(k * period, 6)}, time.time())
    end = max(n["elapsed_s"] for n in reports.values())
    nominal = max(nominal_iterations(run) - 1, last + 1,  # --time-budget: fewer than --rounds
                  math.ceil(end / period - 1e-9) * s.eval_every - 1 if period else 0)
    recorder.network_round(nominal, {**network_metrics(task, [vectors[i] for i in honest]),
                                     "nodes": honest, **says, "time_s": round(end, 6)}, time.time())
    per_node = {str(r): {k: v for k, v in reports[r].items() if k != "rank"} for r in sorted(reports)}
    resumed = {r: n["resumed"] for r, n in per_node.items() if n.get("resumed") is not None}
    return recorder.finish(vectors, members=sorted(reports), dropped=sorted(lost), events=[],
                           asynchronous={"steps": {r: n["steps"] for r, n in per_node.items()},
                                         "elapsed_s": {r: n["elapsed_s"] for r, n in per_node.items()},
                                         "steps_per_s": {r: n["steps_per_s"] for r, n in per_node.items()},
                                         "eval_period_s": period,
                                         **stopped_summary({int(r): n.get("stopped_by")
                                                            for r, n in per_node.items()}),
                                         "signed": all(n["signed"] for n in per_node.values()),
                                         "messages_sent": sum(n["sent"] for n in per_node.values()),
                                         "messages_unsent": sum(n["unsent"] for n in per_node.values()),
                                         "replays_refused": sum(n["replays_refused"] for n in per_node.values()),
                                         "fragments_superseded": sum(n["fragments_superseded"]
                                                                     for n in per_node.values()),
                                         "pairs_averaged": sum(n["averaged"] for n in per_node.values()),
                                         "fragments_stale": sum(n["fragments_stale"] for n in per_node.values()),
                                         "refused_out_of_range": sum(n["out_of_range"] for n in per_node.values()),
                                         **({"resumed": resumed, "resume_exact": False,
                                             "resume_note": "nodes started again went on from their checkpoints "
                                             "(`resumed`: the step each went on from): what they had received or "
                                             "queued since was lost and the others went on meanwhile, so the "
                                             "models are not those of an uninterrupted run"}
                                            if resumed else {})},
                           **notes, **robustness_summary(run))


async def collect_reports(client: Client, url: Callable[[int, str], str], ranks: list[int], out: Path,
                          settings: Settings, log: Any, poll_s: float = 0.2,
                          ) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """The reports of the members `ranks`, fetched (POST /v1/async/result at `url(rank, path)`, signed by the
    collector) and written into OUT/nodes/<rank>: (reports by rank, the ranks given up). A member answers 409
    `running` until it has reported; it is given up once it has not answered for --register-deadline seconds in a
    row (it may be down for good; one restarted meanwhile answers again), or when the run's deadline is past."""
    loop = asyncio.get_running_loop()
    reports: dict[int, dict[str, Any]] = {}
    waiting = set(ranks)
    heard = {r: loop.time() for r in waiting}
    until = loop.time() + run_deadline(settings)
    lost: list[int] = []
    while waiting:
        for rank in sorted(waiting):
            try:
                _, body, _ = await client.request("POST", url(rank, "/v1/async/result"),
                                                  retries=0, timeout=max(5.0, settings.request_timeout))
            except HttpError as exc:
                if isinstance(exc, Refused) and exc.reason == "running":
                    heard[rank] = loop.time()
                elif loop.time() - heard[rank] > settings.register_deadline:
                    lost.append(rank)
                    waiting.discard(rank)
                    log.warning("member_given_up", member=rank, error=str(exc), detail="it did not answer "
                                f"for {settings.register_deadline:g} s (--register-deadline): left out")
                continue
            with np.load(io.BytesIO(body), allow_pickle=False) as kept:
                report = json.loads(str(kept["report"]))
                write_report(node_folder(out, rank), report, kept["model"], kept["steps"], kept["models"])
            reports[rank] = report
            waiting.discard(rank)
        if waiting and loop.time() > until:
            log.warning("members_given_up", members=sorted(waiting), detail="the run's deadline passed")
            lost += sorted(waiting)
            break
        if waiting:
            await asyncio.sleep(poll_s)
    return reports, sorted(lost)


async def tell_end(client: Client, url: Callable[[int, str], str], ranks: list[int], reason: str | None = None,
                   timeout: float = 5.0, retries: int = 1) -> None:
    """POST /v1/async/end to the members `ranks` at once: the run ended, its summary written (no `reason`), or it
    was interrupted (`reason`: the collector was told to stop). One that does not answer is not waited for."""
    body = None if reason is None else {"interrupted": reason}
    await asyncio.gather(*(client.request("POST", url(r, "/v1/async/end"), json_body=body, retries=retries,
                                          timeout=timeout) for r in ranks), return_exceptions=True)


def run_deadline(settings: Settings) -> float:
    """How long the collector waits for the last report at most: every iteration at the slowest node's pace with a
    wide margin (a second an iteration at least), or the --time-budget and its last iteration with as wide a one,
    from the collection's start."""
    spec = profile_spec(settings.run_config())
    slowest = 1.0
    if spec is not None:
        slowest = max(1.0, max(p.train_s(spec.compute_s) for p in spec.resolve(settings.seed, settings.nodes)))
    iterations_s = 4 * settings.rounds * slowest
    if settings.time_budget is not None:
        iterations_s = min(iterations_s, 4 * (settings.time_budget + slowest))
    return settings.register_deadline + iterations_s
