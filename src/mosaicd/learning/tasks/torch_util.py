"""A torch model as the spec's flat vector: every floating-point tensor of its state_dict, in order."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch
from threadpoolctl import ThreadpoolController
from torch import nn

from mosaic_proto import Layout, Purpose, keyed_raws, keyed_rng

__all__ = ["SGD", "Adam", "AdamW", "PlainOptimizer", "blas_threads", "check_device", "deterministic_cuda",
           "float_state", "layout_of", "load_vector", "to_vector", "train_generator", "train_seed", "train_seeds"]


@functools.cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def blas_threads(threads: int | None) -> AbstractContextManager[Any]:
    """A context that holds numpy's BLAS to `threads` (None: leaves it): the run's --threads where products go through
    numpy (`stacked.products`). One controller per process: `threadpool_limits` looks the libraries up again at each
    call, a scan of the process's shared objects."""
    return _blas().limit(limits=threads, user_api="blas")


def float_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every floating-point parameter and buffer, in state_dict order."""
    return [(name, t) for name, t in model.state_dict(keep_vars=False).items() if t.is_floating_point()]


def layout_of(model: nn.Module) -> Layout:
    return Layout.from_pairs([(name, tuple(t.shape)) for name, t in float_state(model)])


def to_vector(model: nn.Module) -> np.ndarray:
    """The model's state as one new float32 numpy vector."""
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for _, t in float_state(model)])
    return flat.cpu().numpy()


def load_vector(model: nn.Module, vector: np.ndarray) -> None:
    """Copy a flat vector into the model's float tensors, in place (on whatever device they are)."""
    entries = float_state(model)
    total = sum(t.numel() for _, t in entries)
    v = np.asarray(vector)
    if v.ndim != 1 or v.shape[0] != total:
        raise ValueError(f"vector has shape {v.shape}, the model needs ({total},)")
    flat = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for _, t in entries:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n


def train_seed(seed: int, node: int, round: int) -> int:
    """The integer that seeds node `node`'s torch generator in round `round`."""
    return int(keyed_rng(seed, Purpose.TRAIN, round, node).integers(2**62))


def train_seeds(seed: int, nodes: Sequence[int], round: int) -> list[int]:
    """`train_seed` of every node at once (a stacked round seeds a generator per node). integers(2**62) is the top
    62 bits of the generator's first output (Lemire's method never rejects for a power of two); checked against
    `train_seed` once per process, which the nodes take one by one otherwise."""
    if not _seeds_match():
        return [train_seed(seed, node, round) for node in nodes]
    return _top_bits(seed, nodes, round)


def _top_bits(seed: int, nodes: Sequence[int], round: int) -> list[int]:
    return [int(raw) >> 2 for raw in keyed_raws(seed, Purpose.TRAIN, round, nodes)]


@functools.cache
def _seeds_match() -> bool:
    return all(_top_bits(seed, [0, 1, 999], 4) == [train_seed(seed, n, 4) for n in [0, 1, 999]]
               for seed in (0, 2**40 + 3))


def train_generator(seed: int, node: int, round: int) -> torch.Generator:
    return torch.Generator().manual_seed(train_seed(seed, node, round))


class PlainOptimizer:
    """The parts of torch.optim.Optimizer's interface that Mosaic uses (`param_groups`, `state`, `state_dict`,
    `load_state_dict`), one parameter group, without torch.optim: constructing any torch.optim optimizer imports
    torch._dynamo (about 70 MiB of resident memory and 1-2 s per process); a node's step needs only a few lines. A
    node's state is kept and checkpointed the same way for these as for torch.optim's (`optim.NodeOptimizers`),
    under torch.optim's names, so that either reads the other's."""

    def __init__(self, params: Any, **group: Any) -> None:
        self.params = list(params)
        self.param_groups = [{"params": self.params, **group}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(self.params)))}
                  for g in self.param_groups]
        return {"state": {i: dict(self.state[p]) for i, p in enumerate(self.params) if p in self.state},
                "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = {self.params[int(i)]: {k: self._placed(k, v, self.params[int(i)]) for k, v in entries.items()}
                      for i, entries in state_dict["state"].items()}

    @staticmethod
    def _placed(key: str, value: Any, param: torch.Tensor) -> Any:
        return value.to(param.device) if isinstance(value, torch.Tensor) else value


