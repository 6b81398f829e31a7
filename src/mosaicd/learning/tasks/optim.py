"""How a node's local steps move its model: the optimizer, its state across rounds, the learning-rate schedule and
gradient clipping (`--optimizer`, `--optimizer-state`, `--lr-schedule`, `--clip-grad-norm`; docs/spec.md).

A node's optimizer state (momentum buffers, Adam's moments and step counts) is its own: with `--optimizer-state
keep` it carries from one round to the next while the parameters are replaced by the aggregate, and it goes into
every checkpoint (`NodeOptimizers.state`, `restore`), so a resumed node steps as the uninterrupted one would.
The schedule keeps no state: the learning rate of round t's local step h is a function of the step t*H+h
(`Schedule.factor`), the same in every process, after a restart and for a node that joined late.

`sgd` is `torch_util.SGD` (torch.optim.SGD's arithmetic without importing torch.optim's optimizers, which load
torch._dynamo: ~70 MB and 1-2 s per process), `adam` and `adamw` on the CPU `torch_util.Adam` and `AdamW` (the same,
for torch.optim's single-tensor step); every other optimizer is a torch.optim class, imported where it is chosen, or a
class of the user's by MODULE:CLASS or FILE.py:CLASS (found as a task is). `check_training` builds the run's
optimizer once on a dummy parameter before the run; `NodeOptimizers.warm` pays its imports once in the warm start's
parent.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from mosaicd.settings import LR_SCHEDULES, OPTIMIZERS, OptimizerState, RunConfig, SettingsError

from .by_path import user_class
from .torch_util import SGD, Adam, AdamW

__all__ = ["ELEMENTWISE", "NodeOptimizers", "OptimizerFactory", "Schedule", "check_training", "clip_gradients",
           "optimizer_factory"]

OptimizerFactory = Callable[[Iterable[torch.Tensor]], Any]  # parameters -> a torch.optim.Optimizer (or `SGD`)

# torch.optim's arithmetic without torch.optim (torch_util): no torch._dynamo in the process. adam and adamw on the
# CPU only, where torch.optim takes the single-tensor step they copy (elsewhere it takes its multi-tensor one)
PLAIN: dict[str, type] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
TORCH_OPTIMIZERS = {"adam": "torch.optim:Adam", "adamw": "torch.optim:AdamW", "rmsprop": "torch.optim:RMSprop",
                    "adagrad": "torch.optim:Adagrad"}
# optimizers whose step treats every coordinate alike (its state shaped as the parameter, plus scalars): stacked
# models take one step of them together (`--batched`); others are stepped node by node
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop"}


def _import(spec: str, flag: str) -> Any:
    """The class `spec` (MODULE:CLASS or /file.py:CLASS) names, as a task is found (`by_path.user_class`)."""
    try:
        found = user_class(spec, f"{flag} {spec}")
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if not isinstance(found, type):
        raise SettingsError(f"{flag} {spec}: not a class (it is {found!r})")
    return found


def optimizer_class(run: RunConfig) -> type:
    if run.optimizer in PLAIN and (run.optimizer == "sgd" or str(run.device) == "cpu"):
        return PLAIN[run.optimizer]
    cls = _import(TORCH_OPTIMIZERS.get(run.optimizer, run.optimizer), "--optimizer")
    if not issubclass(cls, torch.optim.Optimizer):
        raise SettingsError(f"--optimizer {run.optimizer}: not a torch.optim.Optimizer subclass")
    return cls


def _keywords(run: RunConfig) -> dict[str, Any]:
    """The optimizer's constructor arguments besides its parameters: lr, momentum and weight decay where given."""
    given = {"momentum": run.momentum, "weight_decay": run.weight_decay}
    return {"lr": run.lr, **{k: v for k, v in given.items() if v != 0}, **run.optimizer_options}


def optimizer_factory(run: RunConfig) -> OptimizerFactory:
    """parameters -> the run's optimizer over them."""
    cls, keywords = optimizer_class(run), _keywords(run)
    return lambda params: cls(params, **keywords)


