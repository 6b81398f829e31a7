"""Every endpoint of a node daemon and of the barrier, fed bad input: a 4xx with a JSON "reason", nothing changed.

The run: a barrier process, one node daemon process (`mosaicd node`, the node under test) and three `Peer`s that
this test drives from a background event loop. Round 0 is played in the fixture, so the daemon sits at round 1
waiting at the barrier (it has sent its round-1 fragments) while the bad requests arrive. The module's last test
plays the remaining rounds: the final models must still be the in-memory reference, bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mosaic_proto import CONTENT_TYPE, Fragmentation, FragmentBatch, Layout, encode
from mosaicd import Peer, Settings
from mosaicd.experiments.cluster import free_ports

RUN = dict(run_id="endpoints", nodes=4, rounds=4, fragments=4, fanout=2, dim=16, seed=5, train=False, eval_every=0,
           max_body_bytes=4096, round_deadline=300, register_deadline=60, request_timeout=10)


@dataclass
class Net:
    tmp: Path
    barrier_port: int
    node_port: int
    procs: dict[str, subprocess.Popen]
    loop: asyncio.AbstractEventLoop
    helpers: list[Peer] = field(default_factory=list)
    vectors: dict[int, np.ndarray] = field(default_factory=dict)
    rank: int = -1  # the daemon's rank
    settings: Settings = field(default_factory=lambda: Settings(**RUN))

    @property
    def node(self) -> str:
        return f"http://127.0.0.1:{self.node_port}"

    @property
    def barrier(self) -> str:
        return f"http://127.0.0.1:{self.barrier_port}"

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def helper_rank(self) -> int:
        return min(p.rank for p in self.helpers)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.tmp.glob("*.log")))


async def _start_helpers(net: Net, count: int) -> None:
    settings = Settings(**RUN, host="127.0.0.1", port=0, barrier_url=net.barrier, insecure=True)  # as its by-hand roles
    net.helpers = [Peer(settings, Layout.flat(settings.dim)) for _ in range(count)]
    await asyncio.gather(*(p.__aenter__() for p in net.helpers))


async def _play(net: Net, rounds: int) -> None:
    for _ in range(rounds):
        results = await asyncio.gather(*(p.gossip(net.vectors[p.rank]) for p in net.helpers))
        net.vectors = {p.rank: v for p, v in zip(net.helpers, results, strict=True)}


async def _finish(net: Net) -> None:
    await asyncio.gather(*(p.finish() for p in net.helpers))


async def _close(net: Net) -> None:
    await asyncio.gather(*(p.close() for p in net.helpers))


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory, kit: Any) -> Any:
    tmp = tmp_path_factory.mktemp("endpoints")
    barrier_port, node_port = free_ports(2)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="helpers", daemon=True)
    thread.start()
    net = Net(tmp, barrier_port, node_port, {}, loop)

    def spawn(name: str, *args: str) -> None:
        with open(tmp / f"{name}.log", "wb") as log:
            command = [*kit.by_hand, *args, "--host", "127.0.0.1", "--log-json", *kit.role_flags(args[0], RUN)]
            net.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)

    try:
        spawn("barrier", "barrier", "--port", str(barrier_port), "--out", str(tmp / "barrier"))
        kit.wait_until(lambda: _up(kit, f"{net.barrier}/healthz"), 30, "the barrier")
        spawn("node", "node", "--port", str(node_port), "--barrier-url", net.barrier, "--out", str(tmp / "node"))
        net.call(asyncio.wait_for(_start_helpers(net, RUN["nodes"] - 1), 60), timeout=70)
        net.rank = next(iter(set(range(RUN["nodes"])) - {p.rank for p in net.helpers}))
        initial = kit.reference_vectors(net.settings.model_copy(update={"rounds": 0}))
        net.vectors = {p.rank: initial[p.rank] for p in net.helpers}
        net.call(asyncio.wait_for(_play(net, 1), 30), timeout=40)
        kit.wait_until(lambda: _status(kit, net.node) == (1, "waiting"), 30, "the daemon at round 1's barrier")
        yield net
    except BaseException:
        print(net.logs())
        raise
    finally:
        try:
            net.call(asyncio.wait_for(_close(net), 10), timeout=15)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            for proc in net.procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)


def _up(kit: Any, url: str) -> bool:
    try:
        return kit.http("GET", url, timeout=2).status == 200
    except OSError:
        return False


def _status(kit: Any, base: str) -> tuple[int, str] | None:
    try:
        status = kit.http("GET", f"{base}/v1/status", timeout=2).json()
    except OSError:
        return None
    return status["round"], status["phase"]


def metrics(kit: Any, base: str) -> dict[str, float]:
    text = kit.http("GET", f"{base}/metrics").body.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def snapshot(kit: Any, net: Net) -> dict[str, Any]:
    """What a refused request must not change: the daemon's status and traffic counters, the barrier's state."""
    node = kit.http("GET", f"{net.node}/v1/status").json()
    node_metrics = {k: "NaN" if math.isnan(v) else v for k, v in metrics(kit, net.node).items()
                    if not k.startswith(("mosaic_refused_messages", "mosaic_limited_requests", "process_",
                                         "mosaic_asyncio_tasks"))}  # counts of refusals; the process's own moves
    barrier = kit.http("GET", f"{net.barrier}/v1/status").json()
    barrier.pop("refused")  # counts of refusals, as the node's above
    for member in barrier["members"]:
        member.pop("last_contact_s")  # any request from a member's rank counts as contact
    return {"node": node, "node_metrics": node_metrics, "barrier": barrier,
            "nodes_csv": (net.tmp / "barrier" / "nodes.csv").read_text()}


def refused(kit: Any, net: Net, reason: str) -> float:
    return metrics(kit, net.node).get(f"mosaic_refused_messages_total{{reason={reason}}}", 0.0)


def check_refused(kit: Any, net: Net, method: str, url: str, body: bytes | None, content_type: str | None,
                  status: int, reason: str) -> dict[str, Any]:
    before = snapshot(kit, net)
    reply = kit.http(method, url, body, content_type)
    assert reply.status == status, reply.body[:500]
    assert reply.content_type == "application/json"
    answer = reply.json()
    assert answer["reason"] == reason and isinstance(answer.get("detail"), str), answer
    assert snapshot(kit, net) == before
    return answer


# -- POST /v1/fragments on the daemon ----------------------------------------------------------------------------

def batch(net: Net, **change: Any) -> FragmentBatch:
    """A valid round-1 message from a helper to the daemon, with `change`d fields."""
    s = net.settings
    fragmentation = Fragmentation.build(Layout.flat(s.dim), s.fragments, s.seed, s.strategy)
    values = {0: np.ones(len(fragmentation.indices[0]), np.float32), 2: np.zeros(len(fragmentation.indices[2]),
                                                                                   np.float32)}
    fields = dict(run_id=s.run_id, round=1, sender=net.helper_rank(), k=s.fragments,
                  fingerprint=fragmentation.fingerprint, fragments=values)
    return FragmentBatch(**{**fields, **change})


def foreign_fingerprint(net: Net) -> bytes:
    s = net.settings
    return Fragmentation.build(Layout.flat(s.dim), s.fragments, s.seed + 1, s.strategy).fingerprint


def nan_values(net: Net) -> dict[int, np.ndarray]:
    values = dict(batch(net).fragments)
    values[0] = values[0].copy()
    values[0][1] = np.nan
    return values


def index_twice(net: Net) -> bytes:
    """A valid message but for its first fragment, listed twice."""
    message = cbor2.loads(encode(batch(net)))
    message["frags"] = [message["frags"][0], *message["frags"]]
    return cbor2.dumps(message)


BAD_FRAGMENTS: dict[str, tuple[Callable[[Net], tuple[bytes, str]], int, str, str | None]] = {
    # name: (body and content type, HTTP status, reason, the wire reason counted as refused)
    "garbage": (lambda n: (b"\xff\x00 this is not CBOR \x13\x37", CONTENT_TYPE), 400, "malformed", "malformed"),
    "empty": (lambda n: (b"", CONTENT_TYPE), 400, "malformed", "malformed"),
    "truncated": (lambda n: (encode(batch(n))[:-7], CONTENT_TYPE), 400, "malformed", "malformed"),
    "trailing": (lambda n: (encode(batch(n)) + b"\x00", CONTENT_TYPE), 400, "malformed", "malformed"),
    "stale_round": (lambda n: (encode(batch(n, round=0)), CONTENT_TYPE), 409, "stale_round", "stale_round"),
    "far_future": (lambda n: (encode(batch(n, round=4)), CONTENT_TYPE), 409, "future_round", "future_round"),
    "farthest_future": (lambda n: (encode(batch(n, round=2**31 - 1)), CONTENT_TYPE), 409, "future_round",
                        "future_round"),
    "foreign_fingerprint": (lambda n: (encode(batch(n, fingerprint=foreign_fingerprint(n))), CONTENT_TYPE), 400,
                            "foreign_fingerprint", "foreign_fingerprint"),
    "wrong_k": (lambda n: (encode(batch(n, k=8)), CONTENT_TYPE), 400, "wrong_k", "wrong_k"),
    "wrong_run": (lambda n: (encode(batch(n, run_id="other")), CONTENT_TYPE), 409, "wrong_run", "wrong_run"),
    "unknown_sender": (lambda n: (encode(batch(n, sender=99)), CONTENT_TYPE), 403, "unknown_sender",
                       "unknown_sender"),
    "sender_is_receiver": (lambda n: (encode(batch(n, sender=n.rank)), CONTENT_TYPE), 403, "unknown_sender",
                           "unknown_sender"),
    "nan_values": (lambda n: (encode(batch(n, fragments=nan_values(n))), CONTENT_TYPE), 400, "non_finite",
                   "non_finite"),
    "short_fragment": (lambda n: (encode(batch(n, fragments={1: np.ones(1, np.float32)})), CONTENT_TYPE), 400,
                       "bad_fragment", "bad_fragment"),
    # one index twice in one message: the message is wrong (400), not a conflict with the node's state (409)
    "index_twice": (lambda n: (index_twice(n), CONTENT_TYPE), 400, "bad_fragment", "bad_fragment"),
    "oversized": (lambda n: (encode(batch(n)) + bytes(5000), CONTENT_TYPE), 413, "too_large", None),
    "json_content_type": (lambda n: (encode(batch(n)), "application/json"), 415, "unsupported_media_type", None),
    "no_content_type": (lambda n: (encode(batch(n)), "application/octet-stream"), 415, "unsupported_media_type",
                        None),
}


def test_a_valid_message_is_what_the_bad_ones_are_made_from(net: Net) -> None:
    from mosaic_proto import decode

    s = net.settings
    fragmentation = Fragmentation.build(Layout.flat(s.dim), s.fragments, s.seed, s.strategy)
    decoded = decode(encode(batch(net)), fragmentation, run_id=s.run_id, max_bytes=s.max_body_bytes)
    assert (decoded.round, decoded.sender, sorted(decoded.fragments)) == (1, net.helper_rank(), [0, 2])
    assert len(encode(batch(net))) < s.max_body_bytes < len(encode(batch(net)) + bytes(5000))


@pytest.mark.parametrize("case", list(BAD_FRAGMENTS))
def test_post_fragments_refuses(net: Net, kit: Any, case: str) -> None:
    make, status, reason, counted = BAD_FRAGMENTS[case]
    body, content_type = make(net)
    before = refused(kit, net, counted) if counted else None
    check_refused(kit, net, "POST", f"{net.node}/v1/fragments", body, content_type, status, reason)
    if counted:
        assert refused(kit, net, counted) == before + 1


# -- the daemon's other endpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "status", "reason"), [
    ("GET", "/v1/model?round=abc", 400, "bad_round"),
    ("GET", "/v1/model?round=1.5", 400, "bad_round"),
    ("GET", "/v1/model?round=", 400, "bad_round"),
    ("GET", "/v1/model?round=--1", 400, "bad_round"),  # was a 500: int() refused what the check let through
    ("GET", "/v1/model?round=%D9%A3", 400, "bad_round"),  # an Arabic-Indic digit: int() takes it, the API does not
    ("GET", "/v1/model?round=99", 404, "no_snapshot"),
    ("GET", "/v1/model?round=-1", 404, "no_snapshot"),
    ("GET", "/v1/nope", 404, "not_found"),
    ("GET", "/", 404, "not_found"),
    ("POST", "/barrier/v1/arrive", 404, "not_found"),  # only rank 0 of a --peer-list run serves the barrier
    ("GET", "/v1/fragments", 405, "method_not_allowed"),
    ("PUT", "/v1/fragments", 405, "method_not_allowed"),
    ("POST", "/v1/status", 405, "method_not_allowed"),
    ("DELETE", "/v1/model", 405, "method_not_allowed"),
    ("POST", "/metrics", 405, "method_not_allowed"),
])
def test_node_endpoints_refuse(net: Net, kit: Any, method: str, path: str, status: int, reason: str) -> None:
    body = b"{}" if method in ("POST", "PUT") else None
    check_refused(kit, net, method, net.node + path, body, "application/json" if body else None, status, reason)


def test_node_status_is_strict_json(net: Net, kit: Any) -> None:
    """No NaN literal (the daemon trains nothing: its losses are NaN), which browsers' JSON parsers refuse."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    status = json.loads(kit.http("GET", f"{net.node}/v1/status").body, parse_constant=refuse)
    assert status["last_round"]["round"] == 0 and status["last_round"]["loss"] is None


