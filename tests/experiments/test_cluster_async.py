"""`mosaicd cluster --sync async` (issue 60, item 4): asynchronous node daemons on loopback, each driving the
`AsyncNodeState` that `simulate --sync async` runs; no barrier on the data path; signed messages, replays refused."""

from __future__ import annotations

import asyncio
import csv
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaic_proto.frames import ANSWER, STREAM_PATH, UPGRADE, request_head
from mosaic_proto.wire import FragmentBatch, encode
from mosaicd.cli import main
from mosaicd.daemon.http.auth import Secret, signer
from mosaicd.daemon.http.client import Client
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.node.async_member import AsyncNode
from mosaicd.daemon.node.async_routes import async_app
from mosaicd.experiments.cluster_async import AsyncCluster, NodeHost, run_cluster_async
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import build_task
from mosaicd.settings import Settings

RUN = {"sync": "async", "task": "quadratic", "fragments": 4, "fanout": 2}


def clustered(tmp_path: Path, name: str, profile: str, **settings) -> dict:
    (tmp_path / f"{name}.toml").write_text(profile)
    return run_cluster_async(Settings.load(**{**RUN, **settings}, node_profile=tmp_path / f"{name}.toml",
                                     out=tmp_path / name), progress=False, timeout=120)


@pytest.mark.slow
def test_an_asynchronous_cluster_finishes_with_each_node_s_model_and_the_async_block(tmp_path: Path) -> None:
    summary = clustered(tmp_path, "run", "compute_s = 0.05\n", nodes=5, rounds=15)
    assert summary["status"] == "finished" and sorted(summary["model_sha256"]) == [str(i) for i in range(5)]
    block = summary["asynchronous"]
    assert block["steps"] == {str(i): 15 for i in range(5)} and block["signed"] is True
    assert block["messages_sent"] >= 5 * 15 and block["messages_unsent"] == 0 and block["replays_refused"] == 0
    run = Settings.load(**RUN, nodes=5, rounds=15).run_config()
    task = build_task(run)
    start = network_metrics(task, [task.initial(i) for i in range(5)])
    assert summary["final"]["node_average"] < start["node_average"] / 2  # trained and gossiped
    assert summary["final"]["consensus_distance"] < start["consensus_distance"] / 2
    with open(tmp_path / "run" / "rounds.csv", newline="") as f:  # evaluated on the time grid, then at the end
        rows = list(csv.DictReader(f))
    times = [float(r["time_s"]) for r in rows]
    assert len(rows) >= 5 and times[:3] == [0.05, 0.1, 0.15] and times == sorted(times)
    assert [int(r["round"]) for r in rows[:3]] == [0, 1, 2] and int(rows[-1]["round"]) >= 14
    assert times[-1] == max(block["elapsed_s"].values())
    assert float(rows[-1]["node_average"]) < float(rows[0]["node_average"])


@pytest.mark.slow
def test_a_node_slowed_ten_times_does_not_slow_the_others(tmp_path: Path) -> None:
    alike = clustered(tmp_path, "alike", "compute_s = 0.05\n", nodes=4, rounds=20, eval_every=5)["asynchronous"]
    slowed = clustered(tmp_path, "slowed", "compute_s = 0.05\n[nodes.3]\nslowdown = 10\n", nodes=4, rounds=20,
                       eval_every=5)["asynchronous"]
    assert slowed["steps"] == alike["steps"] == {str(i): 20 for i in range(4)}
    reference = sum(alike["steps_per_s"][str(i)] for i in range(3)) / 3
    for i in range(3):  # each of the others trains at its pace, as without the slow node: never 20% slower (a run
        # measured at another moment of a loaded host may be faster, which is no fault of the slow node)
        assert slowed["steps_per_s"][str(i)] > 0.8 * reference, (slowed, alike)
    assert slowed["steps_per_s"]["3"] < reference / 5  # and the slow node is slow