def check_training(run: RunConfig) -> None:
    """The run's optimizer built once on a dummy parameter (its class imported, its options bound to its
    constructor and checked by it) and its schedule asked for its factors, so that a value a node would fail on is a
    SettingsError naming the flag, in the command's own process, before any folder is made or process starts. A
    built-in optimizer without options is not built: its arguments are flags the settings checked."""
    if run.optimizer not in OPTIMIZERS or run.optimizer_options:
        _check_optimizer(run)
    if run.lr_schedule not in LR_SCHEDULES:
        try:
            Schedule(run).factor(max(0, run.rounds * run.local_steps - 1))
        except SettingsError:
            raise
        except Exception as exc:
            raise SettingsError(f"--lr-schedule {run.lr_schedule}: {type(exc).__name__}: {exc}") from None


def _option(key: str, value: Any) -> str:
    """`--optimizer-option KEY=VALUE` as it was given (the value written as TOML)."""
    text = json.dumps(value) if isinstance(value, bool | list | dict) else str(value)
    return f"--optimizer-option {key}={text.replace(', ', ',')}"


def _check_optimizer(run: RunConfig) -> None:
    cls, keywords = optimizer_class(run), _keywords(run)
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in keywords:
            if key not in params:
                flag = f"--optimizer-option {key}" if key in run.optimizer_options else f"--{key.replace('_', '-')}"
                raise SettingsError(f"{flag}: --optimizer {run.optimizer} takes no such argument (its arguments: "
                                    f"{', '.join(k for k in params if k not in ('self', 'params'))})")

    def fails(given: dict[str, Any]) -> Exception | None:
        try:
            cls([torch.zeros(1, requires_grad=True)], **given)
        except Exception as exc:  # noqa: BLE001 - whatever the constructor refuses, said naming the flag
            return exc
        return None

    failed = fails(keywords)
    if failed is None:
        return
    base = {k: v for k, v in keywords.items() if k not in run.optimizer_options}
    alone = {k: fails({**base, k: v}) for k, v in run.optimizer_options.items()}  # the option that fails by itself
    culprit = next((k for k, exc in alone.items() if exc is not None), None)
    hint = ""
    if culprit is not None:
        failed = alone[culprit] or failed
        flags = _option(culprit, run.optimizer_options[culprit])
        default = params[culprit].default if culprit in params else inspect.Parameter.empty
        if not isinstance(failed, ValueError) and default is not inspect.Parameter.empty:
            hint = f" ({cls.__name__}'s default: {culprit}={default!r})"
    else:  # none alone: the options together (or the flags every build has)
        flags = ", ".join([_option(k, v) for k, v in run.optimizer_options.items()] or [f"--optimizer {run.optimizer}"])
    why = str(failed) if isinstance(failed, ValueError) else f"{type(failed).__name__}: {failed}"
    raise SettingsError(f"{flags}: {' '.join(why.split())}{hint}")