def test_node_model_of_a_kept_round_is_served(net: Net, kit: Any) -> None:
    from mosaicd.daemon.http.model_codec import decode_model

    reply = kit.http("GET", f"{net.node}/v1/model?round=0")
    assert reply.status == 200 and reply.content_type == "application/cbor"
    model = decode_model(reply.body)
    assert (model["rank"], model["round"], model["vector"].shape) == (net.rank, 0, (net.settings.dim,))


# -- the barrier ----------------------------------------------------------------------------------------------------

def barrier_cases(h: int, last: int) -> dict[str, tuple[str, bytes | None, str | None, int, str]]:
    """The bad requests, given a helper's rank `h` and the run's round count."""

    def js(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    report = {"round": 1, "loss": 1.0, "bytes_out": 10, "refused": {}}
    return {
        # name: (path, body, content type, HTTP status, reason)
        "register_not_json": ("/v1/register", b"{address: nope", "application/json", 400, "malformed"),
        "register_not_utf8": ("/v1/register", b"\xff\xfe\xfd", "application/json", 400, "malformed"),
        "register_text_plain": ("/v1/register", js({"address": "127.0.0.1:9"}), "text/plain", 415,
                                "unsupported_media_type"),
        "register_list": ("/v1/register", js(["127.0.0.1:9"]), "application/json", 400, "malformed"),
        "register_nested_deep": ("/v1/register", b"[" * 100_000 + b"]" * 100_000, "application/json", 400,
                                 "malformed"),  # was a 500 (RecursionError)
        "register_unknown_charset": ("/v1/register", js({"address": "127.0.0.1:9"}), "application/json; charset=x",
                                     409, "registration_closed"),  # was a 500 (LookupError): JSON is UTF-8
        "register_missing_address": ("/v1/register", js({}), "application/json", 400, "bad_field"),
        "register_address_int": ("/v1/register", js({"address": 9}), "application/json", 400, "bad_field"),
        "register_bad_address": ("/v1/register", js({"address": "no-port"}), "application/json", 400,
                                 "bad_address"),
        "register_address_with_space": ("/v1/register", js({"address": "127.0.0.1:9 127.0.0.1:10"}),
                                        "application/json", 400, "bad_address"),
        "register_port_out_of_range": ("/v1/register", js({"address": "127.0.0.1:70000"}), "application/json", 400,
                                       "bad_address"),
        "register_after_close": ("/v1/register", js({"address": "127.0.0.1:9"}), "application/json", 409,
                                 "registration_closed"),
        "arrive_not_json": ("/v1/arrive", b"rank=1", "application/json", 400, "malformed"),
        "arrive_form": ("/v1/arrive", b"rank=1&round=1", "application/x-www-form-urlencoded", 415,
                        "unsupported_media_type"),
        "arrive_missing_round": ("/v1/arrive", js({"rank": h}), "application/json", 400, "bad_field"),
        "arrive_missing_rank": ("/v1/arrive", js({"round": 1}), "application/json", 400, "bad_field"),
        "arrive_rank_string": ("/v1/arrive", js({"rank": str(h), "round": 1}), "application/json", 400,
                               "bad_field"),
        "arrive_rank_bool": ("/v1/arrive", js({"rank": True, "round": 1}), "application/json", 400, "bad_field"),
        "arrive_rank_negative": ("/v1/arrive", js({"rank": -1, "round": 1}), "application/json", 400, "bad_field"),
        "arrive_round_float": ("/v1/arrive", js({"rank": h, "round": 1.0}), "application/json", 400, "bad_field"),
        "arrive_unknown_rank": ("/v1/arrive", js({"rank": 99, "round": 1}), "application/json", 404,
                                "unknown_rank"),
        "arrive_past_the_run": ("/v1/arrive", js({"rank": h, "round": last + 1}), "application/json", 400,
                                "bad_round"),
        "arrive_future_round": ("/v1/arrive", js({"rank": h, "round": 2, "report": report}), "application/json",
                                409, "future_round"),
        "arrive_report_not_object": ("/v1/arrive", js({"rank": h, "round": 1, "report": [1]}), "application/json",
                                     400, "bad_field"),
        "arrive_report_round_text": ("/v1/arrive", js({"rank": h, "round": 1, "report": {"round": "x"}}),
                                     "application/json", 400, "bad_field"),
        "arrive_report_of_last_round": ("/v1/arrive", js({"rank": h, "round": 1, "report": {**report, "round": 0}}),
                                        "application/json", 400, "bad_field"),
        "arrive_report_loss_text": ("/v1/arrive", js({"rank": h, "round": 1, "report": {**report, "loss": "low"}}),
                                    "application/json", 400, "bad_field"),
        "arrive_report_refused_list": ("/v1/arrive", js({"rank": h, "round": 1, "report": {
            **report, "refused": [1]}}), "application/json", 400, "bad_field"),
        "arrive_report_delivered_text": ("/v1/arrive", js({"rank": h, "round": 1, "report": {
            **report, "delivered": {"0": "all"}}}), "application/json", 400, "bad_field"),
        # these three were taken, and failed the round's release (a 500, and no node was answered)
        "arrive_report_delivered_superscript_rank": ("/v1/arrive", js({"rank": h, "round": 1, "report": {
            **report, "delivered": {"\u00b2": [1, 8]}}}), "application/json", 400, "bad_field"),
        "arrive_report_train_s_huge": ("/v1/arrive", js({"rank": h, "round": 1, "report": {
            **report, "train_s": 10**400}}), "application/json", 400, "bad_field"),
        "arrive_report_refused_huge": ("/v1/arrive", js({"rank": h, "round": 1, "report": {
            **report, "refused": {"malformed": 2**64}}}), "application/json", 400, "bad_field"),
        "arrive_layout_null": ("/v1/arrive", js({"rank": h, "round": 1, "report": report, "layout": None}),
                               "application/json", 400, "bad_field"),
        "arrive_layout_list": ("/v1/arrive", js({"rank": h, "round": 1, "report": report, "layout": [8, "ab"]}),
                               "application/json", 400, "bad_field"),
        "arrive_layout_fingerprint_not_hex": ("/v1/arrive", js({"rank": h, "round": 1, "report": report, "layout": {
            "values": 8, "fingerprint": "zz"}}), "application/json", 400, "bad_field"),
        "arrive_layout_values_negative": ("/v1/arrive", js({"rank": h, "round": 1, "report": report, "layout": {
            "values": -1, "fingerprint": "ab"}}), "application/json", 400, "bad_field"),
        "run_gone": ("/v1/run", js({}), "application/json", 404, "not_found"),
        "register_get": ("/v1/register", None, None, 405, "method_not_allowed"),
        "unknown_path": ("/v1/fragments", js({}), "application/json", 404, "not_found"),
    }


BARRIER_NAMES = list(barrier_cases(0, RUN["rounds"]))


@pytest.mark.parametrize("case", BARRIER_NAMES)
def test_barrier_endpoints_refuse(net: Net, kit: Any, case: str) -> None:
    path, body, content_type, status, reason = barrier_cases(net.helper_rank(), net.settings.rounds)[case]
    method = "GET" if case.endswith("_get") else "POST"
    check_refused(kit, net, method, net.barrier + path, body, content_type, status, reason)


def test_barrier_arrival_at_a_released_round_gets_that_release_and_records_nothing(net: Net, kit: Any) -> None:
    """A retried arrival (its answer was lost) at a round already released: the release again, recorded once (it
    was recorded a second time: nodes.csv rows, history)."""
    before = snapshot(kit, net)
    body = json.dumps({"rank": net.helper_rank(), "round": 0, "report": {"round": 0, "loss": 1.0}}).encode()
    reply = kit.http("POST", f"{net.barrier}/v1/arrive", body, "application/json")
    assert reply.status == 200, reply.body[:500]
    assert reply.json() == {"round": 0, "members": [0, 1, 2, 3], "stragglers": [], "dropped": [], "finished": False,
                            "joined": [], "left": [], "addresses": {}}
    assert snapshot(kit, net) == before


# -- and the run goes on --------------------------------------------------------------------------------------------

def test_valid_rounds_after_the_bad_input_give_the_reference(net: Net, kit: Any) -> None:
    """Last in this module: plays rounds 1..T-1 and finishes; every model is the in-memory reference's. It sends
    each counted bad message once more itself, so that it holds alone too (xdist may run it apart from the others)."""
    assert _status(kit, net.node) == (1, "waiting")
    def refusals() -> float:
        return sum(v for k, v in metrics(kit, net.node).items() if k.startswith("mosaic_refused_messages_total"))

    for make, status, _, counted in BAD_FRAGMENTS.values():
        if counted:
            body, content_type = make(net)
            assert kit.http("POST", f"{net.node}/v1/fragments", body, content_type).status == status
    refused_by_daemon = refusals()
    net.call(asyncio.wait_for(_play(net, 1), 30), timeout=40)
    kit.wait_until(lambda: _status(kit, net.node) == (2, "waiting"), 30, "the daemon at round 2's barrier")
    assert refusals() == refused_by_daemon  # counted once, as they came (not again when round 1 closed)
    net.call(asyncio.wait_for(_play(net, net.settings.rounds - 2), 60), timeout=70)
    net.call(asyncio.wait_for(_finish(net), 60), timeout=70)
    for name, proc in net.procs.items():
        assert proc.wait(timeout=30) == 0, (name, net.logs())
    reference = kit.reference_vectors(net.settings)
    for rank, vector in net.vectors.items():
        assert kit.sha256_f32(vector) == kit.sha256_f32(reference[rank])
    summary = json.loads((net.tmp / "barrier" / "summary.json").read_text())
    assert summary["model_sha256"] == {str(r): kit.sha256_f32(v) for r, v in enumerate(reference)}
    assert summary["dropped"] == [] and summary["members"] == [0, 1, 2, 3]
    # the refusals came while the daemon waited at round 1's barrier, after it sent round 1's report: they are
    # counted in the next report it sends, round 2's (nodes.csv "refused")
    rows = (net.tmp / "barrier" / "nodes.csv").read_text().splitlines()
    header = rows[0].split(",")
    mine = [dict(zip(header, r.split(","), strict=True)) for r in rows[1:]]
    mine = {int(r["round"]): int(r["refused"]) for r in mine if int(r["node"]) == net.rank}
    assert sorted(mine) == [0, 1, 2, 3]
    assert mine[0] == 0 and mine[1] == 0 and mine[2] > 0
    wire_refusals = sum(1 for make, _, _, counted in BAD_FRAGMENTS.values() if counted)
    assert mine[2] >= wire_refusals and refused_by_daemon >= wire_refusals


@pytest.mark.parametrize("d", [1, 23, 24, 256, 65536, 70_000])
@pytest.mark.parametrize("metrics", [None, {"values": {"accuracy": 0.5}, "metric": "accuracy",
                                            "higher_is_better": True, "source": "task"}])
def test_a_model_body_is_cbor2s_map_with_its_values_copied_once(d: int, metrics: dict | None) -> None:
    """GET /v1/model's body, written around the vector's own buffer, is byte for byte what cbor2 writes of the
    documented map, and reads back."""
    import cbor2

    from mosaic_proto.wire import TAG_FLOAT32_LE
    from mosaicd.daemon.http.model_codec import decode_model, encode_model

    layout = Layout.flat(d)
    vector = np.random.default_rng(d).standard_normal(d).astype(np.float32)
    for rank, round in ((0, 0), (3, 24), (300, 70_000)):
        mapped = {"rank": rank, "round": round, "layout": layout.to_json(),
                  "vector": cbor2.CBORTag(TAG_FLOAT32_LE, vector.tobytes()),
                  **({"metrics": metrics} if metrics is not None else {})}
        body = encode_model(rank, round, layout, vector, metrics)
        assert body == cbor2.dumps(mapped)
        model = decode_model(body)
        assert (model["rank"], model["round"]) == (rank, round) and np.array_equal(model["vector"], vector)
