"""No setting without an effect: `EFFECTS`, the one table of what each setting needs to change anything (`alpha`
needs `--partition dirichlet`, ...), and `ALWAYS`, the settings that always have one. A setting given away from its
default where its needs do not hold is refused in one line naming both flags, before anything starts: by the
settings' own validators (so every command, the TOML loader and each run of a sweep), by a sweep for each [grid]
axis (`void_axis`); the CLI's help and the docs' reference show the needs. Values only: nothing is built here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from itertools import product
from typing import Any

from mosaicd.settings.flags import flag_name
from mosaicd.settings.values import LR_SCHEDULES, OPTIMIZERS, TaskName


@dataclass(frozen=True)
class Need:
    """One condition a setting needs to have an effect: `flags` as a person would give them, `holds` of the
    settings (a model, or raw values over the defaults), `why` said when it does not hold (with {task},
    {partition}, {aggregator} and {optimizer}: their values)."""

    flags: str
    holds: Callable[[Any], bool]
    why: str


def _builtin(task: Any) -> bool:
    return str(task) in TaskName._value2member_map_


TASK = Need("a task (not --own-loop)", lambda s: not s.own_loop,
            "with --own-loop your loop trains and builds its model (mosaicd.Peer)")
TRAINS = Need("--train", lambda s: bool(s.train), "--no-train runs protocol-only rounds: nothing is trained")
STEPS = Need("--local-steps 1 or more", lambda s: s.local_steps > 0, "no local step is taken with --local-steps 0")
NOT_QUADRATIC = Need("a --task other than quadratic", lambda s: s.own_loop or str(s.task) != TaskName.QUADRATIC,
             "the quadratic task takes plain numpy gradient steps (--lr, --local-steps) on no data set")
QUADRATIC = Need("--task quadratic", lambda s: s.own_loop or str(s.task) == TaskName.QUADRATIC,
                 "a setting of the quadratic objective; the task here is {task}")
OPTIMIZER = (TASK, TRAINS, STEPS, NOT_QUADRATIC)  # what every optimizer setting needs: a task's local steps
# --sync (a run setting: a node's own options, without it, are of a barrier run)
BARRIER = Need("--sync barrier", lambda s: str(getattr(s, "sync", "barrier")) == "barrier",
               "asynchronous nodes never wait for a round, and simulate --sync async trains node by node")
ASYNC = Need("--sync async", lambda s: str(s.sync) == "async", "a barrier's rounds push fragments to sampled peers")
PUSH = Need("--exchange push", lambda s: str(getattr(s, "exchange", "push")) == "push",
            "--exchange pairwise averages whole models with one peer (AD-PSGD): no fragment, sampler, codec or rule")


def _takes(key: str) -> Need:
    return Need(f"an --optimizer that takes {key.replace('_', ' ')} ("
                + ", ".join(n for n, opts in OPTIMIZERS.items() if key in opts) + ", or a MODULE:CLASS)",
                lambda s: s.optimizer not in OPTIMIZERS or key in OPTIMIZERS[s.optimizer],
                f"--optimizer {{optimizer}} takes no {key}")


EFFECTS: dict[str, tuple[Need, ...]] = {
    # the task and its data
    "task_options": (TASK, Need("a --task of your own (MODULE:CLASS, FILE.py:CLASS or a registered name)",
                                lambda s: not _builtin(s.task),
                                "the built-in task {task} takes no options (its settings are flags)"),),
    "samples_per_node": (Need("--task teacher", lambda s: not s.own_loop and str(s.task) == TaskName.TEACHER,
                              "only the teacher task makes its data; --task {task}'s is what it loads"),),
    "dim": (QUADRATIC,), "curvature": (QUADRATIC,), "heterogeneous": (QUADRATIC,),
    "partition": (NOT_QUADRATIC,),
    "alpha": (NOT_QUADRATIC, Need("--partition dirichlet", lambda s: s.partition == "dirichlet",
                          "the Dirichlet partition's concentration; the partition here is {partition}")),
    "min_samples": (NOT_QUADRATIC, Need("--partition dirichlet", lambda s: s.partition == "dirichlet",
                                "the least samples of a Dirichlet draw; the partition here is {partition}")),
    "shards_per_node": (NOT_QUADRATIC, Need("--partition shards", lambda s: s.partition == "shards",
                                    "label shards per node; the partition here is {partition}")),
    "threads": (NOT_QUADRATIC,), "device": (NOT_QUADRATIC,), "eval_samples": (NOT_QUADRATIC,),
    # the protocol
    "strategy": (Need("--fragments 2 or more", lambda s: s.fragments > 1,
                      "with one fragment the whole model travels as one, however it is cut"), PUSH),
    # asynchronous runs (--sync async): what only a barrier's rounds use, and what pairwise averaging leaves out
    "round_deadline": (BARRIER,), "max_norm": (PUSH,),
    "checkpoint_rounds": (Need("--eval-every 1 or more, or --sync barrier",
                               lambda s: str(getattr(s, "sync", "barrier")) == "barrier" or s.eval_every > 0,
                               "simulate --sync async checkpoints at the points of its evaluation grid, and "
                               "--eval-every 0 has none"),),
    "exchange": (ASYNC,), "async_send": (ASYNC, PUSH),
    "time_budget": (Need("--sync async", lambda s: str(s.sync) == "async",
                         "a barrier run ends after its --rounds rounds, each bounded by --round-deadline"),),
    "fragments": (PUSH,), "fanout": (PUSH,), "sampler": (PUSH,), "compress": (PUSH,), "aggregator": (PUSH,),
    "byzantine": (PUSH,),
    "trim": (Need("--aggregator trimmed-mean", lambda s: s.aggregator == "trimmed-mean",
                  "the values a trimmed mean cuts; the aggregator here is {aggregator}"),),
    "clip_radius": (Need("--aggregator clipped", lambda s: s.aggregator == "clipped",
                         "the radius of clipped aggregation; the aggregator here is {aggregator}"),),
    "attack": (Need("--byzantine 1 or more", lambda s: s.byzantine > 0, "no node attacks with --byzantine 0"),),
    "attack_scale": (Need("--byzantine 1 or more", lambda s: s.byzantine > 0, "no node attacks with --byzantine 0"),),
    "error_feedback": (Need("a lossy --compress (fp16, bf16, int8, topk:FRACTION)", lambda s: str(s.compress) != "none",
                            "it carries what a lossy message left out, and with --compress none nothing is"),),
    # local training
    "local_steps": (TRAINS,),
    "lr": (TRAINS, STEPS),
    "batch_size": (TRAINS, STEPS, NOT_QUADRATIC),
    "optimizer": OPTIMIZER, "optimizer_options": OPTIMIZER, "lr_schedule": OPTIMIZER,
    "lr_schedule_options": OPTIMIZER, "lr_warmup_steps": OPTIMIZER, "clip_grad_norm": OPTIMIZER,
    "momentum": (*OPTIMIZER, _takes("momentum"),
                 Need("--optimizer-state keep or --local-steps 2 or more",
                      lambda s: not (s.optimizer == "sgd" and s.optimizer_state == "reset" and s.local_steps == 1),
                      "with --optimizer-state reset and --local-steps 1 every round starts from an empty momentum "
                      "buffer and takes one step, which momentum does not change")),
    "weight_decay": (*OPTIMIZER, _takes("weight_decay")),
    "optimizer_state": (*OPTIMIZER, Need("a stateful optimizer (--momentum above 0, or an --optimizer other than "
                                         "sgd)", lambda s: s.optimizer != "sgd" or s.momentum > 0,
                                         "sgd without momentum keeps nothing from one step to the next")),
    "batched": (TRAINS, BARRIER),
    # processes
    "dns_settle": (Need("--expect-dns", lambda s: bool(s.expect_dns),
                        "how long --expect-dns's answer must hold still"),),
    "nodes_per_address": (Need("--expect-dns", lambda s: bool(s.expect_dns),
                               "it multiplies the addresses --expect-dns resolves to"),),
    "expect_settle": (Need("no --expect-dns", lambda s: not s.expect_dns, "--expect-dns counts the nodes"),),
    "tls_client_auth": (Need("--tls-ca", lambda s: s.tls_ca is not None,
                             "the CA that signed the clients' certificates"),),
    "tls_ca": (Need("--tls-cert and --tls-key", lambda s: s.tls_cert is not None,
                    "members reach each other over TLS only when every member serves it"),),
    "rejoin_max_age": (Need("--checkpoint-every 1 or more", lambda s: s.checkpoint_every > 0,
                            "a rejoining node's checkpoint, and --checkpoint-every 0 writes none"),),
    "nodes_per_process": (Need("--barrier-url", lambda s: s.barrier_url is not None,
                               "its members register with a barrier, each as a node"),),
    "checkpoint_seconds": (Need("--checkpoint-rounds 1 or more", lambda s: s.checkpoint_rounds > 0,
                                "simulate saves nothing with --checkpoint-rounds 0"),),
}

ALWAYS = frozenset({
    # the run: each changes the models or what the run records, whatever else is given
    "run_id", "own_loop", "task", "nodes", "rounds", "seed", "sync", "node_profile", "train", "eval_every",
    # where and how a process works, writes and logs (a task of your own may read --data-dir)
    "out", "replace", "tensorboard", "mlflow", "data_dir", "linger", "log_level", "log_json",
    "log_file",
    # the network, limits and faults: each a process's own, used whatever the run
    "host", "port", "advertise", "barrier_url", "peer_list", "expect_dns", "port_file", "register_deadline",
    "drop_after", "request_timeout", "retries", "max_body_bytes", "header_timeout", "max_connections", "max_bodies",
    "register_rate", "secret_file", "insecure", "tls_cert", "tls_key", "event_loop", "barrier_grace",
    "allow_join", "state_dir", "checkpoint_every", "resume_round", "leave_on_signal", "rejoin_dropped",
})


@cache
def defaults(model: type) -> dict[str, Any]:
    """Each field's default of a settings model (`RunConfig`, `DaemonOptions`, `Settings`)."""
    return {n: f.get_default(call_default_factory=True) for n, f in model.model_fields.items()}  # type: ignore


