"""A run's per-round metrics where researchers already look: TensorBoard event files (`--tensorboard DIR`) and an
MLflow tracking folder (`--mlflow DIR`). Each is an optional extra (`pip install 'mosaic-learning[tensorboard]'`,
`[mlflow]`); `rounds.csv` stays the record, and a tracker that cannot write is warned about once and closed, never
the end of the run.

One run is `DIR/<the run folder's name>` for TensorBoard (so that `tensorboard --logdir DIR` compares the runs of a
sweep) and one MLflow run named after the run folder in the experiment named by `--run-id`, in the SQLite store
`DIR/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`); a resumed run goes on in the same
MLflow run (found by its `mosaic.out` tag).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from mosaicd.extras import MissingExtra, needs
from mosaicd.logs import get_logger

__all__ = ["MLFLOW_DB", "RoundTrackers"]

MLFLOW_DB = "mlflow.db"
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class _Tracker(Protocol):
    def round(self, round: int, values: Mapping[str, float]) -> None: ...

    def end(self, status: str) -> None: ...


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite numbers, but the round itself (it is the step); a training loop's reported metrics as
    `reported.<name>`."""
    reported = row.get("reported")
    flat = {**row, **({f"reported.{k}": v for k, v in reported.items()} if isinstance(reported, Mapping) else {})}
    return {k: float(v) for k, v in flat.items() if k != "round" and isinstance(v, int | float)
            and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardRun:
    """Scalars of one run in `DIR/<name>`, through TensorBoard's own event file writer (no TensorFlow, no torch)."""

    def __init__(self, folder: Path) -> None:
        with needs("--tensorboard"):
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(folder))

    def round(self, round: int, values: Mapping[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=round, summary=summary))
        self._writer.flush()

    def end(self, status: str) -> None:
        self._writer.close()


class MlflowRun:
    """One MLflow run in the SQLite store `DIR/mlflow.db`: the run's settings as parameters, each row's metrics at
    its round, the status at the end."""

    def __init__(self, folder: Path, experiment: str, name: str, out: Path, settings: Mapping[str, Any]) -> None:
        with needs("--mlflow"):
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        for noisy in ("mlflow", "alembic"):  # schema migrations say so at INFO on every new store
            logging.getLogger(noisy).setLevel(logging.WARNING)
        folder.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=f"sqlite:///{folder.resolve() / MLFLOW_DB}")
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(
            experiment, artifact_location=(folder.resolve() / "artifacts").as_uri())
        tag = str(out.resolve())
        earlier = self._client.search_runs([experiment_id], filter_string=f"tags.`mosaic.out` = '{_quoted(tag)}'",
                                           max_results=1)
        if earlier:
            self.run_id = earlier[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=name, tags={"mosaic.out": tag}).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in sorted(settings.items()) if v is not None]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                self._client.log_batch(self.run_id, params=params[start:start + 100])

    def round(self, round: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, round) for k, v in values.items()])

    def end(self, status: str) -> None:
        self._client.set_terminated(self.run_id, _STATUS.get(status, "KILLED"))


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


class RoundTrackers:
    """The trackers a run's settings ask for (`tensorboard`, `mlflow`); each row of rounds.csv goes to all of them."""

    def __init__(self, out: Path, settings: Mapping[str, Any]) -> None:
        """MissingExtra where an extra a setting needs is not installed (the run has not started)."""
        self._log = get_logger(role="trackers")
        self._trackers: dict[str, _Tracker] = {}
        name = Path(out).resolve().name
        if settings.get("tensorboard"):
            self._open("tensorboard", lambda: TensorBoardRun(Path(settings["tensorboard"]) / name))
        if settings.get("mlflow"):
            experiment = str(settings.get("run_id") or "mosaic")
            self._open("mlflow", lambda: MlflowRun(Path(settings["mlflow"]), experiment, name, Path(out), settings))

    def _open(self, kind: str, make: Callable[[], _Tracker]) -> None:
        try:
            self._trackers[kind] = make()
        except MissingExtra:
            raise
        except Exception as exc:
            self._failed(kind, exc)

    def round(self, round: int, row: Mapping[str, Any]) -> None:
        values = _numbers(row)
        for kind in list(self._trackers):
            self._call(kind, lambda t: t.round(round, values))

    def end(self, status: str) -> None:
        for kind in list(self._trackers):
            self._call(kind, lambda t: t.end(status))
        self._trackers.clear()

    def _call(self, kind: str, action: Callable[[_Tracker], None]) -> None:
        try:
            action(self._trackers[kind])
        except Exception as exc:  # a tracker is a copy of rounds.csv: losing it never ends the run
            self._failed(kind, exc)

    def _failed(self, kind: str, exc: Exception) -> None:
        self._log.warning("tracker_failed", tracker=kind, error=f"{type(exc).__name__}: {exc}",
                          detail="rounds.csv has every row; this tracker gets no more")
        self._trackers.pop(kind, None)
