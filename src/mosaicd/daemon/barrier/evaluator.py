"""The barrier's evaluation rows, off the round's critical path: pull the nodes' snapshots with the metrics each
node keeps with them (its own evaluation of its model, or what its training loop reported), combine those,
and record the rows in round order. The barrier evaluates no node model: it computes the consensus distance from
the vectors, and the average model's metric where it has the run's task (`NetworkEvaluation`).

`collect` returns once the snapshots are pulled: the row is a separate future. The barrier awaits a
collection before the release that would make nodes drop its snapshots (round e + SNAPSHOTS_KEPT); only the run's
final release waits for the rows (`drain`), to write summary.json."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from mosaic_proto import consensus_distance
from mosaicd.daemon.barrier.metrics import BarrierMetrics
from mosaicd.daemon.http.auth import Keyring, signer
from mosaicd.daemon.http.client import Client, HttpError
from mosaicd.daemon.http.model_codec import decode_model
from mosaicd.daemon.http.tls import client_context, scheme
from mosaicd.learning.tasks import import_task_modules
from mosaicd.outputs import SUMMARY_KEYS, RunRecorder, honest_nodes, is_eval_round
from mosaicd.outputs import higher_is_better_by_name as higher_is_better
from mosaicd.settings import DaemonOptions, RunConfig


class NetworkEvaluator:
    def __init__(self, options: DaemonOptions, keyring: Keyring | None,
                 evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None, recorder: RunRecorder,
                 metrics: BarrierMetrics, log: Any, on_output_error: Callable[[OSError], None] | None = None) -> None:
        """`evaluate(run, vectors)`: the network metrics of the models (None: collect final models only)."""
        self.options, self.keyring, self.evaluate = options, keyring, evaluate
        self.recorder, self.metrics, self.log = recorder, metrics, log
        self.on_output_error = on_output_error  # a row that cannot be written ends the run
        self.last_metrics: dict[str, Any] | None = None
        self.final_vectors: dict[int, np.ndarray] = {}
        self._evaluation: asyncio.Future | None = None

    def prepare(self, run: RunConfig) -> None:
        """The run is known (its roster made): what evaluates its models may get ready (`NetworkEvaluation`)."""
        prepare = getattr(self.evaluate, "prepare", None)
        if prepare is not None:
            prepare(run)

    async def collect(self, run: RunConfig, round: int, addresses: dict[int, str], final: bool) -> None:
        """Fetch the models after `round` of the nodes at `addresses` (rank -> host:port), then start their
        evaluation; the final models are kept for summary.json.

        A release waits for the collection of an earlier round (the nodes keep few snapshots) while the next round's
        deadline runs, so a node that does not answer (stopped, frozen) costs it at most a quarter of the round
        deadline, not --request-timeout: else the release would come too late and every member would straggle."""
        vectors: dict[int, np.ndarray] = {}
        node_metrics: dict[int, dict[str, Any]] = {}
        taken_at = self.recorder.clock()
        sign = signer(lambda: self.keyring.credentials(run.run_id), lambda: "barrier") if self.keyring else None
        timeout = min(self.options.request_timeout, run.round_deadline / 8)  # two attempts
        async with Client(timeout=timeout, retries=1, signer=sign,
                          ssl_context=client_context(self.options)) as client:
            async def fetch(rank: int, address: str) -> None:
                url = f"{scheme(self.options)}://{address}/v1/model?round={round}"
                try:
                    _, body, _ = await client.request("GET", url, round=round)
                    model = decode_model(body)
                    vectors[rank] = model["vector"]
                    if model["metrics"] is not None:
                        node_metrics[rank] = model["metrics"]
                except (HttpError, ValueError) as exc:
                    # a member started again keeps no model of rounds before (404): routine, not an alarm
                    gone = isinstance(exc, HttpError) and exc.status == 404
                    (self.log.info if gone else self.log.warning)("collect_failed", rank=rank, round=round,
                                                                  error=str(exc))
            await asyncio.gather(*(fetch(r, a) for r, a in addresses.items()))
        if final:
            self.final_vectors = vectors
        if vectors and is_eval_round(round, run):
            previous = self._evaluation
            self._evaluation = asyncio.ensure_future(self._evaluate(run, round, vectors, node_metrics, previous,
                                                                    taken_at))

    async def collect_rounds(self, run: RunConfig, rounds: list[int], addresses: dict[int, str], final: bool) -> None:
        """`collect` of several rounds, one after the other, so that their rows are written in round order; `final`:
        the last of them is the run's final models."""
        for e in rounds:
            await self.collect(run, e, addresses, final and e == rounds[-1])

    async def drain(self) -> None:
        """Wait for the evaluations started so far."""
        if self._evaluation is not None:
            await self._evaluation

    async def _evaluate(self, run: RunConfig, round: int, vectors: dict[int, np.ndarray],
                        node_metrics: dict[int, dict[str, Any]], previous: asyncio.Future | None,
                        taken_at: float) -> None:
        ranks, says = honest_nodes(run, sorted(vectors))  # attackers' models are collected, not evaluated
        if not ranks:
            return
        try:
            metrics = await asyncio.to_thread(combine, run, ranks, vectors, node_metrics, self.evaluate)
        except Exception as exc:  # the barrier's task cannot evaluate these models: the nodes' metrics still count
            if self.evaluate is None:
                raise
            self.log.warning("average_model_failed", round=round, error=f"{type(exc).__name__}: {exc}",
                             detail="the row has no average_model: is the barrier's --task the nodes' model?")
            metrics = await asyncio.to_thread(combine, run, ranks, vectors, node_metrics, None)
        metrics.update(says)
        if previous is not None:
            await previous
        try:
            self.last_metrics = self.recorder.network_round(round, {**metrics, "nodes": ranks, **says}, taken_at)
        except OSError as exc:
            if self.on_output_error is None:
                raise
            self.on_output_error(exc)
            return
        self.metrics.evaluated(self.last_metrics)
        self.log.info("evaluated", round=round, **{k: self.last_metrics.get(k) for k in SUMMARY_KEYS})