@pytest.mark.slow
@pytest.mark.parametrize("secret", [True, False])
def test_ad_psgd_runs_in_the_daemons_from_the_same_flag(tmp_path: Path, kit: Any, secret: bool) -> None:
    profile = kit.pace(tmp_path, 0.05)
    summary = run_cluster_async(Settings.load(sync="async", task="quadratic", exchange="pairwise", nodes=4, rounds=15,
                                              eval_every=5, insecure=not secret, node_profile=profile,
                                              out=tmp_path / "adpsgd"), progress=False, timeout=120)
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and block["steps"] == {str(i): 15 for i in range(4)}
    assert block["signed"] is secret and block["pairs_averaged"] >= 4 * 15  # each pair counts on both sides
    assert block["replays_refused"] == 0 and summary["final"]["consensus_distance"] < 1.0


@pytest.mark.slow  # a 6-process loopback run: ~10 s on 2 busy cores
def test_max_norm_guards_the_daemons_against_a_scaling_attacker(tmp_path: Path) -> None:
    """--max-norm reaches every node process of `cluster --sync async`: the honest nodes refuse the attacker's
    messages (its fragments scaled 1000x), count them in summary.json, and keep learning."""
    summary = clustered(tmp_path, "guarded", "compute_s = 0.05\n", nodes=5, rounds=15, eval_every=5, byzantine=1,
                        attack="scale", attack_scale=1000.0, max_norm=10.0)
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and block["steps"] == {str(i): 15 for i in range(5)}
    assert block["refused_out_of_range"] > 0 and summary["byzantine_ranks"] and summary["honest_only"] is True
    run = Settings.load(**RUN, nodes=5, rounds=15).run_config()
    task = build_task(run)
    start = network_metrics(task, [task.initial(i) for i in range(5) if i not in summary["byzantine_ranks"]])
    assert summary["final"]["node_average"] < start["node_average"] / 2  # the honest nodes learned, unharmed