def given(name: str, value: Any, default: Any) -> bool:
    """Whether a setting is given, as far as its effect goes: away from its default (a default changes nothing)."""
    if isinstance(value, Mapping | list | tuple):
        return bool(value)
    return value != default


def needs_text(name: str) -> str | None:
    """What `name` needs to have an effect, as flags (`--partition dirichlet`), or None (always has one)."""
    needs = EFFECTS.get(name)
    return None if not needs else ", ".join(dict.fromkeys(n.flags for n in needs))


def _refusal(name: str, need: Need, settings: Any) -> str:
    values = {k: getattr(settings, k, None) for k in ("task", "partition", "aggregator", "optimizer")}
    flag = flag_name(name)
    if getattr(settings, name, None) is False:  # a switch turned off: --no-error-feedback
        flag = "--no-" + flag.removeprefix("--")
    return f"{flag} needs {need.flags}: " + need.why.format(**{k: str(v) for k, v in values.items()})


def unmet(name: str, settings: Any) -> str | None:
    """Why setting `name` of `settings` has no effect (one line naming both flags), or None."""
    for need in EFFECTS.get(name, ()):
        if not need.holds(settings):
            return _refusal(name, need, settings)
    return None


def void_setting(settings: Any, names: Iterable[str], defaults: Mapping[str, Any]) -> str | None:
    """The first of `names` given (away from `defaults`) where it has no effect: why, in one line; or None."""
    for name in names:
        if name in EFFECTS and given(name, getattr(settings, name), defaults[name]):
            if (why := unmet(name, settings)) is not None:
                return why
    return None


