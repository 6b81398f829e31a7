"""A node whose state directory holds a checkpoint of an earlier run, started for a new run: its peers' first
fragments wait until its model is known, as they do for any node, instead of being refused as a restarted
node's are (such a node lost rounds; this one lost none). Refused, they used up the senders' retries while a slow
node built its task, and the new run went on without them: other models than the reference, and no error.

The node here is the daemon's own HTTP app (`node_app` over an `Inbox` and a `NodeState`, made as `run_node` makes
them when it finds a checkpoint) served on loopback; the message is a real one of its run, sent over real HTTP.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mosaic_proto import CONTENT_TYPE, Fragmentation, Layout, NodeState, PeerSampler, Quadratic
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.node.inbox import Inbox
from mosaicd.daemon.node.routes import node_app
from mosaicd.settings import DaemonOptions

RUN, N, D, K = "earlier-checkpoint", 3, 12, 2
FR = Fragmentation.build(Layout.flat(D), K, 0)
SAMPLER = PeerSampler("local", N - 1, 0)  # every fragment goes to both others
Q = Quadratic.build(N, D, "correlated", seed=0)
ADDRESSES = [f"127.0.0.1:{i + 1}" for i in range(N)]


def round_0_message_to_node_0() -> bytes:
    sender = NodeState()
    sender.registered(1, ADDRESSES, range(N), 0, RUN, 0.0)
    sender.start(FR, SAMPLER, Q.initial(1))
    return next(m.payload for m in sender.outgoing(Q.initial(1), 0.0).messages if m.peer == 0)


async def model_known_soon(state: NodeState, inbox: Inbox) -> None:
    """Node 0's model becomes known 0.3 s from now, as a node that registered builds its task."""
    await asyncio.sleep(0.3)
    state.start(FR, SAMPLER, Q.initial(0))
    inbox.model_known(FR.layout)


async def post_round_0_fragment_while_the_model_is_not_known(registered_round: int) -> tuple[float, int, dict]:
    """Node 0, made as a node that found a checkpoint, registered at `registered_round` and not started: a peer's
    round-0 message; its model becomes known 0.3 s later. (seconds to the answer, status, answer)."""
    options = DaemonOptions(host="127.0.0.1", port=0, request_timeout=10)
    state = NodeState(max_bytes=options.max_body_bytes, rejoining=True)
    state.registered(0, ADDRESSES, range(N), registered_round, RUN, 0.0)
    inbox = Inbox(state, options, None)
    runner, port = await serve(node_app(inbox), options)

    starting = asyncio.ensure_future(model_known_soon(state, inbox))
    try:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/v1/fragments", data=round_0_message_to_node_0(),
                headers={"Content-Type": CONTENT_TYPE}) as resp:
            return loop.time() - sent, resp.status, await resp.json()
    finally:
        await starting
        await runner.cleanup()


async def test_a_new_runs_first_fragment_waits_for_a_node_that_found_an_earlier_runs_checkpoint() -> None:
    waited, status, answer = await post_round_0_fragment_while_the_model_is_not_known(0)
    assert (status, answer) == (200, {"status": "accepted", "round": 0})
    assert waited >= 0.25  # held until the model was known, then taken


async def test_a_node_that_rejoins_a_run_past_round_0_refuses_at_once_with_a_retry() -> None:
    waited, status, answer = await post_round_0_fragment_while_the_model_is_not_known(3)
    assert status == 503 and answer["reason"] == "rejoining" and "rejoining" in answer["detail"]
    assert waited < 0.25


async def test_a_restarted_node_with_the_cluster_secret_says_rejoining_before_it_is_registered() -> None:
    """With the cluster secret a node checks a request with its run's key, which it learns as it registers; a
    restarted one's registration is answered only once the round it lost is released, so the guard does not hold
    its peers' sends until then (they would wait out their budget, and the round its deadline): it answers
    `rejoining` at once, and a sender that gives that reason up (`give_up`) hears it on the first try."""
    from mosaicd.daemon.http.auth import Keyring, signer
    from mosaicd.daemon.http.client import Client, Refused

    keyring = Keyring(b"s" * 32)
    options = DaemonOptions(host="127.0.0.1", port=0, request_timeout=8)
    runner, port = await serve(node_app(Inbox(NodeState(max_bytes=options.max_body_bytes, rejoining=True), options,
                                              keyring)), options)
    try:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        async with Client(timeout=8, retries=3, signer=signer(lambda: keyring.credentials(RUN), lambda: "1")) as client:
            with pytest.raises(Refused) as refused:
                await client.request("POST", f"http://127.0.0.1:{port}/v1/fragments", data=round_0_message_to_node_0(),
                                     headers={"Content-Type": CONTENT_TYPE}, give_up=frozenset({"rejoining"}))
        waited = loop.time() - sent
    finally:
        await runner.cleanup()
    assert (refused.value.status, refused.value.reason) == (503, "rejoining")
    assert waited < 1.0  # neither held for the request timeout nor retried (0.1 + 0.2 + 0.4 s of backoff)


@pytest.mark.parametrize("starting", [True, False])
async def test_a_sender_waits_for_a_starting_member_and_gives_up_on_one_that_lost_the_round(starting: bool) -> None:
    """Node 0 came back and was placed at round 3 (registered, its model known 0.3 s later): a round-3 message of node
    1 to it is taken once it is up where node 0 is one of the round's `starting` members (named joined by the
    release that opened the round, or all of a resumed run's), and given up at once, unsent, where it is not (it
    lost that round: it is a member from a later one)."""
    from mosaicd.daemon.http.client import Client
    from mosaicd.daemon.node.outbound import send_all
    from mosaicd.logs import get_logger

    options = DaemonOptions(host="127.0.0.1", port=0, request_timeout=8)
    state = NodeState(max_bytes=options.max_body_bytes, rejoining=True)
    state.registered(0, ADDRESSES, range(N), 3, RUN, 0.0)
    inbox = Inbox(state, options, None)
    runner, port = await serve(node_app(inbox), options)
    sender = NodeState()
    sender.registered(1, ADDRESSES, range(N), 3, RUN, 0.0)
    sender.start(FR, SAMPLER, Q.initial(1))
    message = next(m for m in sender.outgoing(Q.initial(1), 0.0).messages if m.peer == 0)

    up = asyncio.ensure_future(model_known_soon(state, inbox))
    try:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        async with Client(timeout=8, retries=3) as client:
            delivered, unsent = await send_all(client, 3, [message], [f"http://127.0.0.1:{port}/v1/fragments"],
                                               get_logger(role="node"), budget=5.0,
                                               starting=frozenset({0}) if starting else frozenset())
        waited = loop.time() - sent
    finally:
        await up
        await runner.cleanup()
    if starting:
        assert list(delivered) == [0] and unsent == [] and waited >= 0.25
    else:
        assert delivered == {} and unsent == [message] and waited < 0.25
