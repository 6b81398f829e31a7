"""One settings model for every entry point: CLI flags > MOSAIC_* environment > TOML file > defaults."""

from __future__ import annotations

import json
import math
import re
import tomllib
from contextvars import ContextVar
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from mosaic_proto import Aggregator, AggregatorKind, Attack, AttackKind, SamplerKind, Strategy, byzantine_ranks
from mosaic_proto.compression import Compression, Compressor
from mosaic_proto.profiles import NodeProfile, NodeProfiles, ProfileError
from mosaic_proto.quadratic import CORRELATED_MAX_DIM, Curvature
from mosaicd.extras import require


class TaskName(StrEnum):
    QUADRATIC = "quadratic"
    DIGITS = "digits"
    TEACHER = "teacher"
    CIFAR10 = "cifar10"
    CIFAR100 = "cifar100"
    MOVIELENS = "movielens"
    SHAKESPEARE = "shakespeare"


class EventLoop(StrEnum):
    """The event loop a process runs its role on (`mosaicd.daemon.loop`): it moves the same bytes, so no model
    depends on it."""

    AUTO = "auto"  # uvloop where it is installed, asyncio's own otherwise
    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"


UVLOOP_MISSING = ("uvloop is not installed here: `pip install uvloop` (on Linux mosaic-learning installs it), or "
                  "give auto (uvloop where installed) or asyncio")


def uvloop_installed() -> bool:
    """Whether uvloop can be imported, without importing it (a settings check stays cheap)."""
    from importlib.util import find_spec

    try:
        return find_spec("uvloop") is not None
    except (ImportError, ValueError):
        return False


class Partition(StrEnum):
    IID = "iid"
    DIRICHLET = "dirichlet"
    SHARDS = "shards"
    NATURAL = "natural"


COMMANDS = ("node", "barrier", "cluster", "simulate")


def cli(group: str, *commands: str, metavar: str | None = None) -> dict[str, Any]:
    """A setting's place on the command line (Field metadata): its help group and the subcommands that take it
    (default: all), and the flag's metavar where the type does not say it. `mosaicd`'s flags are generated from it."""
    extra: dict[str, Any] = {"group": group, "commands": list(commands or COMMANDS)}
    if metavar is not None:
        extra["metavar"] = metavar
    return {"json_schema_extra": extra}


OWN_LOOP = "own loop"  # the task an own training loop's run shows where its loop gives no name
TASK_ENTRY_POINTS = "mosaic_learning.tasks"  # the entry-point group a package registers its task names in
TaskOption = str | int | float | bool


def task_spec(value: str) -> str:
    """`--task` as the run carries it: a built-in's `TaskName`, a registered name, `module:Class`, or
    `/absolute/file.py:Class` (resolved here, once, so that processes started in another folder find the file).
    Imports nothing: whether the task can be built is `learning.tasks.check_task`'s question."""
    if isinstance(value, TaskName):
        return value
    text = str(value).strip()
    if text in TaskName._value2member_map_:
        return TaskName(text)
    where, colon, name = text.rpartition(":")
    if not colon:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", text) or text not in _registered_tasks():
            raise ValueError(f"expected one of {', '.join(TaskName)}, a task a package registers (entry points "
                             f"{TASK_ENTRY_POINTS!r}), MODULE:CLASS or path/to/file.py:CLASS")
        return text
    if not name.isidentifier():
        raise ValueError(f"{name!r} is not a class name (expected MODULE:CLASS or path/to/file.py:CLASS)")
    if where.endswith(".py") or "/" in where or "\\" in where:
        return f"{Path(where).expanduser().resolve()}:{name}"
    if not all(part.isidentifier() for part in where.split(".")):
        raise ValueError(f"{where!r} is neither a module name nor a .py file (expected MODULE:CLASS or "
                         "path/to/file.py:CLASS)")
    return text


def _registered_tasks() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group=TASK_ENTRY_POINTS)}