class _Values:
    """Raw values over the defaults, read as attributes (what `Need.holds` reads of a model)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)


def void_raw(name: str, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    """Whether setting `name` is given and void in `values` (raw values over the defaults, as a sweep has them)."""
    if name not in EFFECTS or not given(name, values[name], defaults[name]):
        return False
    try:
        return unmet(name, _Values(values)) is not None
    except (TypeError, ValueError):  # a value of the wrong type: each run's own validation names it
        return False


def void_axis(grid: Mapping[str, list[Any]], base: Mapping[str, Any], defaults: Mapping[str, Any]) -> str | None:
    """A sweep's [grid] axis that has no effect in some of its runs (it would compare runs that are the same):
    why, naming the axis; or None."""
    points = [dict(zip(grid, combo, strict=True)) for combo in product(*grid.values())]
    for axis in grid:
        void = [p for p in points if void_raw(axis, {**defaults, **base, **p}, defaults)]
        if void:
            why = unmet(axis, _Values({**defaults, **base, **void[0]}))
            where = ", ".join(f"{k} = {v!r}" for k, v in void[0].items())
            return (f"[grid] {axis}: no effect in {len(void)} of {len(points)} runs (e.g. {where}): {why}; "
                    f"sweep it only where it has one")
    return None


def shared_values(base: Mapping[str, Any], points: list[dict[str, Any]], point: Mapping[str, Any],
                  defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A sweep's [run] settings for the run of `point`: one that has an effect in other runs of the grid but none
    in this one is left at its default here (`alpha` in a grid over `partition`: only its dirichlet runs take it,
    and the others record the default they ran with); one void in every run is kept, and refused."""
    def void(key: str, p: Mapping[str, Any]) -> bool:
        return void_raw(key, {**defaults, **base, **p}, defaults)

    return {k: v for k, v in base.items() if not void(k, point) or all(void(k, p) for p in points)}


def training_values(run: Any) -> str | None:
    """Why the values of the training settings of `run` (a `RunConfig`) cannot all be used, or None: option keys
    the optimizer or schedule does not take, an option given twice, a step schedule without its step, a warm-up
    longer than the run."""
    for key in ("lr", "momentum", "weight_decay"):
        if key in run.optimizer_options:
            return f"--optimizer-option {key}: give it as {flag_name(key)}"
    opts = OPTIMIZERS.get(run.optimizer)
    if opts is not None:
        unknown = [k for k in run.optimizer_options if k not in opts]
        if unknown:
            return (f"--optimizer-option {unknown[0]}: --optimizer {run.optimizer} takes no such argument (its "
                    f"options: {', '.join(opts)}; lr is --lr)")
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
