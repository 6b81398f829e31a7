"""The node daemon's round loop: train (off the event loop), gossip through `Peer`, evaluate every E rounds."""

from __future__ import annotations

import asyncio
import math
import time

from mosaicd.daemon.barrier import Barrier
from mosaicd.daemon.http import Client
from mosaicd.daemon.peer import Peer, embedded_barrier_url, listed_addresses, own_address
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import build_task
from mosaicd.logs import get_logger
from mosaicd.outputs import is_eval_round
from mosaicd.settings import Settings


async def run_settings(settings: Settings) -> Settings:
    """The run's settings as the barrier holds them (the barrier is authoritative for every run field)."""
    if settings.peer_list is not None and not settings.barrier_url:
        # check the list names this node before waiting on rank 0 (it may never answer a node it does not list)
        if listed_addresses(settings)[0] == own_address(settings, settings.port):
            return settings
        url = embedded_barrier_url(settings)
    elif settings.barrier_url:
        url = settings.barrier_url
    else:
        return settings
    deadline = time.monotonic() + settings.register_deadline
    async with Client(settings.request_timeout, retries=0) as client:
        while True:
            try:
                remote = (await client.get_json(f"{url}/v1/run"))["settings"]
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no barrier answered at {url} within --register-deadline") from None
                await asyncio.sleep(0.5)
    return settings.updated(**remote)


async def run_node(settings: Settings) -> int:
    settings = await run_settings(settings)
    task = build_task(settings)
    log = get_logger(role="node", run=settings.run_id)
    async with Peer(settings, task.layout, evaluate=lambda vs: network_metrics(task, vs)) as peer:
        log = log.bind(node=peer.rank)
        final = settings.updated(**peer.run_settings)
        if final != settings:  # the barrier counted the nodes (DNS) only when registration closed
            settings, task = final, build_task(final)
        vector = task.initial(peer.rank)
        peer.vector = vector
        for t in range(settings.rounds):
            peer.phase = "training"
            started = time.perf_counter()
            if settings.train:
                local, loss = await asyncio.to_thread(task.train, peer.rank, t, vector)
            else:
                local, loss = vector, math.nan
            vector = await peer.gossip(local, loss=loss, train_s=time.perf_counter() - started)
            if is_eval_round(t, settings):
                peer.phase = "evaluating"
                peer.evaluation = {"round": t, **await asyncio.to_thread(task.evaluate, vector)}
                for key, value in peer.evaluation.items():
                    if key != "round":
                        peer.m_eval.labels(key).set(value)
            evaluation = {k: v for k, v in (peer.evaluation or {}).items() if k != "round"}
            log.info("round", round=t, loss=loss, evaluation=evaluation if is_eval_round(t, settings) else None)
        await peer.finish()
        if peer.barrier is not None:
            await peer.barrier.done.wait()
        await asyncio.sleep(settings.linger)
    return 0


async def run_barrier(settings: Settings) -> int:
    from aiohttp import web

    tasks: dict[int, object] = {}

    def evaluate(vectors: list) -> dict:
        """The task as the run finally is (the node count may be known only at registration close)."""
        if barrier.settings.nodes not in tasks:
            tasks.clear()
            tasks[barrier.settings.nodes] = build_task(barrier.settings)
        return network_metrics(tasks[barrier.settings.nodes], vectors)

    barrier = Barrier(settings, evaluate=evaluate)
    runner = web.AppRunner(barrier.app(), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    get_logger(role="barrier").info("listening", host=settings.host, port=settings.port, expected=barrier.expected)
    try:
        await barrier.done.wait()
        await asyncio.sleep(max(settings.linger, 1.0))
    finally:
        await runner.cleanup()
    return 0 if barrier.phase == "finished" else 1
