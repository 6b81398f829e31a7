"""Fragments over an upgraded stream (`http/stream.py`, `mosaic_proto.frames`): the node's own client sends each
message as a frame and gets the POST's answer; every check of POST /v1/fragments holds for a frame (signature,
replay, digest, size, content type, body slots, deadlines) and a refusal before the body is read closes the
stream; a peer without streams is POSTed to.

The node is the daemon's own HTTP app (`node_app` over an `Inbox` and a `NodeState` in round 0's training phase)
on loopback; the messages are real ones of its run, over real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trustme
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from mosaic_proto import CONTENT_TYPE, Fragmentation, FragmentBatch, Layout, NodeState, PeerSampler, encode
from mosaic_proto import auth as auth_module
from mosaic_proto.auth import REASONS, Credentials, run_key
from mosaic_proto.frames import (
    ANSWER,
    REQUEST,
    STREAM_PATH,
    UPGRADE,
    AnswerReader,
    End,
    FrameError,
    Head,
    Piece,
    RequestReader,
    answer_frame,
    request_head,
)
from mosaicd.daemon.http.auth import Keyring
from mosaicd.daemon.http.body import kept_buffers
from mosaicd.daemon.http.connections import Connections
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.node.inbox import Inbox
from mosaicd.daemon.node.routes import node_app
from mosaicd.settings import DaemonOptions, RunConfig

RUN, K, DIM = "frames", 4, 3 << 20  # 12 MiB of floats: all K fragments make a large message, one a small one
FR = Fragmentation.build(Layout.flat(DIM), K, 0)
SAMPLER = PeerSampler("local", 2, 0)  # 3 members, fanout 2: every fragment goes to both others
SECRET = b"a-secret-of-the-frames-tests-32b"


def message(sender: int, fragments: list[int], round: int = 0) -> bytes:
    values = {f: np.full(len(FR.indices[f]), sender, np.float32) for f in fragments}
    return encode(FragmentBatch(RUN, round, sender, K, FR.fingerprint, values))


def signed(body: bytes, sender: str = "1", secret: bytes = SECRET, nonce: str | None = None,
           path: str = "/v1/fragments") -> dict[str, str]:
    return {"Content-Type": CONTENT_TYPE, **Credentials(run_key(secret, RUN), RUN).headers(
        "POST", path, sender, 0, body, time.time(), nonce or os.urandom(8).hex())}


class Node:
    def __init__(self, url: str, port: int, inbox: Inbox) -> None:
        self.url, self.port, self.inbox = url, port, inbox

    def frames(self) -> dict[str, float]:
        """mosaic_fragment_frames_total by status."""
        return {s.labels["status"]: s.value for m in self.inbox.metrics.registry.collect()
                for s in m.samples if s.name == "mosaic_fragment_frames_total"}

    def limited(self, reason: str) -> float:
        return self.inbox.metrics.registry.get_sample_value("mosaic_limited_requests_total", {"reason": reason}) or 0


def node_inbox(secret: bytes | None, **changes: Any) -> Inbox:
    """Node 0 of a 3-member run, in round 0's training phase."""
    options = DaemonOptions(**{"host": "127.0.0.1", "port": 0, **({"insecure": True} if secret is None else {}),
                               **changes})
    state = NodeState(max_bytes=options.max_body_bytes)
    state.registered(0, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], [0, 1, 2], 0, RUN, 0.0)
    state.start(FR, SAMPLER, np.zeros(DIM, np.float32))
    inbox = Inbox(state, options, Keyring(secret) if secret else None)
    inbox.registered_for(RunConfig(run_id=RUN, nodes=3, fragments=K, fanout=2))
    inbox.model_known(FR.layout)
    return inbox


async def start(secret: bytes | None, **changes: Any) -> tuple[Node, web.AppRunner]:
    inbox = node_inbox(secret, **changes)
    runner, port = await serve(node_app(inbox), inbox.options)
    return Node(f"http://127.0.0.1:{port}", port, inbox), runner


