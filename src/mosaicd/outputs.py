"""What a run leaves behind, identical for `cluster`, `simulate` and compose runs:

    OUT/summary.json   status ("finished" or "failed" with its "error"), settings, per-round network metrics,
                       final metrics, model_sha256 per node
    OUT/rounds.csv     one row per evaluated round: the spec's four metrics and the mean training loss
    OUT/nodes.csv      one row per node and round: loss, bytes and fragments in/out, refusals, phase timings

With attackers (`--byzantine`), the evaluation rows cover the honest nodes only (`"honest_only": true`, `nodes`
lists them) and summary.json names the attackers (`byzantine_ranks`; always present, empty without attackers).
`refused` in nodes.csv is the count of refusals, `refused_by_reason` the same by reason ("clipped=3 out_of_range=1"):
messages refused (wire reasons; out_of_range is --max-norm) and received fragments the aggregator's rule cut
(clipped, trimmed). A daemon reports a refusal with its next arrival: what a round's aggregation cut is in the
node's row of the round after (in simulate, in the same round's row).

A run that fails still writes summary.json, with "status": "failed", a one-line "error" and the rounds recorded
until then (the CSV files keep their rows); a finished run's says "status": "finished".
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from mosaicd.settings import RunConfig

NODE_COLUMNS = ["round", "node", "loss", "bytes_out", "bytes_in", "fragments_out", "fragments_in", "messages_out",
                "messages_in", "fragments_unsent", "refused", "train_s", "send_s", "wait_s", "aggregate_s",
                "refused_by_reason"]
NETWORK_METRICS = ("node_average", "average_model", "consensus_distance", "node_spread")  # the spec's four
SUMMARY_KEYS = ("metric", *NETWORK_METRICS, "train_loss")  # what a person reads first of an evaluation row
ROUND_COLUMNS = ["round", "metric", *NETWORK_METRICS, "train_loss", "elapsed_s"]


def model_sha256(vector: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(vector, dtype="<f4").tobytes()).hexdigest()


def higher_is_better(rounds: list[Mapping[str, Any]]) -> bool | None:
    """Whether the run's metric is better higher, as its task said in the evaluation rows (None: no row)."""
    return next((bool(r["higher_is_better"]) for r in rounds if "higher_is_better" in r), None)


def honest_nodes(run: RunConfig, members: Iterable[int]) -> tuple[list[int], dict[str, Any]]:
    """The honest ones of `members` (what the metrics cover), and what an evaluation row says about it."""
    attackers = set(run.byzantine_ranks())
    return [m for m in members if m not in attackers], ({"honest_only": True} if attackers else {})


def robustness_summary(run: RunConfig) -> dict[str, Any]:
    """What summary.json says about attackers: their ranks, and that the metrics leave them out."""
    return {"byzantine_ranks": list(run.byzantine_ranks()), "honest_only": run.byzantine > 0}


def is_eval_round(round: int, run: RunConfig) -> bool:
    return round == run.rounds - 1 or (run.eval_every > 0 and (round + 1) % run.eval_every == 0)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        return _clean(value.item())
    return value


def failure_text(exc: BaseException) -> str:
    """One line that says why a run failed: the exception's message (its type where the message is empty)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _write_summary(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    summary = _clean(summary)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "summary.json")
    return summary


def failed_summary(out: Path | str, settings: BaseModel | Mapping[str, Any], mode: str, error: str,
                   wall_s: float | None = None, **extra: Any) -> dict[str, Any]:
    """Write OUT/summary.json for a run that failed outside this process, from the rounds in OUT/rounds.csv.

    The rounds keep the CSV's columns only (no per_node). For a run whose recorder is at hand, `RunRecorder.fail`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = read_rounds(out)
    return _write_summary(out, {
        "mode": mode, "status": "failed", "error": " ".join(error.split()),
        "settings": settings.model_dump(mode="json") if isinstance(settings, BaseModel) else dict(settings),
        "rounds": rounds, "final": rounds[-1] if rounds else None, "model_sha256": {},
        "wall_s": None if wall_s is None else round_(wall_s), **extra})


def read_rounds(out: Path) -> list[dict[str, Any]]:
    """The evaluation rows of OUT/rounds.csv (its columns only: no per_node); none if it is missing."""
    rounds: list[dict[str, Any]] = []
    try:
        with open(out / "rounds.csv", newline="") as f:
            for row in csv.DictReader(f):
                rounds.append({k: _parse(v) for k, v in row.items() if k is not None})
    except OSError:
        pass
    return rounds


