"""Mosaic gossip inside your own torch training loop.

Each node is one `mosaicd.Peer`; here four of them and the barrier share one process so the example
runs anywhere (`python examples/own_training_loop.py`). On real hosts, run `mosaicd barrier --nodes 4`
once and this loop once per host with --barrier-url pointing at it.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

import numpy as np
import torch
from aiohttp import web
from sklearn.datasets import load_digits
from torch import nn

from mosaicd import Peer, Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.routes import barrier_app

NODES, ROUNDS = 4, 15


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


async def node(settings: Settings, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor,
               y_test: torch.Tensor) -> float:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    async with Peer(settings, model) as peer:
        shard = np.arange(len(x))[peer.rank::NODES]  # your own data split
        for _ in range(peer.run.rounds):  # the run's settings, as the barrier handed them out
            for _ in range(5):  # your own local steps
                batch = torch.from_numpy(np.random.default_rng().choice(shard, 32))
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
            await peer.gossip(model)  # fragments out, barrier, fragment-wise average written back into model
        await peer.finish()
        with torch.no_grad():
            return float((model(x_test).argmax(1) == y_test).float().mean())


async def main() -> None:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    out = tempfile.mkdtemp(prefix="mosaic-example-")
    settings = Settings.load(nodes=NODES, rounds=ROUNDS, fragments=4, fanout=2, out=out, port=0, log_level="warning")
    barrier = Barrier(settings.run_config(), settings.daemon_options())
    runner = web.AppRunner(barrier_app(barrier))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    print(f"barrier {url}, outputs in {out}", file=sys.stderr)
    nodes = [settings.model_copy(update={"barrier_url": url}) for _ in range(NODES)]
    try:
        accuracies = await asyncio.gather(*(node(s, x[:1400], y[:1400], x[1400:], y[1400:]) for s in nodes))
    except asyncio.CancelledError:  # Ctrl-C: the run's summary says so, not "running"
        barrier.interrupt()  # its open long polls are answered now, so the server stops at once
        barrier.recorder.fail("interrupted (Ctrl-C)")
        raise
    finally:
        await runner.cleanup()
    print("test accuracy per node:", [f"{a:.3f}" for a in accuracies], f"(outputs in {out})", file=sys.stderr)


if __name__ == "__main__":
    from mosaicd.logs import configure_logging

    configure_logging("warning")
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