@pytest.fixture(params=["insecure", "secret"])
async def node(request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    served, runner = await start(None if request.param == "insecure" else SECRET)
    try:
        yield served
    finally:
        await runner.cleanup()


async def upgraded(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {STREAM_PATH} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n"
                 .encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101 "), head
    return reader, writer


async def answer_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    status, length = ANSWER.unpack(await asyncio.wait_for(reader.readexactly(ANSWER.size), 10))
    return status, json.loads(await reader.readexactly(length))


async def closed(reader: asyncio.StreamReader, timeout: float = 10) -> bool:
    """Whether the node closed the stream (at once, or after what it had to say: read to the end)."""
    try:
        await asyncio.wait_for(reader.read(), timeout)
        return reader.at_eof()
    except ConnectionResetError:  # closed with bytes of ours unread
        return True


# -- the frames themselves ----------------------------------------------------------------------------------------

@given(st.lists(st.tuples(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3),
                          st.binary(max_size=64)), min_size=1, max_size=4), st.data())
def test_frames_read_in_any_pieces_give_the_same_heads_and_bodies(frames: list[tuple[dict[str, str], bytes]],
                                                                  data: st.DataObject) -> None:
    reader, got = RequestReader(), []
    for headers, body in frames:
        wire = request_head(headers, len(body)) + body
        cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
        parts, body_seen = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)], b""
        ends = 0
        for part in parts:
            for event in reader.feed(part):
                if isinstance(event, Head):
                    got.append((event.headers, event.length))
                elif isinstance(event, Piece):
                    body_seen += bytes(event.data)
                else:
                    assert isinstance(event, End)
                    ends += 1
        assert (ends, body_seen) == (1, body)
        reader.ready()
    assert got == [(h, len(b)) for h, b in frames]
    answers = AnswerReader()
    wire = b"".join(answer_frame(200 + i, json.dumps(h).encode()) for i, (h, _) in enumerate(frames))
    assert [(s, json.loads(b)) for s, b in answers.feed(wire[:3]) + answers.feed(wire[3:])] == \
        [(200 + i, h) for i, (h, _) in enumerate(frames)]


def test_a_frame_before_the_last_is_answered_or_a_bad_head_is_an_error() -> None:
    reader = RequestReader()
    with pytest.raises(FrameError, match="before the last one was answered"):
        reader.feed(request_head({}, 1) + b"x" + request_head({}, 0))
    for bad in (REQUEST.pack(1 << 20, 0), REQUEST.pack(4, 0) + b"[1] ", REQUEST.pack(8, 0) + b'{"a": 1}'):
        with pytest.raises(FrameError):
            RequestReader().feed(bad)


# -- the node's client against the node --------------------------------------------------------------------------

async def test_the_clients_messages_go_as_frames_and_get_the_posts_answers(node: Node) -> None:
    connections = Connections()
    url, secure = f"{node.url}/v1/fragments", node.inbox.keyring is not None
    try:
        for sender, fragments in ((1, list(range(K))), (2, [1]), (1, [0])):
            body = message(sender, fragments)
            headers = signed(body, str(sender)) if secure else {"Content-Type": CONTENT_TYPE}
            answer = await connections.request("POST", url, headers, body, stream=True)
            expected = (409, "duplicate_fragment") if (sender, fragments) == (1, [0]) else (200, "accepted")
            got = json.loads(answer.body)
            assert (answer.status, got.get("status", got.get("reason"))) == expected, got
    finally:
        connections.close()
    assert node.frames() == {"200": 2.0, "409": 1.0}  # all three on one stream: no POST reached the node
    assert node.inbox.state.taking().report.fragments_in == K + 1
    assert len(message(1, list(range(K)))) in kept_buffers().in_use()  # read into a kept buffer, its fragments views


async def test_frames_go_over_tls(tmp_path: Path) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    leaf.cert_chain_pems[0].write_to_path(cert)
    leaf.private_key_pem.write_to_path(key)
    served, runner = await start(SECRET, tls_cert=cert, tls_key=key)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    connections = Connections(client)
    try:
        body = message(1, list(range(K)))
        answer = await connections.request("POST", f"https://127.0.0.1:{served.port}/v1/fragments", signed(body),
                                           body, stream=True)
        assert (answer.status, json.loads(answer.body)) == (200, {"status": "accepted", "round": 0})
    finally:
        connections.close()
        await runner.cleanup()
    assert served.frames() == {"200": 1.0}