def _parse(text: str | None) -> Any:
    """A CSV cell as it was written: int, float, or the text; '' is None."""
    if text is None or text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class RunRecorder:
    """Appends per-round rows as the run goes and writes summary.json at the end (`finish`, or `fail`).

    A summary.json left in `out` by an earlier run is removed at the start.
    """

    def __init__(self, out: Path, settings: BaseModel | Mapping[str, Any], mode: str,
                 resume_from: float | None = None) -> None:
        """`settings`: what summary.json records as the run's settings. `resume_from`: the wall-clock start of
        a run that this recorder goes on with (a restarted barrier): its rows are kept and appended to."""
        self.out, self.mode = Path(out), mode
        self.settings = settings.model_dump(mode="json") if isinstance(settings, BaseModel) else dict(settings)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.time() if resume_from is None else resume_from
        self.rounds: list[dict[str, Any]] = read_rounds(self.out) if resume_from is not None else []
        self.losses: dict[int, dict[int, float]] = {}
        (self.out / "summary.json").unlink(missing_ok=True)
        for name, columns in (("nodes.csv", NODE_COLUMNS), ("rounds.csv", ROUND_COLUMNS)):
            if resume_from is None or not (self.out / name).exists():
                with open(self.out / name, "w", newline="") as f:
                    csv.writer(f).writerow(columns)

    def clock(self) -> float:
        """The wall clock that `elapsed_s` is measured on (pass its value as network_round's `taken_at`)."""
        return time.time()

    def node_round(self, report: Mapping[str, Any]) -> None:
        row = dict(report)
        refused = dict(row.get("refused") or {})
        row["refused"] = sum(refused.values())
        row["refused_by_reason"] = " ".join(f"{k}={v}" for k, v in sorted(refused.items()) if v)
        self.losses.setdefault(int(row["round"]), {})[int(row["node"])] = float(row.get("loss", math.nan))
        with open(self.out / "nodes.csv", "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in NODE_COLUMNS])

    def network_round(self, round: int, metrics: Mapping[str, Any], taken_at: float | None = None) -> dict[str, Any]:
        """`taken_at`: when the models were taken (time.time()), so that a slow evaluation does not shift it."""
        losses = [x for _, x in sorted(self.losses.get(round, {}).items()) if math.isfinite(x)]
        row = {"round": round, **{k: v for k, v in metrics.items() if k != "per_node"},
               "train_loss": float(np.mean(losses)) if losses else math.nan,
               "elapsed_s": round_((taken_at or time.time()) - self.started)}
        self.rounds.append(_clean({**row, "per_node": metrics.get("per_node")}))
        with open(self.out / "rounds.csv", "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in ROUND_COLUMNS])
        _write_summary(self.out, {"mode": self.mode, "status": "running", "settings": self.settings,
                                  "rounds": self.rounds, "final": self.rounds[-1],
                                  "wall_s": round_(time.time() - self.started)})  # a crash loses at most this round
        return row

    def finish(self, vectors: Mapping[int, np.ndarray], **extra: Any) -> dict[str, Any]:
        """The run finished: summary.json with "status": "finished", the final models' hashes and `extra`."""
        return _write_summary(self.out, {
            "mode": self.mode,
            "status": "finished",
            "settings": self.settings,
            "rounds": self.rounds,
            "final": self.rounds[-1] if self.rounds else None,
            "model_sha256": {str(k): model_sha256(v) for k, v in sorted(vectors.items())},
            "wall_s": round_(time.time() - self.started),
            **extra,
        })

    def fail(self, reason: str, **extra: Any) -> dict[str, Any]:
        """The run failed: summary.json with "status": "failed", "error": `reason` (one line) and the rounds
        recorded so far."""
        return _write_summary(self.out, {
            "mode": self.mode,
            "status": "failed",
            "error": " ".join(str(reason).split()),
            "settings": self.settings,
            "rounds": self.rounds,
            "final": self.rounds[-1] if self.rounds else None,
            "model_sha256": {},
            "wall_s": round_(time.time() - self.started),
            **extra,
        })


def round_(x: float) -> float:
    return float(f"{x:.3f}")
