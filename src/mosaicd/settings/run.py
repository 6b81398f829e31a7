"""`RunConfig`: what every node of a run shares, checked as a whole before anything starts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode

from mosaic_proto import AttackKind, SamplerKind, Strategy, rules
from mosaic_proto.async_node import AsyncSend, Exchange, SyncMode
from mosaic_proto.compression import Compression
from mosaic_proto.profiles import NodeProfiles, ProfileError
from mosaic_proto.quadratic import CORRELATED_MAX_DIM, Curvature
from mosaicd.settings.effects import defaults, training_values, void_setting
from mosaicd.settings.flags import SettingsError, cli, format_errors
from mosaicd.settings.values import (
    LR_SCHEDULES,
    OPTIMIZERS,
    OWN_LOOP,
    OptimizerState,
    Partition,
    TaskName,
    TaskOption,
    import_path,
    task_options,
    task_spec,
)


class RunConfig(BaseModel):
    """What every node of a run must share: the algorithm, the workload and the seed.

    The barrier hands its `RunConfig` to every node as it registers; a node never mixes it with its own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the run (identical on every node; the barrier hands its own to registering nodes)
    run_id: str = Field("mosaic", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                        description="name of the run; messages of another run are refused", **cli("run"))
    own_loop: bool = Field(False, description="the nodes are training loops of your own (mosaicd.Peer in your "
                           "program): no task is built, --task is the loop's name as the run shows it (default: "
                           "own loop); docs/own-model.md; `mosaicd barrier` serves such a run (the other commands "
                           "run tasks)", **cli("run"))
    task: str = Field(TaskName.QUADRATIC, description="workload: a built-in, a name a package registers, "
                      "MODULE:CLASS or path/to/file.py:CLASS, a mosaicd.Task subclass (docs/own-model.md)",
                      **cli("run", metavar="{" + ",".join(TaskName) + "}|MODULE:CLASS|FILE.py:CLASS"))
    task_options: dict[str, TaskOption] = Field(default_factory=dict, description="--task-option KEY=VALUE "
                                                "(repeatable): a keyword argument of the task's constructor (the "
                                                "value read as TOML: 8, 0.5, true, or text); part of the run",
                                                **cli("run", metavar="KEY=VALUE"))
    nodes: int = Field(8, ge=1, le=1_000_000, description="number of nodes n", **cli("run"))
    rounds: int = Field(20, ge=1, description="rounds T", **cli("run"))
    fragments: int = Field(4, ge=1, description="fragments K (1 = Epidemic Learning)", **cli("run"))
    fanout: int = Field(2, ge=1, description="receivers s per fragment (degree of the graph)", **cli("run"))
    sampler: SamplerKind = Field(SamplerKind.LOCAL, description="local (EL-Local), oracle (EL-Oracle), static (D-PSGD)",
                                 **cli("run"))
    strategy: Strategy = Field(Strategy.RANDOM, description="fragmentation: random (layer-stratified) or contiguous",
                               **cli("run"))
    seed: int = Field(0, ge=0, le=2**63 - 1, description="run seed", **cli("run"))
    round_deadline: float = Field(120.0, gt=0, description="seconds a round may take from its release: the barrier "
                                  "releases it then, whoever has arrived, and a node's sends end before it",
                                  **cli("run"))
    node_profile: Annotated[dict[str, Any] | None, NoDecode] = Field(
        None, description="nodes that are not alike: a TOML or CSV file of each node's compute slowdown, link "
        "bandwidth and latency, or shares of the nodes drawn from --seed (docs/faults.md); the run carries its "
        "content to every node: cluster applies it for real, simulate on a virtual clock",
        **cli("run", metavar="FILE"))
    sync: SyncMode = Field(SyncMode.BARRIER, description="barrier: rounds the barrier releases (the paper's); async: "
                           "no rounds, each node trains, sends and aggregates what arrived, never waiting "
                           "(docs/spec.md, Asynchronous mode; --rounds counts each node's own iterations)",
                           **cli("run", "simulate", "cluster", "node", "barrier"))
    exchange: Exchange = Field(Exchange.PUSH, description="asynchronous runs: push (each fragment to --fanout sampled "
                               "peers: Mosaic, or EL with --fragments 1) or pairwise (AD-PSGD: the whole model "
                               "averaged with one random peer, atomically)",
                               **cli("run", "simulate", "cluster", "node", "barrier"))
    async_send: AsyncSend = Field(AsyncSend.TRAINED, description="asynchronous push: which model's fragments a node "
                                  "sends, trained (after its H local steps, before it aggregates: as a barrier "
                                  "round) or aggregated (after it averaged what arrived)",
                                  **cli("run", "simulate", "cluster", "node", "barrier"))
    time_budget: float | None = Field(None, gt=0, allow_inf_nan=False, description="asynchronous runs: the "
                                      "seconds each node trains, on its own clock from the run's start (simulate: "
                                      "virtual seconds; the daemons: from the start's barrier): it starts no "
                                      "iteration once they have passed, or stops at --rounds iterations if those "
                                      "come first", **cli("run", "simulate", "cluster", "node", "barrier",
                                                         metavar="SECONDS"))
    # robustness (docs/security.md): how nodes aggregate, and members that lie
    aggregator: str = Field(  # a name registered in mosaic_proto.rules (`_aggregator`)
        "mean", description=f"fragment-wise aggregation: {rules.rules_help()}",
        **cli("run", metavar="{" + ",".join(rules.rule_names()) + "}"))
    trim: float = Field(1.0, gt=0, description="trimmed-mean: values cut per side of each coordinate, own included: "
                        "a whole number >= 1, or a fraction of the contributions below 0.5 (too few: the median)",
                        **cli("run"))
    clip_radius: float = Field(0.1, gt=0, description="clipped: each received fragment's difference to the node's "
                               "own is clipped to this many times the norm of the node's own fragment", **cli("run"))
    byzantine: int = Field(0, ge=0, description="attacking nodes (ranks drawn from --seed); metrics count honest "
                           "nodes only", **cli("run"))
    attack: AttackKind = Field(AttackKind.SIGN_FLIP, description="what attacking nodes send: sign-flip, scale, "
                               "noise, alie (docs/security.md)", **cli("run"))
    attack_scale: float | None = Field(None, description="the attack's strength: sign-flip -s*x (1), scale s*x "
                                       "(10), noise x + s*rms(x)*N(0,1) (1), alie z (Baruch et al.'s z_max)",
                                       **cli("run"))
    # compression (docs/compression.md): what a fragment's values travel as
    compress: str = Field("none", description="what fragments travel as: none (float32), fp16, bf16, int8 "
                          "(stochastic rounding keyed by the seed), topk:FRACTION (that share of each fragment's "
                          "coordinates, with their indices)", **cli("run", metavar="none|fp16|bf16|int8|topk:FRACTION"))
    error_feedback: bool = Field(True, description="lossy --compress: carry what a message left out into later "
                                 "rounds (int8, fp16, bf16: the rounding error; topk: the coordinates that moved most "
                                 "since they were last sent)", **cli("run"))
    # learning
    train: bool = Field(True, description="run local training (off: protocol-only rounds)", **cli("learning"))
    local_steps: int = Field(1, ge=0, description="local SGD steps H per round", **cli("learning"))
    lr: float = Field(0.05, gt=0, description="learning rate eta", **cli("learning"))
    batch_size: int = Field(32, ge=1, description="mini-batch size B", **cli("learning"))
    optimizer: str = Field("sgd", description="the optimizer of a node's local steps: " + ", ".join(OPTIMIZERS)
                           + " (sgd is torch.optim.SGD's arithmetic without torch.optim's import), or a "
                           "torch.optim.Optimizer class as MODULE:CLASS (e.g. torch.optim:RAdam)",
                           **cli("learning", metavar="{" + ",".join(OPTIMIZERS) + "}|MODULE:CLASS"))
    optimizer_options: dict[str, TaskOption | list[TaskOption]] = Field(
        default_factory=dict, description="--optimizer-option KEY=VALUE (repeatable): a keyword argument of the "
        "optimizer's constructor (betas=[0.9,0.99], eps=1e-6; the value read as TOML); one it does not take is refused",
        **cli("learning", metavar="KEY=VALUE"))
    optimizer_state: OptimizerState = Field(OptimizerState.KEEP, description="keep: each node's optimizer state "
                                            "(momentum buffers, Adam's moments and steps) carries over from round to "
                                            "round while the parameters are replaced by the aggregate (saved in "
                                            "every checkpoint); reset: a fresh optimizer every round "
                                            "(decentralizepy's default)", **cli("learning"))
    momentum: float = Field(0.0, ge=0, lt=1, description="the optimizer's momentum (sgd, rmsprop; 0: none)",
                            **cli("learning"))
    weight_decay: float = Field(0.0, ge=0, description="the optimizer's weight decay (L2; adamw: decoupled)",
                                **cli("learning"))
    lr_schedule: str = Field("constant", description="the learning rate over the run's local steps (round t's "
                             "step h is step t*H+h of T*H): " + ", ".join(LR_SCHEDULES) + " (options: "
                             "--lr-schedule-option), or a torch.optim.lr_scheduler class as MODULE:CLASS, stepped "
                             "once per local step", **cli("learning", metavar="{" + ",".join(LR_SCHEDULES)
                                                          + "}|MODULE:CLASS"))
    lr_schedule_options: dict[str, TaskOption | list[TaskOption]] = Field(
        default_factory=dict, description="--lr-schedule-option KEY=VALUE (repeatable): step: step_size (steps), "
        "gamma; cosine: eta_min, T_max (steps); linear: start_factor, end_factor, total_iters (steps); a class's "
        "keyword arguments", **cli("learning", metavar="KEY=VALUE"))
    lr_warmup_steps: int = Field(0, ge=0, description="linear warm-up over the first N local steps of the run (from "
                                 "lr/N to the schedule's lr), before --lr-schedule", **cli("learning"))
    clip_grad_norm: float | None = Field(None, gt=0, description="clip each local step's gradient to this global "
                                         "L2 norm (torch.nn.utils.clip_grad_norm_)", **cli("learning"))
    eval_every: int = Field(1, ge=0, description="evaluate every E rounds (0: only at the end)", **cli("learning"))
    threads: int = Field(1, ge=1, le=256, description="torch threads per process; part of the run, since the "
                         "thread count changes floating-point results", **cli("learning"))
    device: str = Field("cpu", description="torch device of training and evaluation: cpu, cuda or cuda:N; part "
                        "of the run, since the device changes floating-point results", **cli("learning"))
    eval_samples: int | None = Field(None, ge=1, description="evaluate node models on a fixed seeded subset of N "
                                     "test samples (the average model always on the full test set)", **cli("learning"))
    partition: Partition = Field(Partition.IID, description="data partition across nodes", **cli("learning"))
    alpha: float = Field(1.0, gt=0, description="Dirichlet concentration", **cli("learning"))
    shards_per_node: int = Field(2, ge=1, description="label shards per node (partition=shards)", **cli("learning"))
    min_samples: int = Field(8, ge=1, description="least samples a node gets (dirichlet)", **cli("learning"))
    samples_per_node: int = Field(64, ge=1, description="teacher task: training samples per node (its data grows "
                                  "with the network)", **cli("learning"))
    dim: int = Field(16, ge=1, description="model size d of the quadratic task", **cli("learning"))
    curvature: Curvature = Field(Curvature.CORRELATED, description="quadratic task's A", **cli("learning"))
    heterogeneous: bool = Field(False, description="quadratic task: a different optimum per node", **cli("learning"))

    @model_validator(mode="before")
    @classmethod
    def _own_loop_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("own_loop") in (True, "true", "1") and data.get("task") is None:
            return {**data, "task": OWN_LOOP}
        return data

    @field_validator("task")
    @classmethod
    def _task(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("own_loop"):  # a name to show, not a task to build
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 _.:/-]{0,63}", str(value)):
                raise ValueError("with --own-loop, the loop's name as the run shows it (letters, digits, space, "
                                 "_.:/-; at most 64)")
            return str(value)
        return task_spec(value)  # a built-in stays a TaskName (`run.task is TaskName.QUADRATIC`)

    @field_validator("task_options", mode="before")
    @classmethod
    def _task_options(cls, value: Any) -> Any:
        return task_options(value)

    @field_validator("optimizer_options", "lr_schedule_options", mode="before")
    @classmethod
    def _keyword_options(cls, value: Any) -> Any:
        return task_options(value)

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, value: str) -> str:
        return import_path(value, "torch.optim.Optimizer", OPTIMIZERS)

    @field_validator("lr_schedule")
    @classmethod
    def _lr_schedule(cls, value: str) -> str:
        return import_path(value, "torch.optim.lr_scheduler", LR_SCHEDULES)

    @field_validator("node_profile", mode="before")
    @classmethod
    def _node_profile(cls, value: Any) -> dict[str, Any] | None:
        """A file's path is read here, once: the run carries the profile's content (a path would not mean the same
        file on every host), so the barrier hands the same profile to every node."""
        if value is None or value == "":
            return None
        if isinstance(value, str) and value.lstrip().startswith("{"):  # the content, as JSON (a launcher's env)
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a profile's JSON: {exc}") from None
        try:
            if isinstance(value, str | Path):
                path = Path(value).expanduser()
                try:
                    text = path.read_text()
                except (OSError, UnicodeDecodeError) as exc:
                    raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
                return NodeProfiles.parse(text, str(value)).to_json()
            return NodeProfiles.from_json(value).to_json()
        except ProfileError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("aggregator")
    @classmethod
    def _aggregator(cls, value: str) -> str:
        return rules.checked_rule_name(value)

    @field_validator("compress")
    @classmethod
    def _compress(cls, value: str) -> str:
        return str(Compression.parse(value))  # one spelling per codec: topk:0.10 is topk:0.1

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", value):
            raise ValueError("expected cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.fanout >= self.nodes:
            raise ValueError(f"--fanout {self.fanout} needs at least {self.fanout + 1} nodes, got --nodes {self.nodes}")
        if self.task is TaskName.QUADRATIC and self.fragments > self.dim:
            raise ValueError(f"--fragments {self.fragments} is more than the quadratic model's --dim {self.dim}")
        if self.task is TaskName.QUADRATIC and self.train and self.curvature is Curvature.CORRELATED \
                and self.dim > CORRELATED_MAX_DIM:
            raise ValueError(f"--dim {self.dim} with --curvature correlated: its A is a d x d matrix "
                             f"({self.dim ** 2 * 8 / 2 ** 30:,.0f} GiB, made by a d x d QR); with training, --dim "
                             f"{CORRELATED_MAX_DIM} at most: use --curvature diagonal, or --no-train")
        if not (self.trim < 0.5 or float(self.trim).is_integer()):
            raise ValueError(f"--trim {self.trim:g}: give a whole number of values per side (1, 2, ...) or a "
                             "fraction below 0.5")
        if self.byzantine >= self.nodes:
            raise ValueError(f"--byzantine {self.byzantine} leaves no honest node among --nodes {self.nodes}")
        if self.attack_scale is not None and not math.isfinite(self.attack_scale):
            raise ValueError("--attack-scale must be a finite number")
        if (void := void_setting(self, RunConfig.model_fields, defaults(RunConfig)) or training_values(self)):
            raise ValueError(void)  # a setting that changes nothing, refused (settings/effects.py)
        if self.node_profile is not None:
            try:  # every rank's draws, as the nodes will make them (`mosaicd.protocol.node_profiles`)
                NodeProfiles.from_json(self.node_profile).resolve(self.seed, self.nodes)
            except ProfileError as exc:
                raise ValueError(f"--node-profile {exc}") from None
        return self

    @property
    def min_members(self) -> int:
        """The fewest live members the run can go on with: each fragment goes to `fanout` others."""
        return min(self.fanout + 1, self.nodes)

    def with_nodes(self, nodes: int) -> RunConfig:
        """The same run with `nodes` members (counted at registration, or in a peer list), validated; a
        SettingsError (a ValueError) worded as the flags' errors if invalid."""
        try:
            return RunConfig.model_validate({**self.model_dump(), "nodes": nodes})
        except ValidationError as exc:
            raise SettingsError(format_errors(exc)) from None