def task_options(value: Any) -> dict[str, TaskOption]:
    """`--task-option key=value` items (a list; values read as TOML: 8, 0.5, true, a bare word as text) or a
    table (TOML, MOSAIC_TASK_OPTIONS as JSON) as the keyword arguments of the task's constructor."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list | tuple):
        items: dict[str, Any] = {}
        for item in value:
            key, sep, text = str(item).partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{item!r}: expected key=value (e.g. --task-option width=16)")
            try:
                items[key.strip()] = tomllib.loads(f"value = {text.strip()}")["value"]
            except tomllib.TOMLDecodeError:
                items[key.strip()] = text.strip()
        value = items
    if isinstance(value, dict):
        for key in value:
            if not str(key).isidentifier():
                raise ValueError(f"{key!r}: an option is a keyword argument of the task's constructor, a Python name")
    return value


class OptimizerState(StrEnum):
    KEEP = "keep"
    RESET = "reset"


# The built-in optimizers and the keyword arguments each takes besides lr (tests/learning/test_optim.py holds them
# to the real constructors); sgd is `torch_util.SGD`, the others torch.optim's classes.
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "rmsprop": ("alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
    "adagrad": ("lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"),
}
# The built-in schedules and their options (learning/tasks/optim.py: `Schedule`).
LR_SCHEDULES: dict[str, tuple[str, ...]] = {
    "constant": (),
    "step": ("step_size", "gamma"),
    "cosine": ("eta_min", "T_max"),
    "linear": ("start_factor", "end_factor", "total_iters"),
}


def import_path(value: str, what: str, names: Any) -> str:
    """A built-in name of `names`, MODULE:CLASS or path/to/file.py:CLASS (made absolute, as `task_spec` does; checked
    for form only: importing it is the task's business)."""
    text = str(value).strip()
    if text.lower() in names:
        return text.lower()
    module, colon, name = text.rpartition(":")
    if colon and name.isidentifier() and (module.endswith(".py") or "/" in module or "\\" in module):
        return f"{Path(module).expanduser().resolve()}:{name}"
    if not colon or not name.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"expected one of {', '.join(names)} or a {what} class as MODULE:CLASS or "
                         "path/to/file.py:CLASS")
    return text