async def posts_only(seen: list[str]) -> tuple[web.AppRunner, int]:
    """A peer on loopback that takes POST /v1/fragments (each noted in `seen`: method, path, body size) and serves no
    fragments stream; its runner and port."""
    async def fragments(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path} {len(await request.read())}")
        return web.json_response({"status": "accepted", "round": 0})

    app = web.Application(client_max_size=64 << 20)  # a message of one fragment: 3 MiB
    app.router.add_post("/v1/fragments", fragments)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def test_a_peer_without_streams_is_posted_to() -> None:
    seen: list[str] = []
    runner, port = await posts_only(seen)
    connections = Connections()
    try:
        for _ in range(2):
            answer = await connections.request("POST", f"http://127.0.0.1:{port}/v1/fragments",
                                               {"Content-Type": CONTENT_TYPE}, b"abc", stream=True)
            assert (answer.status, json.loads(answer.body)) == (200, {"status": "accepted", "round": 0})
    finally:
        connections.close()
        await runner.cleanup()
    assert seen == ["POST /v1/fragments 3", "POST /v1/fragments 3"]  # the upgrade was asked for once (404)


async def test_a_peer_restarted_with_streams_gets_frames_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that served no stream is POSTed to for POSTED_FOR_S, then asked again: a node restarted at the same
    address with the stream (a newer version) is sent frames, not POSTs for the rest of the run."""
    from mosaicd.daemon.http import connections as module

    monkeypatch.setattr(module, "POSTED_FOR_S", 2.0)
    seen: list[str] = []
    runner, port = await posts_only(seen)
    connections = Connections()
    body = message(1, [0])
    url = f"http://127.0.0.1:{port}/v1/fragments"
    try:
        answer = await connections.request("POST", url, {"Content-Type": CONTENT_TYPE}, body, stream=True)
        assert answer.status == 200 and seen == [f"POST /v1/fragments {len(body)}"]  # no stream there (404)
        connections.close()  # its kept-alive connection, which the server's shutdown would wait for
        await runner.cleanup()
        served, runner = await start(None, port=port)  # the peer again, now a node that serves the stream
        answer = await connections.request("POST", url, {"Content-Type": CONTENT_TYPE}, body, stream=True)
        assert answer.status == 200 and served.frames() == {"200": 0.0}  # within POSTED_FOR_S: still POSTed
        await asyncio.sleep(2.1)
        answer = await connections.request("POST", url, {"Content-Type": CONTENT_TYPE}, message(1, [1]),
                                           stream=True)
        assert (answer.status, json.loads(answer.body)) == (200, {"status": "accepted", "round": 0})
        assert served.frames() == {"200": 1.0}  # then asked for the stream again, and sent the message as a frame
    finally:
        connections.close()
        await runner.cleanup()


async def test_a_fresh_node_serves_the_frames_and_auth_refusal_series_at_zero() -> None:
    """The series a rate or an alert reads exist before their first event: the accepted frames', and each reason a
    signed node refuses a request for (every reason `mosaic_proto.auth` raises an AuthError with)."""
    raised = set(re.findall(r'AuthError\("([a-z_]+)"', Path(auth_module.__file__).read_text()))
    assert raised == set(REASONS)
    served, runner = await start(SECRET)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = (await asyncio.wait_for(reader.read(), 10)).decode()
        writer.close()
    finally:
        await runner.cleanup()
    assert text.startswith("HTTP/1.1 200 ")
    assert 'mosaic_fragment_frames_total{status="200"} 0.0' in text
    for reason in REASONS:
        assert f'mosaic_auth_refused_total{{reason="{reason}"}} 0.0' in text, reason


async def test_a_get_without_the_upgrade_is_426(node: Node) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    writer.write(f"GET {STREAM_PATH} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 426 ")
    writer.close()


# -- every check of the POST, on a frame ----------------------------------------------------------------------

async def test_a_frame_is_checked_as_its_post_and_refused_before_its_body_with_the_stream_closed() -> None:
    served, runner = await start(SECRET)
    body = message(1, [0])
    try:
        cases = {
            "unsigned": ({"Content-Type": CONTENT_TYPE}, 401),
            "bad_tag": (signed(body, secret=b"not-the-secret-but-long-enough"), 401),
            "other path": (signed(body, path="/v1/model"), 401),
            "unsupported_media_type": ({**signed(body), "Content-Type": "application/json"}, 415),
        }
        for case, (headers, status) in cases.items():
            reader, writer = await upgraded(served.port)
            writer.write(request_head(headers, len(body)))  # the head alone: refused before a body byte is sent
            got, answer = await answer_of(reader)
            assert got == status, (case, answer)
            assert await closed(reader), case
            writer.close()
        assert served.inbox.state.taking().report.fragments_in == 0
        # replay: a nonce a POST took is refused to a frame, and one a frame took to the next frame
        reader, writer = await upgraded(served.port)
        headers = signed(body, nonce="once-only-nonce")
        writer.write(request_head(headers, len(body)) + body)
        assert (await answer_of(reader))[0] == 200
        writer.write(request_head(headers, len(body)))
        status, answer = await answer_of(reader)
        assert (status, answer["reason"]) == (401, "replayed")
        writer.close()
        # a body that is not the signed one: 401 bad_body, and the stream goes on
        reader, writer = await upgraded(served.port)
        other = message(2, [1])
        writer.write(request_head(signed(body, "2"), len(other)) + other)
        status, answer = await answer_of(reader)
        assert (status, answer["reason"]) == (401, "bad_body")
        writer.write(request_head(signed(other, "2"), len(other)) + other)
        assert await answer_of(reader) == (200, {"status": "accepted", "round": 0})
        writer.close()
        # signed by one member, a message naming another: the node's own check, as for a POST
        reader, writer = await upgraded(served.port)
        forged = message(1, [2])
        writer.write(request_head(signed(forged, "2"), len(forged)) + forged)
        status, answer = await answer_of(reader)
        assert (status, answer["reason"]) == (403, "sender_mismatch")
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_frames_header_names_are_read_in_any_case_as_a_posts() -> None:
    """HTTP's header names are read in any case, and so are a frame's: its head in lower case is the same request,
    and one without a signed header is refused as the POST is (401), never an error inside the node."""
    served, runner = await start(SECRET)
    try:
        reader, writer = await upgraded(served.port)
        body = message(1, [0])
        writer.write(request_head({k.lower(): v for k, v in signed(body).items()}, len(body)) + body)
        assert await answer_of(reader) == (200, {"status": "accepted", "round": 0})
        writer.write(request_head({k.upper(): v for k, v in signed(body, "2").items()}, len(body)) + body)
        assert (await answer_of(reader))[1]["reason"] == "sender_mismatch"  # read, then refused by the node
        other = message(2, [1])  # names in mixed case (a KeyError inside the node before the fix)
        mixed = {k if k == "Authorization" else k.lower(): v for k, v in signed(other, "2").items()}
        writer.write(request_head(mixed, len(other)) + other)
        assert await answer_of(reader) == (200, {"status": "accepted", "round": 0})
        writer.close()
        reader, writer = await upgraded(served.port)
        headers = {k if k == "Authorization" else k.lower(): v for k, v in signed(other, "2").items()}
        del headers["x-mosaic-nonce"]
        writer.write(request_head(headers, len(other)))
        status, answer = await answer_of(reader)
        assert (status, answer["reason"]) == (401, "malformed_auth"), answer
        assert "x-mosaic-nonce" in answer["detail"] and await closed(reader)
        writer.close()
        assert served.inbox.state.taking().report.fragments_in == 2
    finally:
        await runner.cleanup()


async def test_a_frame_larger_than_any_message_is_413_unread_and_a_slow_one_408() -> None:
    served, runner = await start(None, request_timeout=1.0)
    try:
        reader, writer = await upgraded(served.port)
        writer.write(request_head({"Content-Type": CONTENT_TYPE}, 64 << 20))
        status, answer = await answer_of(reader)
        assert (status, answer["reason"]) == (413, "too_large") and "no message of this run" in answer["detail"]
        assert await closed(reader)
        reader, writer = await upgraded(served.port)
        body = message(1, [0])
        writer.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body[:100])
        status, answer = await answer_of(reader)
        assert (status, answer["reason"]) == (408, "slow_body")
        assert await closed(reader)
        assert served.limited("slow_body") == 1
        assert served.inbox.state.taking().report.fragments_in == 0
    finally:
        await runner.cleanup()


async def test_frames_share_the_posts_body_slots() -> None:
    served, runner = await start(None, max_bodies=1, request_timeout=2.0)
    body = message(1, list(range(K)))
    try:
        first, writer = await upgraded(served.port)
        writer.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body[:1000])  # holds the one slot
        second, other = await upgraded(served.port)
        other.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)))
        status, answer = await answer_of(second)
        assert (status, answer["reason"]) == (503, "busy")
        assert await closed(second)
        writer.write(body[1000:])
        assert await answer_of(first) == (200, {"status": "accepted", "round": 0})
        assert served.limited("busy") == 1
    finally:
        await runner.cleanup()


async def test_a_stream_between_frames_is_closed_for_a_newcomer_at_the_connection_cap() -> None:
    """Between two frames a stream is idle, as a kept-alive connection between two requests is: at the connection
    cap the guard closes the oldest idle one for a newcomer instead of refusing the newcomer 503 (a node with more
    peers than --max-connections would otherwise have every place held by their streams). A stream whose frame is
    being read is passed over; the client whose stream was closed opens another at its next message."""
    served, runner = await start(None, max_connections=8)
    connections, url = Connections(), f"{served.url}/v1/fragments"
    body = message(1, [0])
    try:
        busy, busy_writer = await upgraded(served.port)
        busy_writer.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body[:1000])  # a frame half sent
        sent = await connections.request("POST", url, {"Content-Type": CONTENT_TYPE}, message(2, [1]), stream=True)
        assert sent.status == 200
        streams = [await upgraded(served.port) for _ in range(6)]  # the cap: 8 connections from this address
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 "), head  # the client's stream, the oldest idle one, made room
        assert served.limited("idle_closed") == 1
        busy_writer.write(body[1000:])  # the stream in the middle of a frame was passed over
        assert await answer_of(busy) == (200, {"status": "accepted", "round": 0})
        again = await connections.request("POST", url, {"Content-Type": CONTENT_TYPE}, message(2, [2]), stream=True)
        assert (again.status, json.loads(again.body)) == (200, {"status": "accepted", "round": 0})
        other, other_writer = streams[-1]
        other_writer.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body)
        assert (await answer_of(other))[0] == 409  # node 1's message again: the other streams still carry frames
        writer.close()
    finally:
        connections.close()
        await runner.cleanup()
    assert served.frames() == {"200": 3.0, "409": 1.0}  # the client's second message came as a frame too


async def test_an_idle_stream_is_closed_at_the_header_timeout_and_garbage_closes_it_at_once() -> None:
    served, runner = await start(None, header_timeout=0.5)
    try:
        reader, writer = await upgraded(served.port)
        started = time.monotonic()
        assert await closed(reader)
        assert 0.4 < time.monotonic() - started < 5
        assert served.limited("idle_closed") >= 1
        reader, writer = await upgraded(served.port)
        writer.write(struct.pack("!II", 4, 0) + b"nope")
        assert await closed(reader, 2)
        body = message(1, [0])  # two frames at once: the second before the first is answered
        reader, writer = await upgraded(served.port)
        writer.write((request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body) * 2)
        assert await closed(reader, 5)
        assert served.inbox.state.taking().report.fragments_in <= 1
    finally:
        await runner.cleanup()


async def test_a_stream_idle_after_a_frame_expires_without_a_word_as_a_kept_alive_connection() -> None:
    """A stream idle past the header timeout after it carried a frame is a kept-alive connection expiring (rounds
    stall that long while a barrier restarts): closed, but neither counted nor logged as a refusal."""
    served, runner = await start(None, header_timeout=0.5)
    body = message(1, [0])
    try:
        reader, writer = await upgraded(served.port)
        writer.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body)
        assert await answer_of(reader) == (200, {"status": "accepted", "round": 0})
        assert await closed(reader)
        assert served.limited("idle_closed") == 0
    finally:
        await runner.cleanup()


async def test_a_server_that_stops_ends_its_streams_instead_of_waiting_out_its_grace() -> None:
    inbox = node_inbox(None, header_timeout=600)  # an idle stream stays
    runner = web.AppRunner(node_app(inbox), shutdown_timeout=600)  # a grace no test could wait out
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    reader, writer = await upgraded(runner.addresses[0][1])
    body = message(1, [0])
    writer.write(request_head({"Content-Type": CONTENT_TYPE}, len(body)) + body)
    assert await answer_of(reader) == (200, {"status": "accepted", "round": 0})  # a stream waiting for its next
    await asyncio.wait_for(runner.cleanup(), 60)
    assert await closed(reader)
    writer.close()