def combine(run: RunConfig, ranks: list[int], vectors: dict[int, np.ndarray], node_metrics: dict[int, dict[str, Any]],
            evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None) -> dict[str, Any]:
    """An evaluation row from the nodes' own metrics (`ranks`' in rank order, as simulate's `network_metrics` takes
    them): node_average, node_spread (population std) and per_node of the leading metric, the node-averaged test
    loss, a training loop's reported metrics (`reported`: each one's node average), the consensus distance of the
    vectors, and the average model's metric where the barrier has the run's task (`evaluate`)."""
    models = [vectors[r] for r in ranks]
    out: dict[str, Any] = {"consensus_distance": consensus_distance([np.asarray(v) for v in models])}
    average = evaluate(run, models) if evaluate is not None else {}
    have = [r for r in ranks if r in node_metrics]
    name = next((node_metrics[r]["metric"] for r in have if node_metrics[r]["metric"]), average.get("metric"))
    nodes = [r for r in have if name in node_metrics[r]["values"]]
    if nodes:
        first = node_metrics[nodes[0]]
        per_node = [node_metrics[r]["values"][name] for r in nodes]
        out.update(metric=name, higher_is_better=first["higher_is_better"], node_average=float(np.mean(per_node)),
                   node_spread=float(np.std(per_node)), per_node=per_node)
        if all("test_loss" in node_metrics[r]["values"] for r in nodes):
            out["node_average_test_loss"] = float(np.mean([node_metrics[r]["values"]["test_loss"] for r in nodes]))
        for key in ("eval_samples", "test_size"):
            if key in first:
                out[key] = first[key]
        if first["source"] == "reported":
            out["reported"] = reported_average([node_metrics[r]["values"] for r in nodes])
    out.update({k: v for k, v in average.items() if out.get(k) is None or k.startswith("average_model")})
    out["nodes"] = nodes or ranks
    return out


def reported_average(values: list[dict[str, float]]) -> dict[str, float]:
    """Each reported metric's mean over the nodes that reported it, in the order the loops name them."""
    names = list(dict.fromkeys(k for v in values for k in v))
    return {k: float(np.mean([v[k] for v in values if k in v])) for k in names}


class NetworkEvaluation:
    """The barrier's `evaluate`: the average model's metric on the run's task; the node models are evaluated by the
    nodes themselves. The task's modules are imported from the start (`import_modules`: while the nodes start and
    register) and the task is built as soon as the run is known (`prepare`: when registration closes), each in a
    thread of its own, not at the first evaluation: built then, beside nodes that train, it took long enough on a
    loaded host that every row waited for it and no round line carried an evaluation."""

    def __init__(self, data_dir: Any, task: Any = None) -> None:
        self.data_dir = data_dir
        self._task: Any = task  # a prebuilt one (warm start) is used only if it is the run's
        self._building = threading.Lock()  # an evaluation waits for the build under way instead of a second one

    def import_modules(self, task: str) -> None:
        """Import what the task `task` needs, in the background (none where a task was given)."""
        if self._task is None:
            threading.Thread(target=import_task_modules, args=(task,), name="mosaic-evaluation-imports",
                             daemon=True).start()

    def prepare(self, run: RunConfig) -> None:
        """Build `run`'s task now, in the background (an error is left for the evaluation to raise)."""
        def build() -> None:
            try:
                self._task_of(run)
            except Exception:  # noqa: BLE001 (said when an evaluation needs the task)
                pass
        threading.Thread(target=build, name="mosaic-evaluation-task", daemon=True).start()

    def _task_of(self, run: RunConfig) -> Any:
        from mosaicd.learning.tasks import build_task

        with self._building:
            if self._task is None or self._task.run != run:
                self._task = build_task(run, self.data_dir)
            return self._task

    def __call__(self, run: RunConfig, vectors: list[np.ndarray]) -> dict[str, Any]:
        from mosaicd.learning.evaluation import average_evaluation

        return average_evaluation(self._task_of(run), vectors)


class LoopEvaluation:
    """An own loop's average-model evaluation (`mosaicd.Barrier(evaluate=...)`): a function of a flat float32 vector
    giving metrics by name (the first leads, as a loop's reported metrics do; `test_loss` is the test loss), or a
    `mosaicd.Task` (its `evaluate`, `metric` and `higher_is_better`)."""

    def __init__(self, evaluate: Any) -> None:
        self.evaluate = evaluate

    def __call__(self, run: RunConfig, vectors: list[np.ndarray]) -> dict[str, Any]:
        from mosaicd.learning.evaluation import average_evaluation, average_model
        from mosaicd.learning.tasks import Task

        if isinstance(self.evaluate, Task):
            return average_evaluation(self.evaluate, vectors)
        values = dict(self.evaluate(average_model(vectors)))
        if not values:
            raise ValueError("evaluate() gave no metric")
        name = next(iter(values))
        out: dict[str, Any] = {"metric": name, "higher_is_better": higher_is_better(name),
                               "average_model": float(values[name])}
        if "test_loss" in values:
            out["average_model_test_loss"] = float(values["test_loss"])
        return out