class Schedule:
    """The factor on each parameter group's lr at local step g of the run (g = round * H + step): a warm-up over
    `--lr-warmup-steps`, then `--lr-schedule` over the steps after it."""

    def __init__(self, run: RunConfig) -> None:
        self.kind, self.options = run.lr_schedule, dict(run.lr_schedule_options)
        self.warmup = run.lr_warmup_steps
        self.steps = max(1, run.rounds * run.local_steps - self.warmup)  # the schedule's own length
        self.lr = run.lr
        self._table: list[float] | None = None  # a torch scheduler's factors, computed as far as asked
        self._scheduler: Any = None

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return self._after(0) * (step + 1) / self.warmup
        return self._after(step - self.warmup)

    def _after(self, g: int) -> float:
        o = self.options
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return float(o.get("gamma", 0.1)) ** (g // int(o["step_size"]))
        if self.kind == "cosine":
            span = int(o.get("T_max", self.steps))
            floor = float(o.get("eta_min", 0.0)) / self.lr
            return floor + (1.0 - floor) * (1 + math.cos(math.pi * min(g, span) / span)) / 2
        if self.kind == "linear":
            span = int(o.get("total_iters", self.steps))
            start, end = float(o.get("start_factor", 1.0)), float(o.get("end_factor", 0.0))
            return start + (end - start) * min(g, span) / span
        return self._torch(g)

    def _torch(self, g: int) -> float:
        """A torch.optim.lr_scheduler class stepped once per local step, on a one-parameter optimizer of lr 1."""
        if self._table is None:
            cls = _import(self.kind, "--lr-schedule")
            dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
            self._scheduler = cls(dummy, **self.options)
            self._table = [dummy.param_groups[0]["lr"]]
        while len(self._table) <= g:
            self._scheduler.optimizer.step()
            self._scheduler.step()
            self._table.append(self._scheduler.optimizer.param_groups[0]["lr"])
        return float(self._table[g])


def set_lr(optimizer: Any, factor: float) -> None:
    """Each group's lr as its first lr times `factor` (the first is kept as torch's schedulers keep it)."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float | None) -> None:
    if max_norm is not None:
        nn.utils.clip_grad_norm_(list(params), max_norm)


class NodeOptimizers:
    """Each node's optimizer over the one model a process trains all its nodes on: kept from round to round
    (`keep`) or made afresh each round (`reset`)."""

    def __init__(self, factory: OptimizerFactory, keep: bool) -> None:
        self.factory, self.keep = factory, keep
        self._kept: dict[int, Any] = {}
        self._pending: dict[int, dict[str, np.ndarray]] = {}  # restored before the node's optimizer exists

    @classmethod
    def of(cls, run: RunConfig, factory: OptimizerFactory | None = None) -> NodeOptimizers:
        return cls(factory or optimizer_factory(run), run.optimizer_state is OptimizerState.KEEP)

    def of_node(self, node: int, params: Iterable[torch.Tensor]) -> Any:
        """`node`'s optimizer over `params` (the same tensors every call: the model is loaded in place)."""
        if not self.keep:
            return self.factory(params)
        if node not in self._kept:
            self._kept[node] = self.factory(params)
            if node in self._pending:
                load_state(self._kept[node], self._pending.pop(node))
        return self._kept[node]

    def state(self, node: int) -> dict[str, np.ndarray]:
        """A copy of `node`'s optimizer state as named arrays (empty where it has none, or with `reset`)."""
        if node in self._pending:
            return {k: v.copy() for k, v in self._pending[node].items()}
        return state_arrays(self._kept[node]) if node in self._kept else {}

    def restore(self, node: int, state: dict[str, np.ndarray]) -> None:
        """Put `node`'s optimizer where `state` (from `state`) left it."""
        if not self.keep:
            if state:
                raise ValueError("an optimizer state is restored with --optimizer-state reset")
            return
        if node in self._kept:
            load_state(self._kept[node], state)
        else:
            self._pending[node] = {k: np.array(v) for k, v in state.items()}

    def states(self) -> dict[int, dict[str, np.ndarray]]:
        return {node: self.state(node) for node in sorted({*self._kept, *self._pending})}

    def warm(self) -> None:
        """An optimizer of the run built on a dummy parameter and stepped once, kept by no node, the random
        generators left as they were: what it imports at construction and at its first step (torch.optim's:
        torch._dynamo, ~70 MiB and 1-2 s) is paid by this process, the warm start's parent, and shared by the nodes
        it forks (`daemon.node.warmup.warm_up`)."""
        with torch.random.fork_rng(devices=[]):
            numpy_state = np.random.get_state()
            try:
                dummy = torch.zeros(1, requires_grad=True)
                optimizer = self.factory([dummy])
                dummy.grad = torch.ones(1)
                optimizer.step()
            finally:
                np.random.set_state(numpy_state)

    @property
    def elementwise(self) -> bool:
        """Whether the optimizer steps every coordinate alike, so that stacked models step together (`Stacked`)."""
        if not hasattr(self, "_elementwise"):
            self._elementwise = type(self.factory([torch.zeros(1, requires_grad=True)])).__name__ in ELEMENTWISE
        return self._elementwise

    def stacked(self, nodes: list[int], params: list[torch.Tensor], states: list[dict[str, np.ndarray]]) -> Stacked:
        """`nodes`' optimizer over their stacked `params`, from their `states` (as `state` gave them)."""
        return Stacked(self, nodes, params, states)


class Stacked:
    """One optimizer over m nodes' stacked parameters ((m, *shape) each), for `--batched` training: the nodes'
    states stacked in, stepped together (the optimizer is elementwise), and each node's slice kept after."""

    def __init__(self, optimizers: NodeOptimizers, nodes: list[int], params: list[torch.Tensor],
                 states: list[dict[str, np.ndarray]]) -> None:
        self.optimizers, self.nodes, self.params = optimizers, nodes, params
        self.optimizer = optimizers.factory(params)
        if optimizers.keep and states and states[0]:
            stacked = {}
            for key in states[0]:
                values = [state[key] for state in states]
                index = int(key.split("/")[1])
                if values[0].shape == tuple(params[index].shape[1:]) and key.startswith(_TENSOR):
                    stacked[key] = np.stack(values)
                else:
                    stacked[key] = values[0]
            load_state(self.optimizer, stacked)

    def step(self, grads: list[torch.Tensor], max_norm: float | None, factor: float) -> None:
        if max_norm is not None:  # clip_grad_norm_ per node: each node's norm over all its gradients
            m = len(self.nodes)
            norms = torch.stack([torch.linalg.vector_norm(g.reshape(m, -1), 2, dim=1) for g in grads], dim=1)
            total = torch.linalg.vector_norm(norms, 2, dim=1)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            grads = [g * coef.view(m, *([1] * (g.dim() - 1))) for g in grads]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        set_lr(self.optimizer, factor)
        self.optimizer.step()

    def keep(self) -> None:
        """Each node's slice of the stacked state, kept as its own (`--optimizer-state keep`)."""
        if not self.optimizers.keep:
            return
        arrays = state_arrays(self.optimizer)
        for j, node in enumerate(self.nodes):
            own = {}
            for key, value in arrays.items():
                index = int(key.split("/")[1])
                stacked = key.startswith(_TENSOR) and value.shape == tuple(self.params[index].shape)
                own[key] = value[j].copy() if stacked else value.copy()
            self.optimizers.restore(node, own)


def state_signature(state: dict[str, np.ndarray]) -> tuple:
    """Nodes whose states share it can be stacked: the same entries and the same scalars (step counts)."""
    return tuple(sorted((k, v.shape, v.item() if v.ndim == 0 else None) for k, v in state.items()))


# names in the arrays: "optimizer/<parameter index>/<key>"; a Python number (not a tensor) as "optimizer#/..."
_TENSOR, _NUMBER = "optimizer/", "optimizer#/"


def state_arrays(optimizer: Any) -> dict[str, np.ndarray]:
    arrays = {}
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                arrays[f"{_TENSOR}{index}/{key}"] = value.detach().cpu().numpy().copy()
            elif isinstance(value, int | float | bool):
                arrays[f"{_NUMBER}{index}/{key}"] = np.asarray(value)
            else:
                raise TypeError(f"{type(optimizer).__name__}'s state {key!r} is a {type(value).__name__}: only "
                                "tensors and numbers can be checkpointed")
    return arrays


def load_state(optimizer: Any, arrays: dict[str, np.ndarray]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, array in arrays.items():
        kind, index, key = name.split("/", 2)
        value = torch.from_numpy(np.array(array)) if f"{kind}/" == _TENSOR else array.item()
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
