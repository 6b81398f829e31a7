"""What a run leaves behind, identical for `cluster`, `simulate` and compose runs:

    OUT/summary.json   status ("running", "finished", "failed" or "interrupted" with its "error"), settings,
                       progress (rounds done of the run's), "final": the newest evaluation row (the last one
                       once the run ended), and at the end model_sha256 per node; small, the same size at round
                       10 as at round 10,000; past LISTED_NODES nodes, counts instead of per-node lists (see
                       `RunRecorder`)
    OUT/model_sha256.csv  at the end: each node's final model hash (`rank,sha256`), at any size; summary.json's
                       models_sha256 is this file's own SHA-256 (`sha256sum OUT/model_sha256.csv`)
    OUT/rounds.csv     one row per evaluated round, appended: the spec's four metrics, the mean training loss,
                       the per-node metric (`per_node`, space-separated, in the order of `nodes`), and where the
                       nodes' own training loops reported metrics (`Peer.gossip(metrics=...)`), their node
                       averages (`reported`, a JSON object)
    OUT/nodes.csv      one row per node and round, appended: loss, bytes and fragments in/out, refusals, phase timings

With attackers (`--byzantine`), the evaluation rows cover the honest nodes only (`"honest_only": true`, `nodes`
lists them) and summary.json names the attackers (`byzantine_ranks`; always present, empty without attackers).
`refused` in nodes.csv is the count of refusals, `refused_by_reason` the same by reason ("clipped=3 out_of_range=1"):
messages refused (wire reasons; out_of_range is --max-norm) and received fragments the aggregator's rule cut
(clipped, trimmed). A daemon reports a refusal with its next arrival: what a round's aggregation cut is in the
node's row of the round after (in simulate, in the same round's row).

Rows are only ever appended, and summary.json holds no rows: every output costs the same per round at the end
of a long run as at its start. `read_rounds(out)` loads the evaluation rows (as summary.json's "rounds" list
held them before).

A run that fails still writes summary.json, with "status": "failed", a one-line "error" and its newest
evaluation (the CSV files keep their rows); one a person stopped (Ctrl-C, SIGTERM, its members told to stop) says
"status": "interrupted" and how ("interrupted (...)"); a finished run's says "status": "finished". Rounds are counted
from 0 in every file.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import socket
import time
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from mosaic_proto import NODE_COLUMNS, NodeReport
from mosaic_proto.barrier_rules import ended_status  # the one rule, which the barrier's state says too
from mosaicd.files import write_whole
from mosaicd.protocol import byzantine_ranks
from mosaicd.rundir import LIST_COLUMNS, MODEL_HASHES, node_losses_after, read_rounds, read_summary  # read_rounds: all
from mosaicd.settings import RunConfig
from mosaicd.trackers import RoundTrackers

NETWORK_METRICS = ("node_average", "average_model", "consensus_distance", "node_spread")  # the spec's four
SUMMARY_KEYS = ("metric", *NETWORK_METRICS, "train_loss")  # what a person reads first of an evaluation row
ROUND_COLUMNS = ["round", "metric", *NETWORK_METRICS, "train_loss", "elapsed_s",  # the first eight: as before
                 "higher_is_better", "node_average_test_loss", "average_model_test_loss", "eval_samples",
                 "test_size", "nodes", "per_node", "reported",  # reported: a training loop's metrics, a JSON object
                 "virtual_s",  # simulate --node-profile: the virtual clock at the round's release (s since the start)
                 "lost",  # why the round's evaluation could not be had (a restart: its models were gone), else empty
                 "time_s"]  # cluster --sync async: the point of the time grid (s of training since the start)
# what np.load raises on a checkpoint (.npz: a node's or simulate's) that is cut short, damaged (a flipped bit: the
# zip's CRC), empty or another file
NPZ_READ_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)
# summary.json's "mode" of a barrier that a launcher started, where it says so (`mosaicd cluster`: "cluster"); a
# barrier started by hand, or a peer list's rank 0, records "barrier" (docs/reference/outputs.md)
MODE_ENV = "MOSAICD_MODE"
ROWS_KEPT = 2000          # evaluation rows a recorder keeps in memory (for /v1/history and the dashboard)
SUMMARY_EVERY_S = 2.0     # between evaluations, summary.json's progress is refreshed at most this often
LISTED_NODES = 1_000      # summary.json lists each node (its model hash, the newest row's metric, the roster) up to
                          # this many; a larger run's says how many, and the lists are in model_sha256.csv, rounds.csv


def listed(settings: Mapping[str, Any]) -> bool:
    """Whether a run's summary.json lists each node (LISTED_NODES)."""
    return int(settings.get("nodes") or 0) <= LISTED_NODES