def _void_training(run: RunConfig) -> str | None:
    """Why a training setting of `run` can change nothing (a flag without an effect is refused), or None."""
    training = {"optimizer": run.optimizer != "sgd", "optimizer_options": bool(run.optimizer_options),
                "momentum": run.momentum != 0, "weight_decay": run.weight_decay != 0,
                "lr_schedule": run.lr_schedule != "constant", "lr_schedule_options": bool(run.lr_schedule_options),
                "lr_warmup_steps": run.lr_warmup_steps != 0, "clip_grad_norm": run.clip_grad_norm is not None}
    given = [flag_name(k) for k, v in training.items() if v]
    if run.own_loop and (given or run.task_options):
        return (f"{', '.join(given or ['--task-option'])}: with --own-loop your loop trains and builds its model "
                "(mosaicd.Peer); these settings are for tasks")
    if given and (not run.train or run.local_steps == 0):
        why = "--no-train" if not run.train else "--local-steps 0"
        return f"{', '.join(given)}: no local step is taken with {why}, so no optimizer runs"
    if given and run.task is TaskName.QUADRATIC:
        return (f"{', '.join(given)}: the quadratic task takes plain gradient steps (--lr, --local-steps); "
                "the optimizer settings are for torch tasks")
    for key in ("lr", "momentum", "weight_decay"):
        if key in run.optimizer_options:
            return f"--optimizer-option {key}: give it as {flag_name(key)}"
    opts = OPTIMIZERS.get(run.optimizer)
    if opts is not None:
        for key in ("momentum", "weight_decay"):
            if getattr(run, key) != 0 and key not in opts:
                return (f"{flag_name(key)} {getattr(run, key):g}: --optimizer {run.optimizer} takes no {key} "
                        f"(its options: {', '.join(opts)})")
        unknown = [k for k in run.optimizer_options if k not in opts]
        if unknown:
            return (f"--optimizer-option {unknown[0]}: --optimizer {run.optimizer} takes no such argument (its "
                    f"options: {', '.join(opts)}; lr is --lr)")
    sgd_buffer = run.optimizer == "sgd" and run.momentum != 0
    if sgd_buffer and run.optimizer_state is OptimizerState.RESET and run.local_steps == 1:
        return (f"--momentum {run.momentum:g}: with --optimizer-state reset and --local-steps 1 every round starts "
                "from an empty momentum buffer and takes one step, which momentum does not change (keep the state: "
                "--optimizer-state keep, or take more local steps)")
    if run.optimizer == "sgd" and run.optimizer_options.get("nesterov") and run.momentum == 0:
        return "--optimizer-option nesterov=true needs --momentum above 0"
    schedule_opts = LR_SCHEDULES.get(run.lr_schedule)
    if schedule_opts is not None:
        unknown = [k for k in run.lr_schedule_options if k not in schedule_opts]
        if unknown:
            takes = f"its options: {', '.join(schedule_opts)}" if schedule_opts else "it takes none"
            return f"--lr-schedule-option {unknown[0]}: --lr-schedule {run.lr_schedule} takes no such option ({takes})"
        if run.lr_schedule == "step" and "step_size" not in run.lr_schedule_options:
            return "--lr-schedule step needs --lr-schedule-option step_size=STEPS (local steps between decays)"
    total = run.rounds * run.local_steps
    if run.lr_warmup_steps > total:
        return (f"--lr-warmup-steps {run.lr_warmup_steps}: the run takes {total} local steps in all (--rounds x "
                "--local-steps)")
    return None


class SettingsError(ValueError):
    """A settings problem, worded for the person who typed the flag."""


_toml_path: ContextVar[Path | None] = ContextVar("mosaic_toml_path", default=None)


class _TomlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _toml_path.get()
        if path is None:
            return {}
        with open(path, "rb") as f:
            data = tomllib.load(f)
        table = data.pop("mosaic", None)  # the settings may sit in a [mosaic] table; any other table is refused
        if isinstance(table, dict):
            data.update(table)
        elif table is not None:
            data["mosaic"] = table
        return {k.replace("-", "_"): v for k, v in data.items()}


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
    # robustness (docs/security.md): how nodes aggregate, and members that lie
    aggregator: AggregatorKind = Field(AggregatorKind.MEAN, description="fragment-wise aggregation: mean (the "
                                       "paper's), trimmed-mean (coordinate-wise, --trim), clipped (self-centred, "
                                       "--clip-radius)", **cli("run"))
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
        if self.task_options and isinstance(self.task, TaskName):
            raise ValueError(f"--task-option: the built-in task {self.task} takes no options (its settings are "
                             "flags); options go to a task given by import path or registered name")
        if self.fanout >= self.nodes:
            raise ValueError(f"--fanout {self.fanout} needs at least {self.fanout + 1} nodes, got --nodes {self.nodes}")
        if self.samples_per_node != 64 and self.task is not TaskName.TEACHER:
            raise ValueError(f"--samples-per-node {self.samples_per_node}: only the teacher task makes its data; "
                             f"--task {self.task}'s is what it loads")
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
        if (void := _void_training(self)) is not None:
            raise ValueError(void)
        if self.node_profile is not None:
            try:
                self.node_profiles()
            except ProfileError as exc:
                raise ValueError(f"--node-profile {exc}") from None
        return self

    def profile_spec(self) -> NodeProfiles | None:
        """--node-profile as written (its compute_s, draws and named nodes), or None."""
        return None if self.node_profile is None else NodeProfiles.from_json(self.node_profile)

    def node_profiles(self) -> tuple[NodeProfile, ...] | None:
        """Each rank's profile (draws from --seed), the same on every node and in simulate; None without one."""
        spec = self.profile_spec()
        return None if spec is None else spec.resolve(self.seed, self.nodes)

    def aggregator_rule(self) -> Aggregator:
        """The aggregation every node of the run applies (`mosaic_proto.robust`)."""
        return Aggregator(self.aggregator, self.trim, self.clip_radius)

    def compressor_of(self, node: int) -> Compressor:
        """`node`'s side of the run's --compress (its error feedback starts empty)."""
        return Compressor(Compression.parse(self.compress), seed=self.seed, node=node,
                          error_feedback=self.error_feedback)

    def byzantine_ranks(self) -> tuple[int, ...]:
        """The ranks that attack, drawn from the seed: the same on every node and in simulate."""
        return byzantine_ranks(self.seed, self.nodes, self.byzantine)

    def attack_of(self, node: int) -> Attack | None:
        """How `node` lies, or None for an honest node."""
        if node not in self.byzantine_ranks():
            return None
        return Attack.of(self.attack, self.seed, node, self.nodes, self.byzantine, self.attack_scale)

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


