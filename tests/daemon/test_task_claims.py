"""A barrier learns what its nodes run: each registration says its task (the run's, or an own loop, with its model's
size) and a barrier whose task is not the nodes' refuses at the first registration, naming the flag that fits, and
ends (it was started for another run); a barrier that evaluates nothing records the own loops that ran. A stand-alone
`mosaicd barrier` and real nodes (own-loop `Peer`s, `mosaicd node`) on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaic_proto import Layout
from mosaicd import Peer, Settings
from mosaicd.daemon.http.client import HttpError

RUN = dict(nodes=2, rounds=3, fragments=2, fanout=1, seed=3, eval_every=0, round_deadline=30, register_deadline=30,
           request_timeout=10)


def stand_alone_barrier(kit: Any, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`mosaicd barrier` (--insecure, by hand on loopback) with `flags`, and its URL once it listens."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen([*kit.by_hand, "barrier", *kit.flags(RUN), "--host", "127.0.0.1", "--port", "0",
                             "--port-file", str(port_file), "--out", str(tmp_path / "run"), "--linger", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        assert time.monotonic() < end and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"


def ended(proc: subprocess.Popen, within: float = 30) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the barrier still runs {within:g} s after a refused registration: {proc.communicate()[1]}")
    return proc.returncode, err


async def test_own_loops_at_a_barrier_with_a_task_are_refused_naming_own_loop(tmp_path: Path, kit: Any) -> None:
    """The issue's run: `mosaicd barrier` not told --own-loop (the quadratic task, 16 values) and own loops of an
    8-value model. Before: the run "finished", task "quadratic", average_model_failed warnings. Now the first
    registration is refused (422 task_differs) naming --own-loop, and the barrier ends, failed, saying the same."""
    barrier, url = stand_alone_barrier(kit, tmp_path, "--dim", "16")
    try:
        settings = Settings(**RUN, barrier_url=url, insecure=True, host="127.0.0.1", port=0)
        peer = Peer(settings, Layout.flat(8))
        with pytest.raises(HttpError) as refused:
            await asyncio.wait_for(peer.__aenter__(), 30)
        assert refused.value.reason == "task_differs", refused.value
        assert "--own-loop" in refused.value.detail and "a model of 8 values" in refused.value.detail
        assert "--task quadratic" in refused.value.detail and "a model of 16 values" in refused.value.detail
        code, err = await asyncio.to_thread(ended, barrier)
    finally:
        if barrier.poll() is None:
            barrier.kill()
            barrier.wait()
    assert code != 0 and "--own-loop" in err, err[-3000:]
    assert "average_model_failed" not in err


def test_the_run_s_task_at_an_own_loop_barrier_is_refused_naming_task(tmp_path: Path, kit: Any) -> None:
    """`mosaicd barrier --own-loop` and a `mosaicd node`, which builds the run's task: refused naming --task."""
    barrier, url = stand_alone_barrier(kit, tmp_path, "--own-loop")
    try:
        node = subprocess.run([*kit.by_hand, "node", "--barrier-url", url, "--host", "127.0.0.1", "--port", "0"],
                              capture_output=True, text=True, timeout=120)
        code, err = ended(barrier)
    finally:
        if barrier.poll() is None:
            barrier.kill()
            barrier.wait()
    assert node.returncode != 0, node.stderr[-3000:]
    assert "--own-loop" in node.stderr and "--task NAME" in node.stderr, node.stderr[-3000:]
    assert code != 0 and "--task NAME" in err, err[-3000:]


async def test_a_barrier_that_evaluates_nothing_records_the_own_loops_that_ran(tmp_path: Path, kit: Any) -> None:
    """A barrier with the default task that evaluates nothing takes own loops (named `digits-loop` by their
    settings), and the run records what ran: an own loop of that name, not "quadratic"."""
    run = {**RUN, "dim": 8, "train": False, "host": "127.0.0.1", "port": 0, "insecure": True}
    barrier, runner, settings = await kit.served_barrier(run, tmp_path / "barrier")
    named = Settings(**{**run, "own_loop": True, "task": "digits-loop"}, barrier_url=settings.barrier_url)
    peers = [Peer(named, Layout.flat(8)) for _ in range(2)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        for _ in range(RUN["rounds"]):
            await asyncio.wait_for(asyncio.gather(*(p.gossip(np.ones(8, np.float32)) for p in peers)), 30)
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in peers)), 30)
        await asyncio.wait_for(barrier.done.wait(), 30)
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()
    summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
    assert summary["settings"]["own_loop"] is True and summary["settings"]["task"] == "digits-loop", summary