def summary_row(row: dict[str, Any] | None, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """An evaluation row as summary.json's "final" holds it: past LISTED_NODES without the per-node columns."""
    return row if row is None or listed(settings) else {k: v for k, v in row.items() if k not in LIST_COLUMNS}


def model_sha256(vector: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(vector, dtype="<f4").tobytes()).hexdigest()


LOWER_IS_BETTER = ("loss", "error", "err", "rmse", "mse", "mae", "perplexity", "ppl", "regret", "distance")


def higher_is_better_by_name(metric: str) -> bool:
    """Whether a metric a loop reports is better higher, from its name: one naming a loss, an error or a distance
    (`LOWER_IS_BETTER`, as a word of it: test_loss, top1_err, val-rmse) is lower-is-better; any other (accuracy,
    f1, auc, reward) higher-is-better. `Peer.gossip(higher_is_better=...)` says it where the name does not."""
    words = [w for w in re.split(r"[^a-z0-9]+", metric.lower()) if w]
    return not any(w in LOWER_IS_BETTER for w in words)


def higher_is_better(rounds: list[Mapping[str, Any]]) -> bool | None:
    """Whether the run's metric is better higher, as its task said in the evaluation rows (None: no row)."""
    return next((bool(r["higher_is_better"]) for r in rounds if r.get("higher_is_better") is not None), None)


def honest_nodes(run: RunConfig, members: Iterable[int]) -> tuple[list[int], dict[str, Any]]:
    """The honest ones of `members` (what the metrics cover), and what an evaluation row says about it."""
    attackers = set(byzantine_ranks(run))
    return [m for m in members if m not in attackers], ({"honest_only": True} if attackers else {})


def robustness_summary(run: RunConfig) -> dict[str, Any]:
    """What summary.json says about attackers: their ranks, and that the metrics leave them out."""
    return {"byzantine_ranks": list(byzantine_ranks(run)), "honest_only": run.byzantine > 0}


def stopped_summary(stopped_by: Mapping[int, str | None], listed: bool = True) -> dict[str, Any]:
    """What ended an asynchronous run's iterations (summary.json's `asynchronous`): `stopped`, the run's (`budget`,
    `iterations`, or `budget and iterations` where some nodes stopped by each), and `stopped_by`, each node's
    (`listed`: up to `LISTED_NODES`)."""
    reasons = sorted({str(r) for r in stopped_by.values() if r is not None})
    return {"stopped": " and ".join(reasons) or None,
            "stopped_by": {str(r): why for r, why in sorted(stopped_by.items())} if listed else {}}


def is_eval_round(round: int, run: RunConfig) -> bool:
    return round == run.rounds - 1 or (run.eval_every > 0 and (round + 1) % run.eval_every == 0)


def clean_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    if isinstance(value, np.generic):
        return clean_json(value.item())
    return value


def failure_text(exc: BaseException) -> str:
    """One line that says why a run failed: the exception's message (its type where the message is empty)."""
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM as the commands take it (`cli._interrupt`)
        return f"interrupted ({exc.args[0] if exc.args else 'Ctrl-C'})"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def write_summary(out: Path, summary: dict[str, Any], indent: int | None = 2) -> dict[str, Any]:
    """Replace OUT/summary.json atomically: the one writer of the file (`RunRecorder`, `failed_summary`,
    `mark_failed`). `indent=None` (a running run's, rewritten at every evaluation): one line, through json's C
    encoder, several times faster than the indented form."""
    summary = clean_json(summary)
    write_whole(out / "summary.json", json.dumps(summary, indent=indent))  # a failed write leaves the one before
    return summary


def remove_summary(out: Path) -> None:
    """Remove OUT/summary.json: an earlier run's must not pass for the one starting there."""
    (out / "summary.json").unlink(missing_ok=True)


def placement(settings: Mapping[str, Any]) -> dict[str, str]:
    """Where the run's summary was written: the host, the torch device (`cpu` says a run trained on the CPU), the
    GPUs it was given (CUDA_VISIBLE_DEVICES) and its Slurm job (`JOB_TASK` for an array task), where known."""
    env = os.environ
    job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}" \
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID") else env.get("SLURM_JOB_ID")
    where = {"host": socket.gethostname(), "device": str(settings.get("device") or "cpu"),
             "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"), "slurm_job": job}
    return {k: v for k, v in where.items() if v is not None}