class DaemonOptions(BaseModel):
    """How one process listens, reaches the others, waits and writes. Nothing here changes the models."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out: Path = Field(Path("runs/latest"), description="output directory (`cluster`, `simulate`: when not given, a "
                      "new folder per run, runs/<run id>-<UTC time>)", **cli("outputs"))
    replace: bool = Field(False, description="start a new run in an --out that holds one: `cluster` and `simulate` "
                          "remove its files (summary, CSVs, logs, journal, checkpoints; nothing else); the barrier "
                          "keeps a finished run's files in OUT/earlier/ (without it, it refuses to wait for nodes "
                          "of a run that is over)", **cli("outputs", "barrier", "cluster", "simulate"))
    tensorboard: Path | None = Field(None, description="also write each evaluated round's metrics as TensorBoard "
                                     "scalars, to DIR/<the run folder's name> (the [tensorboard] extra)",
                                     **cli("outputs", "barrier", "cluster", "simulate"))
    mlflow: Path | None = Field(None, description="also log the run's settings and each evaluated round's metrics "
                                "to the MLflow store DIR/mlflow.db, experiment --run-id (the [mlflow] extra)",
                                **cli("outputs", "barrier", "cluster", "simulate"))
    # the network
    host: str = Field("127.0.0.1", description="address to listen on", **cli("network", "node", "barrier"))
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)",
                      **cli("network", "node", "barrier"))
    advertise: str | None = Field(None, description="host:port other nodes use to reach this one",
                                  **cli("network", "node"))
    barrier_url: str | None = Field(None, description="barrier peer, e.g. http://barrier:8000",
                                    **cli("network", "node"))
    peer_list: Path | None = Field(None, description="file of host:port lines; rank 0 hosts the barrier",
                                   **cli("network", "node"))
    expect_dns: str | None = Field(None, description="barrier: count nodes as the addresses this name resolves to",
                                   **cli("network", "barrier"))
    dns_settle: float = Field(3.0, gt=0, description="barrier with --expect-dns: seconds the DNS answer must hold "
                              "still before it counts (raise it when many replicas start slowly)",
                              **cli("network", "barrier"))
    expect_settle: float | None = Field(None, gt=0, description="barrier: count nodes as those registered once "
                                        "none new has registered for this many seconds, or for twice the longest "
                                        "pause between registrations so far (replicas whose number the barrier is "
                                        "not told: compose --scale on the host's network)",
                                        **cli("network", "barrier"))
    port_file: Path | None = Field(None, description="write the port listened on to this file (with --port 0: for a "
                                   "health check); a process started again with --port 0 takes that port back when "
                                   "it is free, so peers find it at the same address", **cli("network", "node",
                                                                                              "barrier"))
    register_deadline: float = Field(300.0, gt=0, description="seconds to wait for every node to register",
                                     **cli("network", "node", "barrier", "cluster"))
    drop_after: int = Field(2, ge=1, description="rounds a member may miss before it is dropped",
                            **cli("network", "node", "barrier", "cluster"))
    request_timeout: float = Field(30.0, gt=0, description="seconds per HTTP request",
                                   **cli("network", "node", "barrier", "cluster"))
    retries: int = Field(3, ge=0, description="retries of a failed send", **cli("network", "node", "cluster"))
    max_body_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="largest accepted request body",
                                **cli("network", "node", "barrier", "cluster"))
    # limits under abuse (daemon/limits.py)
    header_timeout: float = Field(20.0, gt=0, description="seconds a connection may take to send a request's "
                                  "head, from connecting or from its previous answer: idle or slower ones are "
                                  "closed (a body must arrive within --request-timeout, else 408)",
                                  **cli("network", "node", "barrier"))
    max_connections: int = Field(4096, ge=8, description="connections served at once (fewer where the open-file "
                                 "limit is lower), a quarter of them from one address; a newcomer beyond it "
                                 "closes the oldest idle one, or is answered 503 when none is idle",
                                 **cli("network", "node", "barrier"))
    max_bodies: int = Field(4, ge=1, description="request bodies received at once, half of them (at least one) "
                            "from one address, together at most --max-body-bytes; others wait a moment, then 503",
                            **cli("network", "node", "barrier"))
    register_rate: float = Field(5.0, gt=0, description="barrier: registrations a second one address may make "
                                 "while registration is open, in bursts of --nodes + 10; beyond it 429",
                                 **cli("network", "node", "barrier"))
    secret_file: Path | None = Field(None, description="file holding the cluster secret (16+ bytes): every request "
                                     "between members is signed with it and checked (MOSAIC_SECRET_FILE)",
                                     **cli("network", "node", "barrier", "cluster"))
    max_norm: float | None = Field(None, gt=0, description="refuse a received fragment whose norm is over this many "
                                   "times the node's own (a guard against faults, not against attacks)",
                                   **cli("network", "node", "cluster", "simulate"))
    insecure: bool = Field(False, description="run without --secret-file: anyone who reaches a port (on loopback, "
                           "any local user) can join the run and send it models; without it a node refuses to start "
                           "with no secret, `mosaicd barrier` makes its own (OUT.secret) and `mosaicd cluster` one "
                           "for each run", **cli("network", "node", "barrier", "cluster"))
    tls_cert: Path | None = Field(None, description="PEM certificate (chain) this member serves TLS with and shows "
                                  "as a client; with it every URL between members is https:// (needs --tls-key)",
                                  **cli("network", "node", "barrier", "cluster"))
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert",
                                 **cli("network", "node", "barrier", "cluster"))
    tls_ca: Path | None = Field(None, description="PEM CA bundle that signed the members' certificates: clients "
                                "verify servers against it (else the system's CAs), and --tls-client-auth servers "
                                "their clients", **cli("network", "node", "barrier", "cluster"))
    tls_client_auth: bool = Field(False, description="mutual TLS: accept only clients showing a certificate that "
                                  "--tls-ca signed (needs --tls-ca)", **cli("network", "node", "barrier", "cluster"))
    event_loop: EventLoop = Field(EventLoop.AUTO, description="the event loop node, barrier and launcher run on: "
                                  "auto (uvloop where it is installed: its sockets and TLS are C), uvloop, or "
                                  "asyncio (Python's own); no model depends on it",
                                  **cli("network", "node", "barrier", "cluster"))
    # surviving faults
    barrier_grace: float = Field(120.0, gt=0, description="node: seconds to keep retrying an unreachable barrier "
                                 "(it may be restarting: it resumes the run from OUT/barrier-state.json)",
                                 **cli("network", "node", "cluster"))
    allow_join: bool = Field(False, description="barrier: let new nodes join during the run (they get the next "
                             "free rank and a live peer's model, and are sampled from the next round on)",
                             **cli("network", "node", "barrier"))
    state_dir: Path | None = Field(None, description="node: where it checkpoints its model and round (default: "
                                   "OUT/state/<host_port>); a node started again with it rejoins the run",
                                   **cli("network", "node"))
    checkpoint_every: int = Field(1, ge=0, description="node: checkpoint every N rounds (0: never)",
                                  **cli("network", "node", "cluster"))
    rejoin_max_age: int = Field(2, ge=0, description="node: a rejoining node takes its checkpoint if it is at most "
                                "this many rounds old, else a live peer's model", **cli("network", "node"))
    resume_round: int | None = Field(None, ge=0, description="barrier and node: resume the interrupted run of OUT "
                                     "from this open round (the newest the journal keeps or the one before), every "
                                     "member started again with its checkpoint of it, at any address; `mosaicd "
                                     "cluster --resume` picks it", **cli("network", "node", "barrier"))
    leave_on_signal: bool = Field(True, description="node: on SIGTERM or SIGINT, tell the barrier it leaves the run "
                                  "(it is not waited for from then on), then exit 0; `mosaicd cluster` turns it off: "
                                  "there Ctrl-C interrupts the whole run, which --resume continues",
                                  **cli("network", "node"))
    rejoin_dropped: bool = Field(False, description="node: when the barrier drops it (it was cut off or stalled), "
                                 "register again and rejoin at the next round boundary instead of exiting",
                                 **cli("network", "node"))

    @field_validator("tensorboard", "mlflow")
    @classmethod
    def _tracker(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None:  # said before the run starts, not by the barrier once the nodes are up
            require("it", *{"tensorboard": ("tensorboard",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}[
                info.field_name])
        return value

    @field_validator("event_loop")
    @classmethod
    def _event_loop(cls, value: EventLoop) -> EventLoop:
        if value is EventLoop.UVLOOP and not uvloop_installed():  # said at start, not when the loop is made
            raise ValueError(UVLOOP_MISSING)
        return value

    @field_validator("barrier_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query:
            raise ValueError("expected http://host:port (the barrier's address, e.g. http://barrier:8000)")
        return value.rstrip("/")

    @property
    def nodes_counted(self) -> bool:
        """The run's node count is counted, not given by --nodes: the addresses a DNS name resolves to, the nodes
        registered once none new come, a peer list's lines (a restarted barrier takes its journal's count)."""
        return bool(self.expect_dns or self.expect_settle or self.peer_list)

    @model_validator(mode="after")
    def _tls(self) -> DaemonOptions:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together (the certificate and its private key)")
        if self.tls_client_auth and self.tls_ca is None:
            raise ValueError("--tls-client-auth needs --tls-ca (the CA that signed the clients' certificates)")
        if self.tls_cert is None and (self.tls_ca is not None or self.tls_client_auth):
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: members reach each other over TLS only "
                             "when every member serves it")
        if self.barrier_url is not None:
            https = urlsplit(self.barrier_url).scheme == "https"
            if https and self.tls_cert is None:
                raise ValueError(f"--barrier-url {self.barrier_url}: an https:// barrier needs --tls-cert and "
                                 "--tls-key (every member of a TLS cluster serves TLS)")
            if not https and self.tls_cert is not None:
                raise ValueError(f"--barrier-url {self.barrier_url}: with --tls-cert the members speak TLS: "
                                 "give the barrier's https:// address")
        return self



class Settings(BaseSettings, RunConfig, DaemonOptions):
    """Every knob of a run, a node, the barrier and the tooling. Field names are the CLI flags."""

    model_config = SettingsConfigDict(env_prefix="MOSAIC_", extra="forbid", validate_default=True, frozen=False)

    batched: bool = Field(False, description="simulate: train and evaluate all nodes' models together (vmap); "
                          "close to, not bit-identical with, the exact run", **cli("learning", "simulate"))
    data_dir: Path = Field(Path("data"), description="where data sets live", **cli("outputs"))
    checkpoint_rounds: int = Field(10, ge=0, description="simulate: save what --resume continues from (every "
                                   "node's model, the barrier's state) after every N rounds (0: never)",
                                   **cli("outputs", "simulate"))
    checkpoint_seconds: float = Field(30.0, ge=0, description="simulate: ... and after a round that ends this many "
                                      "seconds after the last save, if that comes first (0: by rounds only)",
                                      **cli("outputs", "simulate"))
    linger: float = Field(0.0, ge=0, description="seconds a node keeps serving after its last round",
                          **cli("outputs", "node", "barrier"))
    log_level: str = Field("info", pattern=r"^(debug|info|warning|error)$", **cli("outputs"))
    log_json: bool | None = Field(None, description="JSON log lines, every one, for log shippers (default: lines "
                                  "for people, a warning of a kind at most every 10 s)", **cli("outputs"))
    log_file: Path | None = Field(None, description="node, barrier: every log line (info and up), as JSON, also "
                                  "appended to this file, whatever the console shows (`mosaicd log` reads a run's "
                                  "OUT/logs/*.log; rank 0 of a --peer-list writes its own there)",
                                  **cli("outputs", "node", "barrier"))

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, **_: PydanticBaseSettingsSource) -> tuple:
        return init_settings, env_settings, _TomlSource(settings_cls)

    @classmethod
    def load(cls, config: Path | None = None, **flags: Any) -> Settings:
        """Build settings from explicit flags, the environment and an optional TOML file; errors name the flag."""
        if config is not None and not Path(config).is_file():
            raise SettingsError(f"--config: no such file: {config}")
        token = _toml_path.set(Path(config) if config else None)
        try:
            return cls(**{k: v for k, v in flags.items() if v is not None})
        except ValidationError as exc:
            raise SettingsError(format_errors(exc, config)) from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"--config {config}: not valid TOML: {exc}") from None
        finally:
            _toml_path.reset(token)

    def run_config(self) -> RunConfig:
        return RunConfig.model_validate({k: getattr(self, k) for k in RunConfig.model_fields})

    def daemon_options(self) -> DaemonOptions:
        return DaemonOptions.model_validate({k: getattr(self, k) for k in DaemonOptions.model_fields})

    def run_fields(self) -> dict[str, Any]:
        """The fields every node of a run must share, as JSON (what the barrier hands out)."""
        return self.run_config().model_dump(mode="json")


OPTION_TABLES = {"task_options": "--task-option", "optimizer_options": "--optimizer-option",
                 "lr_schedule_options": "--lr-schedule-option"}  # tables given as repeated KEY=VALUE flags


def flag_name(name: str) -> str:
    """A setting's flag: `--local-steps`; `--task-option` (repeated) for the table `task_options`."""
    return OPTION_TABLES.get(name) or "--" + name.replace("_", "-")


def format_errors(exc: ValidationError, config: Path | None = None) -> str:
    """One line for the errors, each naming where the value can come from: its flag, its variable, --config's key."""
    lines = []
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        if err["type"] == "extra_forbidden" and loc:  # only a --config file can name a setting that does not exist
            kind = "table" if isinstance(err.get("input"), dict) else "setting"
            lines.append(f"--config {config}: unknown {kind} {loc[0]!r} (see mosaicd node --help for the settings)"
                         if config else f"unknown setting {loc[0]!r} (a Settings argument; see mosaicd node --help)")
            continue
        key = f", or {loc[0]} in --config {config}" if config and loc else ""
        where = f"{flag_name(loc[0])} (MOSAIC_{loc[0].upper()}{key})" if loc else "settings"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" + (f" (got {err['input']!r})" if loc and "input" in err else ""))
    return "; ".join(lines)
