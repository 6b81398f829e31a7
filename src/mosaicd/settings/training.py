"""Training settings that cannot change anything: a flag without an effect is refused, not recorded."""

from __future__ import annotations

from typing import Any

from mosaicd.settings.flags import flag_name
from mosaicd.settings.values import LR_SCHEDULES, OPTIMIZERS, OptimizerState, TaskName


def void_training(run: Any) -> str | None:
    """Why a training setting of `run` (a `RunConfig`) can change nothing (such a flag is refused), or None."""
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