def test_resume_is_refused_in_the_daemons_naming_the_flag(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    for flags, said in ((["--resume"], "--resume: an asynchronous cluster is not resumed as a whole"),):
        with pytest.raises(SystemExit) as stopped:
            main(["cluster", "--sync", "async", *flags, "--nodes", "3", "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()


def test_a_replayed_or_misattributed_message_is_refused(tmp_path: Path) -> None:
    settings = Settings.load(**RUN, nodes=4, rounds=3, out=tmp_path / "n")
    task = build_task(settings.run_config())
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(4)]
    sender, receiver = AsyncNode(settings, task, 1, addresses, Secret(None)), AsyncNode(settings, task, 0, addresses,
                                                                                  Secret(None))
    sender.state.trained(task.initial(1), 0.0)
    messages = [m for m in iter(lambda: sender.state.next_send(0.0), None) if m.peer == 0]
    if not messages:  # step 0's plan sends node 0 nothing from node 1: the next step's does (seed 0)
        sender.state.trained(sender.state.start, 1.0)
        messages = [m for m in iter(lambda: sender.state.next_send(1.0), None) if m.peer == 0]
    body = encode(messages[0].batch)
    assert receiver.receive(body, 2)[1] == 403  # signed by node 2, but says it is node 1's
    assert receiver.receive(body, 1) == ({"outcome": "taken"}, 200)
    answer, status = receiver.receive(body, 1)  # the same message again: refused, whatever the nonce
    assert status == 409 and answer["reason"] == "replayed_step"


def test_a_node_with_max_norm_refuses_a_fragment_over_it_and_counts_it(tmp_path: Path) -> None:
    """--max-norm in the daemon: the state's check (`AsyncNodeState.receive`), answered 400 `out_of_range` as a
    barrier node answers it, counted in /metrics as a barrier node counts it, in its status and its report."""
    settings = Settings.load(**RUN, nodes=4, rounds=3, max_norm=10.0, out=tmp_path / "n")
    task = build_task(settings.run_config())
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(4)]
    sender, receiver = AsyncNode(settings, task, 1, addresses, Secret(None)), AsyncNode(settings, task, 0, addresses,
                                                                                  Secret(None))
    assert receiver.state.max_norm == 10.0
    messages: list = []
    for step in range(3):  # the first step whose plan sends node 0 something from node 1
        sender.state.trained(sender.state.start, float(step))
        messages = [m for m in iter(lambda: sender.state.next_send(0.0), None) if m.peer == 0]
        if messages:
            break
    honest = messages[0].batch
    scaled = FragmentBatch(honest.run_id, honest.round, honest.sender, honest.k, honest.fingerprint,
                           {f: 1000 * np.asarray(v) for f, v in honest.fragments.items()})
    answer, status = receiver.receive(encode(scaled), 1)
    assert status == 400 and answer["reason"] == "out_of_range" and "--max-norm 10" in answer["detail"]
    assert receiver.state.inbox_depth() == 0
    assert receiver.receive(encode(honest), 1) == ({"outcome": "taken"}, 200)  # the same step, within the bound
    refused = receiver.metrics.registry.get_sample_value("mosaic_refused_messages_total", {"reason": "out_of_range"})
    view = receiver.status()
    assert refused == 1 and (view["refused"], view["out_of_range"]) == (1, 1)
    assert receiver.report()["out_of_range"] == 1


@pytest.mark.parametrize("send", ["trained", "aggregated"])
def test_a_daemon_s_node_sends_what_async_send_says(tmp_path: Path, send: str) -> None:
    """The daemon's node is `protocol.async_node_state`'s, given --async-send: after an aggregation that moved its
    model, what it queues is the trained model's fragments (the default) or the aggregate's."""
    settings = Settings.load(**RUN, nodes=4, rounds=3, async_send=send, out=tmp_path / "n")
    task = build_task(settings.run_config())
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(4)]
    nodes = [AsyncNode(settings, task, i, addresses, Secret(None)) for i in range(4)]
    assert {node.state.send.value for node in nodes} == {send}
    for i in (1, 2, 3):
        nodes[i].state.trained(task.initial(i), 0.0)
        for message in iter(lambda i=i: nodes[i].state.next_send(0.0), None):
            if message.peer == 0:
                nodes[0].state.receive(message.batch, 0.5, sender=i)
    assert nodes[0].state.inbox_depth() > 0
    local = task.initial(0)
    kept = nodes[0].state.trained(local, 1.0).vector
    assert not np.array_equal(kept, local)  # the inbox moved the model
    model = local if send == "trained" else kept
    fragmentation = nodes[0].state.fragmentation
    for message in iter(lambda: nodes[0].state.next_send(1.0), None):
        for f, values in message.batch.fragments.items():
            assert np.array_equal(values, fragmentation.take(model, f)), (send, f)


@pytest.mark.slow
def test_a_node_killed_mid_run_costs_the_others_nothing(tmp_path: Path, kit: Any) -> None:
    """Node 3 is SIGKILLed once it has trained a few iterations: the others finish at their pace, as without it."""
    import json
    import threading
    import urllib.request

    profile = kit.pace(tmp_path, 0.05)
    alike = run_cluster_async(Settings.load(**RUN, nodes=4, rounds=40, eval_every=10, node_profile=profile,
                                            out=tmp_path / "alike"), progress=False, timeout=120)["asynchronous"]
    settings = Settings.load(**RUN, nodes=4, rounds=40, eval_every=10, node_profile=profile,
                             out=tmp_path / "killed")
    cluster = AsyncCluster(settings, progress=False)
    done: dict = {}
    running = threading.Thread(target=lambda: done.update(cluster.run(120)))
    running.start()
    killed = False
    for _ in range(600):
        roster = tmp_path / "killed" / "roster.json"
        if roster.exists() and "node-3" in cluster.processes.procs:
            address = json.loads(roster.read_text())["addresses"][3]
            try:
                with urllib.request.urlopen(f"http://{address}/v1/status", timeout=1) as answer:
                    steps = json.loads(answer.read())["steps"]
            except OSError:
                steps = 0
            if steps >= 5:
                cluster.processes.procs["node-3"].kill()
                killed = True
                break
        time.sleep(0.05)
    running.join(150)
    assert killed and done["status"] == "finished" and done["dropped"] == [3], done
    block = done["asynchronous"]
    assert sorted(block["steps"]) == ["0", "1", "2"] and set(block["steps"].values()) == {40}
    assert block["messages_unsent"] > 0  # what went to node 3 after it died
    reference = sum(alike["steps_per_s"][str(i)] for i in range(3)) / 3
    for i in range(3):  # never 20% slower than without the kill (faster is the host's load, not the kill's doing)
        assert block["steps_per_s"][str(i)] > 0.8 * reference, (block, alike)


