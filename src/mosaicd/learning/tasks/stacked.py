"""Many models of one torch task at once: the n vectors as stacked parameters, run through torch.func.vmap.

Training (`train_stacked`) takes every node's local steps together with the data order of `TorchTask.train` (the
same generator per (seed, node, round), the same batches) and its optimizer, step by step: one optimizer over the
stacked parameters, with the nodes' states stacked in and sliced back out (`optim.Stacked`; only for optimizers that
treat every coordinate alike, `optim.ELEMENTWISE`), the same schedule, and --clip-grad-norm per node. An MLP (an
nn.Sequential of Linear and elementwise layers) runs as batched matrix products with its backward pass written out
(`sequential_grads`); other models through vmap. The results are close to the one-by-one run but not bit-equal: vmap
turns the n convolutions into one grouped convolution and the n matrix products into batched ones, which sum in
another order (last bits of float32), and those differences grow over rounds. That is why
`--batched` is a separate, explicit option, and `mosaicd simulate` without it stays the bit-exact reference.

Evaluation through the same stacking: `torch_eval.evaluate_stacked`.

Only models without buffers (GroupNorm, not BatchNorm) and with vmap rules for every layer (not LSTM) are
stacked; the callers fall back to one model at a time for the others.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from . import draws
from .optim import state_signature
from .torch_util import TorchModelTask, blas_threads, float_state, train_seeds

__all__ = ["STACK_SAMPLES", "chunks", "has_buffers", "restack", "train_stacked", "unstack"]

STACK_SAMPLES = 2048  # samples (models x batch) in one vmapped training call: bounds the activations' memory
SEQUENTIAL_STACK_SAMPLES = 32768  # ... in one call of batched matrix products (an MLP's activations are small)


def has_buffers(model: nn.Module) -> bool:
    """Buffers (BatchNorm's running statistics) are updated in place by a forward pass: not stacked here."""
    return any(True for _ in model.buffers())


def unstack(model: nn.Module, vectors: list[np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """name -> (m, *shape) tensor of the models' parameters (the vectors' layout is float_state's order)."""
    flat = torch.from_numpy(np.stack([np.asarray(v, dtype=np.float32) for v in vectors])).to(device)
    params, offset = {}, 0
    for name, t in float_state(model):
        n = t.numel()
        params[name] = flat[:, offset:offset + n].reshape(len(vectors), *t.shape).clone()
        offset += n
    if offset != flat.shape[1]:
        raise ValueError(f"vectors have {flat.shape[1]} values, the model needs {offset}")
    return params


def restack(model: nn.Module, params: dict[str, torch.Tensor]) -> np.ndarray:
    names = [name for name, _ in float_state(model)]
    m = params[names[0]].shape[0]
    return torch.cat([params[name].detach().reshape(m, -1) for name in names], dim=1).cpu().numpy()


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    size = max(1, size)
    return [items[i:i + size] for i in range(0, len(items), size)]


def train_stacked(task: TorchModelTask, nodes: list[int], round: int,
                  vectors: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
    """`task.train(node, round, vector)` for every node, together; same order of results as `nodes`."""
    results: dict[int, tuple[np.ndarray, float]] = {}
    shards = {node: task.shard(node) for node in nodes}
    for node, shard in shards.items():
        if len(shard) == 0:
            raise ValueError(f"node {node} has no training samples")
    # nodes with a smaller shard than the batch take smaller batches: padded to the group's batch in a stack of
    # matrix products (`loss_many` counts each node's own rows), else a group of their own; states stack where alike
    padded = stackable_sequential(task.model)
    by_batch: dict[tuple[int, tuple], list[int]] = {}
    states = [task.optimizers.state(node) for node in nodes]  # read once: grouped by, then stacked in
    for k, node in enumerate(nodes):
        signature = state_signature(states[k])
        batch = 0 if padded else min(task.run.batch_size, len(shards[node]))
        by_batch.setdefault((batch, signature), []).append(k)
    for members in by_batch.values():
        batch = max(min(task.run.batch_size, len(shards[nodes[k]])) for k in members)
        per_call = SEQUENTIAL_STACK_SAMPLES if padded else STACK_SAMPLES
        for chunk in chunks(members, per_call // batch):
            trained, losses = _train_group(task, [nodes[k] for k in chunk], round, [vectors[k] for k in chunk],
                                           [states[k] for k in chunk], [shards[nodes[k]] for k in chunk])
            for j, k in enumerate(chunk):
                results[k] = (trained[j], losses[j])  # a row of the chunk's array: no node's row overlaps another's
    return [results[k] for k in range(len(nodes))]


def batch_rows(task: TorchModelTask, nodes: list[int], round: int,
               shards: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Every local step's training rows of each node, exactly `TorchTask.train`'s draws (the same generator per
    (seed, node, round), a fresh permutation per pass over the shard): (nodes, steps, batch) row indices, a node's
    smaller batch padded with its first row, and each node's own batch size. `shards`: the nodes' `task.shard`.
    The permutations of all nodes are drawn at once (`draws`), else one torch call each."""
    s, steps = task.run, task.run.local_steps
    lengths = np.array([len(shard) for shard in shards], dtype=np.int64)
    sizes = np.minimum(s.batch_size, lengths)
    seeds = train_seeds(s.seed, nodes, round)
    if not draws.matches() or int(lengths.max()) >= draws.LARGEST:
        return drawn_by_torch(steps, shards, seeds, sizes), sizes
    kept = np.minimum(lengths // sizes, steps)  # batches taken from each pass over the shard
    passes, keep = -(-steps // kept), kept * sizes
    perm = draws.shuffled_prefixes(seeds, lengths, passes, keep)
    batch = sizes[:, None, None]
    column = np.arange(int(sizes.max()))[None, None, :]
    at = np.arange(steps)[None, :, None] * batch + np.where(column < batch, column, 0)  # in the node's order
    lane = (np.cumsum(passes) - passes)[:, None, None] + at // keep[:, None, None]
    offsets = (np.cumsum(lengths) - lengths)[:, None, None]
    return np.concatenate(shards)[offsets + perm[lane, at % keep[:, None, None]]], sizes


def drawn_by_torch(steps: int, shards: list[np.ndarray], seeds: list[int], sizes: np.ndarray) -> np.ndarray:
    """`batch_rows`'s rows through a torch generator and torch.randperm per node and pass, as `TorchTask.train`."""
    rows = np.empty((len(shards), steps, int(sizes.max())), dtype=np.int64)
    gen = torch.Generator()
    for j, (shard, seed, batch) in enumerate(zip(shards, seeds, sizes.tolist(), strict=True)):
        gen.manual_seed(seed)
        n = len(shard)
        per_pass = n // batch
        if per_pass >= steps:  # a shard of `steps` batches or more: one pass
            order = torch.randperm(n, generator=gen).numpy()[:steps * batch]
        else:
            order = np.concatenate([torch.randperm(n, generator=gen).numpy()[:per_pass * batch]
                                    for _ in range(-(-steps // per_pass))])[:steps * batch]
        rows[j, :, :batch] = shard[order].reshape(steps, batch)
        rows[j, :, batch:] = rows[j, :, :1]
    return rows


# layers a stack of models runs as batched matrix products (`sequential_forward`): an nn.Sequential of these only
ELEMENTWISE_LAYERS = (nn.ReLU, nn.Tanh, nn.GELU, nn.Sigmoid, nn.SiLU, nn.Identity)


def stackable_sequential(model: nn.Module) -> bool:
    """An nn.Sequential of Linear and elementwise layers (and Flatten): stacked through torch.baddbmm."""
    return isinstance(model, nn.Sequential) and all(
        isinstance(layer, (nn.Linear, nn.Flatten, *ELEMENTWISE_LAYERS)) for layer in model)


def sequential_forward(model: nn.Sequential, params: dict[str, torch.Tensor], x: torch.Tensor,
                       shared: bool = False) -> torch.Tensor:
    """m models' outputs (m, B, ...) from their stacked parameters and their own inputs x (m, B, ...): each Linear
    one batched matrix product, every other layer as it is (it acts on each value, or flattens each sample).
    `shared`: x (B, ...) is every model's input (evaluation): the first Linear is one matrix product of it with
    all the models' weights side by side, and with samples of one dimension the outputs are `_features_first`."""
    layers = list(enumerate(model))
    if shared:
        while layers and isinstance(layers[0][1], nn.Flatten):  # each sample flattened: still the shared input
            x = layers.pop(0)[1](x)
        if x.dim() == 2 and layers and isinstance(layers[0][1], nn.Linear):
            return _features_first(layers, params, x).transpose(1, 2)
    for i, layer in layers:
        if isinstance(layer, nn.Linear):
            weight, bias = params[f"{i}.weight"], params.get(f"{i}.bias")
            if shared:
                m, out = weight.shape[:2]
                x = (x @ weight.reshape(m * out, -1).T).view(*x.shape[:-1], m, out).movedim(-2, 0)
                x = x if bias is None else x + bias.view(m, *[1] * (x.dim() - 2), out)
                shared = False
            else:
                x = torch.bmm(x, weight.transpose(1, 2))  # then the bias: baddbmm is slower on the CPU
                x = x if bias is None else x + bias.unsqueeze(1)
        elif isinstance(layer, nn.Flatten):
            x = x.flatten(layer.start_dim + (not shared), layer.end_dim if layer.end_dim < 0 else
                          layer.end_dim + (not shared))
        else:
            x = layer(x)
    return x


def _features_first(layers: list[tuple[int, nn.Module]], params: dict[str, torch.Tensor],
                    x: torch.Tensor) -> torch.Tensor:
    """m models' outputs on one shared batch x (B, F), features before samples: (m, out, B). The first Linear is
    one matrix product of every model's weights with x's transpose, each later one a batched product
    (m, out, in) @ (m, in, B); reductions over a few classes then run along contiguous samples. On the CPU this
    evaluates 1,001 teacher models faster than samples first (bench/README.md, issue #48's third pass)."""
    given = x = x.T
    for i, layer in layers:
        if isinstance(layer, nn.Linear):
            weight, bias = params[f"{i}.weight"], params.get(f"{i}.bias")
            m, out = weight.shape[:2]
            x = products(weight.reshape(m * out, -1), x).view(m, out, -1) if x.dim() == 2 else products(weight, x)
            x = x if bias is None else x.add_(bias.unsqueeze(-1))
        elif isinstance(layer, nn.ReLU) and x is not given:
            x = x.clamp_min_(0)  # in place: no gradient reads this output (a 1,001-model evaluation ~25% faster)
        elif not isinstance(layer, nn.Flatten):  # a sample's features are one dimension: flattening keeps them
            x = layer(x)
    return x


def sequential_grads(task: TorchModelTask, model: nn.Sequential, params: dict[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor, counts: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """m models' gradients (name -> (m, *shape)) and losses (m,) on their own batches x (m, B, ...): the forward pass
    keeping each layer's input, then the backward pass written out, each Linear two or three batched matrix products
    and each elementwise layer its derivative (on the CPU about a quarter faster than autograd over the same
    products; bench/scale.py). The loss's own gradient is `task.loss_grad_many`'s.
    Features first past the leading Flattens, as evaluation (`_features_first`): activations (m, features, B), each
    Linear W @ x, so that the products' inner sizes are the features (on the CPU ~15% less time in the products
    than x @ W^T for the teacher's MLP; bench/README.md, issue 59)."""
    layers = list(enumerate(model))
    while layers and isinstance(layers[0][1], nn.Flatten):  # each sample flattened (samples first still)
        i, layer = layers.pop(0)
        x = x.flatten(layer.start_dim + 1, layer.end_dim if layer.end_dim < 0 else layer.end_dim + 1)
    if x.dim() != 3:
        raise ValueError(f"stacked matrix products take samples of one dimension after the leading Flattens; "
                         f"got samples of shape {tuple(x.shape[2:])}")
    x = x.transpose(1, 2)  # (m, features, B): a view; every later Flatten leaves one-dimensional samples as they are
    inputs = []
    with torch.no_grad():
        for i, layer in layers:
            inputs.append(x)
            if isinstance(layer, nn.Linear):
                bias = params.get(f"{i}.bias")
                x = products(params[f"{i}.weight"], x)  # then the bias: baddbmm is slower on the CPU
                x = x if bias is None else x.add_(bias.unsqueeze(-1))
            elif isinstance(layer, nn.ReLU) and i > 0 and isinstance(model[i - 1], nn.Linear):
                x = x.clamp_min_(0)  # in place: a Linear's own output, which ReLU's gradient does not read
            elif not isinstance(layer, nn.Flatten):
                x = layer(x)
    losses, g = task.loss_grad_many(x.transpose(1, 2), y, counts)
    g = g.transpose(1, 2).contiguous()  # no copy for the built-in loss's; autograd's may be an expanded constant
    first = min(k for k, (_, layer) in enumerate(layers) if isinstance(layer, nn.Linear))  # no gradient before it
    grads: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k in range(len(layers) - 1, first - 1, -1):
            (i, layer), before = layers[k], inputs[k]
            after = inputs[k + 1] if k + 1 < len(layers) else x
            if isinstance(layer, nn.Linear):
                grads[f"{i}.weight"] = products(g, before.transpose(1, 2))
                if layer.bias is not None:
                    grads[f"{i}.bias"] = g.sum(dim=2)
                if k > first:
                    g = products(params[f"{i}.weight"].transpose(1, 2), g)
            elif not isinstance(layer, nn.Flatten):
                g = _elementwise_grad(layer, g, before, after)
    return grads, losses


def products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for matrices (p, q) @ (q, r) or stacks of them (m, p, q) @ (m, q, r): on the CPU in float32 at one thread
    through numpy's matmul (its OpenBLAS; `_train_group` and `evaluate_stacked` hold it to one thread there), else
    torch.matmul. For the teacher's small products numpy took a third less time than torch.bmm at one thread, while
    at two torch.bmm, on its own threads, was faster than numpy's parts on threads of ours (bench/scale.py;
    bench/README.md, issue 59)."""
    if a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and torch.get_num_threads() == 1:
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))
    return torch.matmul(a, b)


def _elementwise_grad(layer: nn.Module, g: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The gradient through one of ELEMENTWISE_LAYERS, from its input (`before`) or output (`after`): the kernels
    autograd runs for them. `g` is the caller's to overwrite."""
    if isinstance(layer, nn.ReLU):  # into g, which no one else holds
        return torch.ops.aten.threshold_backward.grad_input(g, after, 0, grad_input=g)
    if isinstance(layer, nn.Tanh):
        return torch.ops.aten.tanh_backward(g, after)
    if isinstance(layer, nn.Sigmoid):
        return torch.ops.aten.sigmoid_backward(g, after)
    if isinstance(layer, nn.GELU):
        return torch.ops.aten.gelu_backward(g, before, approximate=layer.approximate)
    if isinstance(layer, nn.SiLU):
        return torch.ops.aten.silu_backward(g, before)
    if isinstance(layer, nn.Identity):
        return g
    raise TypeError(f"no gradient written for {type(layer).__name__} (ELEMENTWISE_LAYERS)")


def _train_group(task: TorchModelTask, nodes: list[int], round: int, vectors: list[np.ndarray],
                 states: list[dict[str, np.ndarray]], shards: list[np.ndarray]) -> tuple[np.ndarray, list[float]]:
    s, split, model = task.run, task.split, task.model
    model.train()
    params = unstack(model, vectors, task.device)
    rows, sizes = batch_rows(task, nodes, round, shards)
    counts = None if int(sizes.min()) == rows.shape[2] else torch.from_numpy(sizes).to(task.device)

    def node_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return task.loss(functional_call(model, p, (x,)), y)

    if stackable_sequential(model):  # batched matrix products, the backward pass written out: no vmap, no autograd
        blas = s.threads  # numpy's BLAS (`products` at one thread) on the threads torch has

        def step(p: dict[str, torch.Tensor], x: torch.Tensor,
                 y: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            return sequential_grads(task, model, p, x, y, counts)
    else:
        if counts is not None:
            raise ValueError("vmap's stacked training takes nodes of one batch size")
        step, blas = vmap(grad_and_value(node_loss)), None
    names = list(params)
    leaves = [params[name].requires_grad_(True) for name in names]
    optimizer = task.optimizers.stacked(nodes, leaves, states)
    losses = []
    with blas_threads(blas):
        for h in range(s.local_steps):
            flat = rows[:, h].reshape(-1)  # one transfer per step; the same rows and values as node by node
            x = task.x(np.take(split.x_train, flat, axis=0))  # take: a few times faster than indexing with `flat`
            x = x.reshape(len(nodes), rows.shape[2], *x.shape[1:])
            y = task.y(np.take(split.y_train, flat, axis=0))
            y = y.reshape(len(nodes), rows.shape[2], *y.shape[1:])
            grads, loss = step({name: p.detach() for name, p in params.items()}, x, y)
            losses.append(loss.detach())
            optimizer.step([grads[name] for name in names], s.clip_grad_norm,
                           task.schedule.factor(round * s.local_steps + h))
    optimizer.keep()
    mean_loss = torch.stack(losses).double().cpu().numpy().mean(axis=0)
    return restack(model, {name: p.detach() for name, p in params.items()}), [float(x) for x in mean_loss]