class SGD(PlainOptimizer):
    """torch.optim.SGD's arithmetic (momentum, dampening, Nesterov, weight decay), bit for bit, without torch.optim."""

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, lr=float(lr), momentum=float(momentum), dampening=float(dampening),
                         weight_decay=float(weight_decay), nesterov=bool(nesterov))

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        for p in self.params:
            grad = p.grad
            if grad is None:
                continue
            if weight_decay != 0:
                grad = grad.add(p, alpha=weight_decay)
            if momentum != 0:
                entry = self.state.setdefault(p, {})
                buf = entry.get("momentum_buffer")
                if buf is None:
                    buf = entry["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
                grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
            p.add_(grad, alpha=-lr)


class Adam(PlainOptimizer):
    """torch.optim.Adam's arithmetic on the CPU (its single-tensor step: betas, eps, weight decay, AMSGrad,
    maximize), bit for bit, with its checks of the values and its state's names, without torch.optim."""

    decoupled = False  # AdamW: the weight decay applied to the parameter, not added to the gradient

    def __init__(self, params, lr: float = 1e-3, betas: Any = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, maximize: bool = False) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (isinstance(betas[0], float) and isinstance(betas[1], float)):
            raise ValueError("betas must be either both floats or both Tensors")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize)

    @staticmethod
    def _placed(key: str, value: Any, param: torch.Tensor) -> Any:
        return value if key == "step" else value.to(param.device)  # torch.optim keeps the step count on the CPU

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for param in self.params:
            if param.grad is None:
                continue
            grad = -param.grad if group["maximize"] else param.grad
            state = self.state.setdefault(param, {})
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                             else torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
            step_t += 1
            if weight_decay != 0:
                if self.decoupled:
                    param.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(param, alpha=weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2 ** 0.5
            if group["amsgrad"]:
                torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
                denom = (state["max_exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
            else:
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(Adam):
    """torch.optim.AdamW's arithmetic on the CPU (Adam with decoupled weight decay, 0.01 unless given)."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: Any = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


def deterministic_cuda() -> None:
    """Same inputs, same bits on a GPU too, as `mosaicd simulate` and `mosaicd cluster` must agree: cuDNN's
    deterministic kernels without autotuning, torch's deterministic algorithms (embedding backward sorts
    instead of adding atomically) and the cuBLAS workspace setting they need (read when cuBLAS starts)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def check_device(name: str) -> torch.device:
    """The torch device of `--device name`, or ValueError naming --device when this machine lacks it."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}, "
                             "no usable GPU); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        deterministic_cuda()
    return device


class TorchModelTask(Protocol):
    """What `stacked.py` and `torch_eval.py` ask of the `TorchTask` they serve (it imports them, so they name it by
    what they use rather than import it back)."""

    name: str
    run: Any
    device: torch.device
    eval_batch_size: int
    eval_channels_last: bool
    optimizers: Any  # optim.NodeOptimizers
    schedule: Any  # optim.Schedule

    @property
    def split(self) -> Any: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def eval_model(self) -> nn.Module: ...

    def shard(self, node: int) -> np.ndarray: ...

    def x(self, rows: np.ndarray) -> torch.Tensor: ...

    def y(self, rows: np.ndarray) -> torch.Tensor: ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def loss_many(self, outputs: torch.Tensor, targets: torch.Tensor,
                  counts: torch.Tensor | None = None) -> torch.Tensor: ...

    def loss_grad_many(self, outputs: torch.Tensor, targets: torch.Tensor,
                       counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def score(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]: ...

    def score_stacked(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]: ...

    def evaluate_one(self, vector: np.ndarray, samples: np.ndarray | None = None) -> dict[str, float]: ...