def test_placed_nodes_need_one_host_each(tmp_path: Path) -> None:
    """`hosts` (the netns lab's placement, tests/netns/test_async_twin.py) names one address per node."""
    settings = Settings.load(**RUN, nodes=3, out=tmp_path / "run")
    with pytest.raises(ValueError, match="2 hosts for 3 nodes"):
        AsyncCluster(settings, hosts=[NodeHost("10.213.0.1:9000"), NodeHost("10.213.0.2:9000")])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("secret", [None, b"a-secret-of-the-async-frames-32b"])
async def test_an_asynchronous_node_s_link_sends_fragments_as_frames(tmp_path: Path, secret: bytes | None) -> None:
    """The link of an asynchronous node (`AsyncNode.send`) sends its fragments as frames on each peer's stream
    (`http.stream`), as a barrier node's does: node 0 takes every message node 1 planned for it, each as a frame,
    signed where the run has a secret; a frame larger than any message of the run is refused 413 unread."""
    settings = Settings.load(**RUN, nodes=4, rounds=3, port=0, host="127.0.0.1", insecure=secret is None,
                             out=tmp_path / "n")
    task = build_task(settings.run_config())
    receiver = AsyncNode(settings, task, 0, ["127.0.0.1:1"] * 4, Secret(secret))
    runner, port = await serve(async_app(receiver), receiver.options)
    try:
        addresses = [f"127.0.0.1:{port}", "127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1"]  # only node 0 listens
        sender, twin = (AsyncNode(settings, task, 1, addresses, Secret(secret)) for _ in range(2))
        planned = 0
        for step in range(10):  # the first step whose plan sends node 0 something; the twin says what
            sender.state.trained(sender.state.start, float(step))
            twin.state.trained(twin.state.start, float(step))
            planned = sum(m.peer == 0 for m in iter(lambda: twin.state.next_send(0.0), None))
            if planned:
                break
        assert planned > 0

        def counted(name: str, label: str, value: str) -> float:
            return receiver.metrics.registry.get_sample_value(name, {label: value}) or 0.0

        sign = None if sender.keyring is None else signer(lambda: sender.keyring.credentials(settings.run_id),
                                                          lambda: "1")
        async with Client(5.0, 0, signer=sign) as client:
            sending = asyncio.ensure_future(sender.send(client))
            try:
                async with asyncio.timeout(20):
                    while counted("mosaic_fragment_frames_total", "status", "200") < planned:
                        await asyncio.sleep(0.02)
            finally:
                sending.cancel()
        assert counted("mosaic_fragment_frames_total", "status", "200") == planned
        assert receiver.state.inbox_depth() > 0 and receiver.status()["refused"] == 0

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {STREAM_PATH} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n"
                     .encode())
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 101 ")
        writer.write(request_head({"Content-Type": "application/cbor"}, receiver.max_bytes + 1))
        status, length = ANSWER.unpack(await asyncio.wait_for(reader.readexactly(ANSWER.size), 10))
        answer = json.loads(await reader.readexactly(length))
        assert (status, answer["reason"]) == (413, "too_large"), answer
        assert counted("mosaic_refused_messages_total", "reason", "too_large") == 1
        assert await asyncio.wait_for(reader.read(), 10) == b""  # refused before its body: the stream is closed
        writer.close()
    finally:
        await runner.cleanup()