def _started_text(started: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))


def failed_summary(out: Path | str, settings: BaseModel | Mapping[str, Any], mode: str, error: str,
                   wall_s: float | None = None, **extra: Any) -> dict[str, Any]:
    """Write OUT/summary.json for a run that failed outside this process, from the rows in OUT/rounds.csv.

    For a run whose recorder is at hand, `RunRecorder.fail`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = read_rounds(out)
    settings = settings.model_dump(mode="json") if isinstance(settings, BaseModel) else dict(settings)
    latest = rounds[-1] if rounds else None
    done = latest["round"] + 1 if latest and isinstance(latest.get("round"), int) else 0
    return write_summary(out, {
        "mode": mode, "status": ended_status(error), "error": " ".join(error.split()), "settings": settings,
        "progress": {"rounds_done": done, "rounds": settings.get("rounds")}, "final": summary_row(latest, settings),
        "model_sha256": {}, "wall_s": None if wall_s is None else round_(wall_s), **extra})


def mark_failed(out: Path, settings: BaseModel | Mapping[str, Any], mode: str, error: str, wall_s: float,
                rounds_done: int | None = None) -> None:
    """OUT/summary.json after a run failed as seen from outside its writer (a cluster's launcher): the summary
    there, marked failed (its own error kept where it gave one), or one made from rounds.csv (`failed_summary`)
    where there is none. A summary that says the run finished stays as it is. `rounds_done`: the rounds the run
    got through where its summary may lag behind (a barrier writes its summary every few seconds, its journal
    every round). Its writers have stopped: "final" is the newest row in rounds.csv (an evaluation may have
    completed after its writer said the run failed)."""
    summary = read_summary(out)
    if summary is None:
        failed_summary(out, settings, mode, error, wall_s=wall_s)
        return
    if summary.get("status") == "finished":  # the run finished before the failure (a late Ctrl-C)
        return
    if summary.get("status") == "failed":
        summary.setdefault("cluster_error", error)
    else:  # the barrier's own "interrupted (SIGTERM)" is the launcher stopping it: the launcher's reason is the cause
        summary.update(status=ended_status(error), error=error)
    if rounds_done is not None and isinstance(summary.get("progress"), dict):
        summary["progress"]["rounds_done"] = rounds_done  # the rounds released: the resumed run goes on from there
    rounds = read_rounds(out)
    if rounds:
        summary["final"] = summary_row(rounds[-1], summary.get("settings") or {})
    write_summary(out, summary)


def _cell(value: Any) -> Any:
    """A value as rounds.csv writes it: lists space-separated, booleans lower case, None empty."""
    if value is None:
        return ""
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    if isinstance(value, list | tuple | np.ndarray):
        return " ".join(str(_cell(v)) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return json.dumps(clean_json(value), separators=(",", ":"))
    return value


def _header(path: Path) -> list[str] | None:
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), None)
    except OSError:
        return None


def drop_rows_from(out: Path, nodes: int, rounds: int) -> None:
    """Remove the rows of rounds >= `nodes` from OUT/nodes.csv and >= `rounds` from OUT/rounds.csv (replaced
    atomically): a run resumed from an earlier round writes them again."""
    for name, first in (("nodes.csv", nodes), ("rounds.csv", rounds)):
        path = out / name
        try:
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
        except FileNotFoundError:
            continue
        kept = rows[:1] + [r for r in rows[1:] if r and int(r[0]) < first]
        if len(kept) == len(rows):
            continue
        text = io.StringIO()
        csv.writer(text).writerows(kept)
        write_whole(path, text.getvalue())


class RunRecorder:
    """Appends per-round rows as the run goes and keeps summary.json small and current (`finish`, or `fail`, at
    the end). Every call costs the same whatever the round: nothing is rewritten but summary.json's few keys.

    A summary.json left in `out` by an earlier run is removed at the start; this run's is written from its first
    round on ("status": "running", then "finished" or "failed"). Its size does not grow with the nodes past
    LISTED_NODES either: a larger run's summary holds `members_count` for the roster's lists (`members`,
    `addresses`), each event's members and stragglers as counts (its drops, joins and leaves as lists: each happens
    once a node), `final` without the per-node columns (rounds.csv has them) and only `models_sha256` of the hashes.
    """

    def __init__(self, out: Path, settings: BaseModel | Mapping[str, Any], mode: str,
                 resume_from: float | None = None) -> None:
        """`settings`: what summary.json records as the run's settings. `resume_from`: the wall-clock start of
        a run that this recorder goes on with (a restarted barrier): its rows are kept and appended to."""
        self.out, self.mode = Path(out), mode
        self.settings = settings.model_dump(mode="json") if isinstance(settings, BaseModel) else dict(settings)
        self.placement = placement(self.settings)
        self.notes: dict[str, Any] = {}  # what the run's owner adds to every summary (`note`)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.time() if resume_from is None else resume_from
        # the clock of wall_s and elapsed_s: the time the run ran, not the time it stood stopped before --resume
        ran = (read_summary(self.out) or {}).get("wall_s") if resume_from is not None else None
        self.origin = time.time() - ran if isinstance(ran, int | float) and ran >= 0 else self.started
        self.rounds: list[dict[str, Any]] = []
        self.latest: dict[str, Any] | None = None
        self.rounds_done = 0
        self.losses: dict[int, dict[int, float]] = {}  # the nodes' losses of the rounds not evaluated yet
        if resume_from is not None:
            self._read_rows()
        self._summary_at = -math.inf  # the first round writes summary.json: from then on `mosaicd runs` lists it
        self.ended: str | None = None  # "finished", "failed" or "interrupted" once summary.json says so: never
        # "running" again
        remove_summary(self.out)
        self.trackers = RoundTrackers(self.out, self.settings)  # --tensorboard, --mlflow: copies of each row
        self.round_columns = ROUND_COLUMNS
        for name, columns in (("nodes.csv", NODE_COLUMNS), ("rounds.csv", ROUND_COLUMNS)):
            had = _header(self.out / name) if resume_from is not None else None
            if had:
                if name == "rounds.csv":
                    self.round_columns = had  # rows appended to a file of an earlier version keep its columns
                continue
            header = io.StringIO()
            csv.writer(header).writerow(columns)
            write_whole(self.out / name, header.getvalue())

    def _read_rows(self) -> None:
        """What a resumed run goes on with from its rows: the newest evaluations (rounds.csv) and the nodes' losses
        of the rounds not evaluated yet (nodes.csv), for train_loss."""
        self.rounds = read_rounds(self.out)[-ROWS_KEPT:]
        self.latest = self.rounds[-1] if self.rounds else None
        self.rounds_done = self.latest["round"] + 1 if self.latest and isinstance(self.latest.get("round"), int) \
            else 0
        self.losses = node_losses_after(self.out, self.rounds_done - 1)

    def cut_back(self, round: int) -> None:
        """A resumed run goes on at `round`, chosen only now (its members came back with their checkpoints): the
        rows it writes again are dropped (`drop_rows_from`) and what this recorder read of them is read again."""
        drop_rows_from(self.out, nodes=round, rounds=round - 1)
        self._read_rows()

    def counted(self, nodes: int) -> None:
        """The run's node count as its barrier counted the members at registration: what summary.json records."""
        self.settings["nodes"] = nodes

    def clock(self) -> float:
        """The wall clock that `elapsed_s` is measured on (pass its value as network_round's `taken_at`)."""
        return time.time()

    def node_rounds(self, reports: Iterable[tuple[int, NodeReport]]) -> None:
        """Nodes' rounds (node, its report): their nodes.csv rows, written at once (a release opens the file once,
        not once per member); their losses also go into the round's mean training loss."""
        every, rounds = self.settings.get("eval_every"), self.settings.get("rounds")
        last = -1
        with open(self.out / "nodes.csv", "a", newline="") as f:
            writer = csv.writer(f)
            for node, report in reports:
                last = max(last, report.round)
                if every is None or rounds is None or report.round == rounds - 1 or \
                        (every > 0 and (report.round + 1) % every == 0):  # kept only for the rounds evaluated
                    self.losses.setdefault(report.round, {})[node] = report.loss
                writer.writerow(["" if v is None else v for v in report.row(node).values()])
        if last + 1 > self.rounds_done:
            self.rounds_done = last + 1
            if time.monotonic() - self._summary_at >= SUMMARY_EVERY_S:
                self._running()

    def network_round(self, round: int, metrics: Mapping[str, Any], taken_at: float | None = None) -> dict[str, Any]:
        """`taken_at`: when the models were taken (time.time()), so that a slow evaluation does not shift it."""
        losses = [x for _, x in sorted(self.losses.get(round, {}).items()) if math.isfinite(x)]
        for seen in [r for r in self.losses if r <= round]:  # no later evaluation needs them
            del self.losses[seen]
        row = {"round": round, **{k: v for k, v in metrics.items() if k != "per_node"},
               "train_loss": float(np.mean(losses)) if losses else math.nan,
               "elapsed_s": round_((taken_at or time.time()) - self.origin)}
        self.latest = clean_json({**row, "per_node": metrics.get("per_node")})
        self.rounds.append(self.latest)
        if len(self.rounds) > 2 * ROWS_KEPT:  # memory stays flat in long runs
            del self.rounds[:-ROWS_KEPT]
        with open(self.out / "rounds.csv", "a", newline="") as f:
            csv.writer(f).writerow([_cell({**row, "per_node": metrics.get("per_node")}.get(c))
                                    for c in self.round_columns])
        self.trackers.round(round, row)
        self._running()  # a crash loses at most this round's summary
        return row

    def lost_round(self, round: int, reason: str) -> None:
        """An evaluation round whose models could not be had (a restart): its row, in round order, says why and has
        no metrics (`lost`); the newest evaluation stays the one before."""
        with open(self.out / "rounds.csv", "a", newline="") as f:
            csv.writer(f).writerow([_cell({"round": round, "lost": reason}.get(c)) for c in self.round_columns])

    def _base(self, status: str) -> dict[str, Any]:
        return {"mode": self.mode, "status": status, "settings": self.settings,
                "progress": {"rounds_done": self.rounds_done, "rounds": self.settings.get("rounds")},
                "started": _started_text(self.started), "final": summary_row(self.latest, self.settings),
                "placement": self.placement,
                **self.notes}

    def _roster(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """`extra` as summary.json holds it: a larger run's per-node lists of the roster as a count."""
        if listed(self.settings):
            return dict(extra)
        shaped = {k: v for k, v in extra.items() if k not in ("members", "addresses")}
        if isinstance(extra.get("members"), list | tuple):
            shaped["members_count"] = len(extra["members"])
        if isinstance(extra.get("events"), list):  # a round's members and stragglers as counts; each drop is once
            shaped["events"] = [{**{k: v for k, v in e.items() if k not in ("members", "stragglers")},
                                 "members_count": len(e.get("members") or ()),
                                 "stragglers_count": len(e.get("stragglers") or ())} for e in extra["events"]]
        return shaped

    def note(self, key: str, value: Any) -> None:
        """A top-level key of summary.json from now on (the barrier's `refused`), written with the next summary."""
        self.notes[key] = value

    def _running(self) -> None:
        if self.ended is not None:  # an evaluation that completes after the run failed adds its row only
            return
        self._summary_at = time.monotonic()
        write_summary(self.out, {**self._base("running"), "wall_s": round_(time.time() - self.origin)}, indent=None)

    def finish(self, vectors: Mapping[int, np.ndarray], **extra: Any) -> dict[str, Any]:
        """The run finished: summary.json with "status": "finished", the final models' hashes and `extra`."""
        self.ended = "finished"
        self.trackers.end("finished")
        hashes = {str(k): model_sha256(v) for k, v in sorted(vectors.items())}
        table = "rank,sha256\n" + "".join(f"{rank},{h}\n" for rank, h in hashes.items())
        write_whole(self.out / MODEL_HASHES, table)  # beside summary.json: whole, or the one before
        return write_summary(self.out, {
            **self._base("finished"),
            "model_sha256": hashes if listed(self.settings) else {},
            "models_sha256": hashlib.sha256(table.encode()).hexdigest(),
            "wall_s": round_(time.time() - self.origin),
            **self._roster(extra),
        })

    def fail(self, reason: str, **extra: Any) -> dict[str, Any]:
        """The run failed: summary.json with "status": "failed" ("interrupted" where a person stopped it:
        `ended_status`), "error": `reason` (one line) and the newest evaluation."""
        self.ended = ended_status(reason)
        self.trackers.end(self.ended)
        return write_summary(self.out, {
            **self._base(self.ended),
            "error": " ".join(str(reason).split()),
            "model_sha256": {},
            "wall_s": round_(time.time() - self.origin),
            **self._roster(extra),
        })


def round_(x: float) -> float:
    return float(f"{x:.3f}")
