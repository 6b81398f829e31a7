"""Mosaic gossip inside your own torch training loop, through the public API only (`mosaicd.Peer`,
`mosaicd.Barrier`, `mosaicd.Settings`).

    python examples/own_training_loop.py                 # four peers and their barrier in this one process
    mosaicd barrier --own-loop --task digits-mlp --nodes 4 --rounds 15 --fragments 4 --fanout 2 --out run
                                                  # or: the barrier on one host
                                                  # (it makes the run's secret, run.secret; copy it to the nodes),
    python examples/own_training_loop.py --barrier-url http://HOST:8000 --secret-file run.secret   # one per node

Each round, every peer trains its own model on its own shard for a few steps, reports its own metrics of the
round (`gossip(metrics=...)`: they land in rounds.csv, summary.json and `mosaicd status`), and gossips. Every
random draw is seeded (the model's initialisation, each rank's batches per round): the same command gives the
same models, as summary.json's model_sha256 shows, in one process as across processes. The run is recorded as
what it is (task "digits-mlp", the loop's name) and, in one process, the barrier evaluates the average model
with the loop's own `evaluate` (`mosaicd.Barrier(evaluate=...)`). Ctrl-C ends it cleanly (the run's summary says
so).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import mosaicd

NODES, ROUNDS, SEED, STEPS = 4, 15, 0, 5
RUN = dict(rounds=ROUNDS, fragments=4, fanout=2, seed=SEED)  # a stand-alone barrier is given the same


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # every peer starts from the same model
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def load() -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    return x[:1400], y[:1400], x[1400:], y[1400:]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        logits = model(x)
        return {"accuracy": float((logits.argmax(1) == y).float().mean()),
                "test_loss": float(nn.functional.cross_entropy(logits, y))}


def evaluate_vector(vector: np.ndarray) -> dict[str, float]:
    """The metrics of a flat vector (the barrier's average model): the model's parameters, in their order."""
    model = make_model()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(vector), model.parameters())
    _, _, x_test, y_test = load()
    return evaluate(model, x_test, y_test)


async def node(settings: mosaicd.Settings, data: tuple[torch.Tensor, ...], secret: Any = None) -> float:
    """`secret`: the run's, from the Barrier of this program (else --secret-file's)."""
    x, y, x_test, y_test = data
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    async with mosaicd.Peer(settings, model, secret=secret) as peer:
        shard = np.arange(len(x))[peer.rank::peer.run.nodes]  # your own data split
        for t in range(peer.round, peer.run.rounds):  # the run's settings, as the barrier handed them out
            rng = np.random.default_rng([SEED, peer.rank, t])  # seeded: the same batches every time
            for _ in range(STEPS):  # your own local steps
                batch = torch.from_numpy(rng.choice(shard, 32))
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
            # fragments out, barrier, fragment-wise average written back into model; your metrics of the round
            await peer.gossip(model, loss=loss.item(), metrics=evaluate(model, x_test, y_test))
        await peer.finish()
    return evaluate(model, x_test, y_test)["accuracy"]


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the same arithmetic on any machine
    mosaicd.configure_logging("warning")
    data = load()
    quiet = dict(log_level="warning", port=args.port, host=args.host)
    if args.barrier_url:  # one node of a run whose barrier (`mosaicd barrier`) runs elsewhere
        settings = mosaicd.Settings.load(barrier_url=args.barrier_url, secret_file=args.secret_file, **quiet,
                                         **({"advertise": args.advertise} if args.advertise else {}))
        accuracy = await node(settings, data)
        print(f"test accuracy: {accuracy:.3f}", file=sys.stderr)
        return
    out = args.out or tempfile.mkdtemp(prefix="mosaic-example-")
    settings = mosaicd.Settings.load(nodes=NODES, **RUN, out=out, **quiet)
    # leaving the block waits for the run's end; the run shows as task "digits-mlp", with an average-model column
    async with mosaicd.Barrier(settings, name="digits-mlp", evaluate=evaluate_vector) as barrier:
        print(f"barrier {barrier.url}, outputs in {out}", file=sys.stderr, flush=True)
        peer = settings.model_copy(update={"barrier_url": barrier.url, "port": 0})
        accuracies = await asyncio.gather(*(node(peer, data, barrier.secret) for _ in range(NODES)))
    print("test accuracy per node:", [f"{a:.3f}" for a in accuracies], f"(outputs in {out})", file=sys.stderr)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--barrier-url", help="run one node of the run this barrier serves (else: all, in-process)")
    parser.add_argument("--secret-file", help="with --barrier-url: the run's secret (the barrier's OUT.secret)")
    parser.add_argument("--host", default="127.0.0.1", help="where this process listens")
    parser.add_argument("--port", type=int, default=0, help="its port (0: any free one)")
    parser.add_argument("--advertise", help="HOST:PORT the other nodes reach this one at (another host's)")
    parser.add_argument("--out", help="the run's folder (in-process: a new temporary one by default)")
    return parser.parse_args()


if __name__ == "__main__":
    try:
        asyncio.run(main(parse()))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
