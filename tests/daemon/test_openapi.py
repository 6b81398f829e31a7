"""The OpenAPI documents of the node and barrier APIs: they name exactly the apps' routes, the running daemons serve
them at GET /openapi.json, and schemathesis, fuzzing a live node and a live barrier on loopback from them, finds no
server error and no answer that breaks them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

import mosaicd.daemon
from mosaic_proto import Layout, Reason
from mosaic_proto.async_node import SyncMode
from mosaicd import Peer, Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.node.async_member import AsyncNode
from mosaicd.daemon.node.async_routes import async_app
from mosaicd.daemon.node.inbox import STATUS_OF_REASON
from mosaicd.daemon.node.routes import node_app, node_document
from mosaicd.learning.tasks import build_task

DAEMON = Path(mosaicd.daemon.__file__).parent
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def document(name: str) -> dict[str, Any]:
    """The document as the daemon `name` serves it ("async": an asynchronous node's, the node's without the paths
    of barrier nodes)."""
    if name in ("node", "async"):
        return json.loads(node_document(SyncMode.ASYNC if name == "async" else SyncMode.BARRIER))
    return json.loads((DAEMON / name / "openapi.json").read_text())


def documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item if method in METHODS}


def served(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route; aiohttp's HEAD twin of each GET route is left out (it answers as GET)."""
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    heads = {path for method, path in routes if method == "HEAD"}
    assert heads <= {path for method, path in routes if method == "GET"}, "a HEAD route without its GET"
    return {(method, path) for method, path in routes if method != "HEAD"}


def apps(tmp_path: Path) -> dict[str, web.Application]:
    settings = Settings(nodes=2, rounds=1, fanout=1, out=tmp_path / "barrier", barrier_url="http://127.0.0.1:9",
                        insecure=True)
    barrier = Barrier(settings.run_config(), settings.daemon_options(), secret=Secret(None))
    run = Settings.load(sync="async", task="quadratic", nodes=2, rounds=1, fanout=1, dim=4, insecure=True,
                        out=tmp_path / "async")
    node = AsyncNode(run, build_task(run.run_config()), 0, ["127.0.0.1:9", "127.0.0.1:10"], Secret(None))
    return {"node": node_app(Peer(settings.daemon_options(), Layout.flat(4)).inbox), "barrier": barrier_app(barrier),
            "async": async_app(node)}


@pytest.mark.parametrize("name", ["node", "barrier", "async"])
def test_documents_name_exactly_the_routes(tmp_path: Path, name: str) -> None:
    doc = document(name)
    assert doc["openapi"].startswith("3.") and doc["info"]["title"]
    assert served(apps(tmp_path)[name]) == documented(doc)


@pytest.mark.parametrize("name", ["node", "barrier", "async"])
def test_every_error_is_the_json_error_object(name: str) -> None:
    doc = document(name)
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["reason", "detail"] and set(error["properties"]) == {"reason", "detail"}
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) < 400:
                    continue
                schema = response["content"]["application/json"]["schema"]
                assert schema["allOf"][0] == {"$ref": "#/components/schemas/Error"}, (path, method, status)
                assert schema["allOf"][1]["properties"]["reason"]["enum"], (path, method, status)


# -- the live daemons -------------------------------------------------------------------------------------------

RUN = dict(run_id="openapi", fragments=2, dim=8, seed=2, train=False, eval_every=1, host="127.0.0.1", port=0,
           register_deadline=30, request_timeout=5, max_body_bytes=64 * 1024, insecure=True)  # unsigned requests


class Live:
    """A barrier app on loopback and `nodes` Peers registered with it."""

    def __init__(self, tmp: Path, secret: Secret | None = None, **run: Any) -> None:
        """`secret`: the cluster secret its members and barrier share (signed requests); none: --insecure."""
        self.settings = Settings(**{**RUN, **run, "insecure": secret is None}, out=tmp)
        self.secret = secret if secret is not None else Secret(None)
        self.barrier = Barrier(self.settings.run_config(), self.settings.daemon_options(), secret=self.secret)
        self.peers: list[Peer] = []
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Live:
        # a long poll that a test leaves open must not hold the cleanup for aiohttp's default minute
        self.runner = web.AppRunner(barrier_app(self.barrier), access_log=None, shutdown_timeout=1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.barrier_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        settings = self.settings.model_copy(update={"barrier_url": self.barrier_url})
        self.peers = [Peer(settings, Layout.flat(settings.dim), secret=self.secret) for _ in range(settings.nodes)]
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in self.peers)), 30)
        self.vectors = {p.rank: np.full(settings.dim, p.rank, np.float32) for p in self.peers}
        return self

    async def play(self, peers: list[Peer] | None = None) -> None:
        """One round of `peers` (all by default)."""
        peers = self.peers if peers is None else peers
        results = await asyncio.wait_for(asyncio.gather(*(p.gossip(self.vectors[p.rank]) for p in peers)), 30)
        self.vectors.update({p.rank: v for p, v in zip(peers, results, strict=True)})

    def node_url(self, i: int = 0) -> str:
        return f"http://{self.peers[i].address}"

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(p.close() for p in self.peers))
        await self.runner.cleanup()


async def test_running_daemons_serve_their_documents(tmp_path: Path) -> None:
    async with Live(tmp_path, nodes=2, rounds=1, fanout=1) as live, aiohttp.ClientSession() as session:
        for name, base in (("node", live.node_url()), ("barrier", live.barrier_url)):
            async with session.get(f"{base}/openapi.json") as resp:
                assert resp.status == 200 and resp.content_type == "application/json"
                assert await resp.json() == document(name)
            async with session.request("TRACE", f"{base}/v1/status") as resp:  # a 405 names what the path takes
                assert resp.status == 405 and (await resp.json())["reason"] == "method_not_allowed"
                assert set(resp.headers["Allow"].split(",")) >= {"GET"}


SECRET = b"openapi-test-secret-of-32-bytes!"


async def test_with_a_secret_the_router_answers_first_and_open_views_take_head(tmp_path: Path) -> None:
    """A path or method the API does not have is 404 or 405 as the documents say, with a secret too (it was 401:
    the signature's check ran first); HEAD reads what GET reads openly; the rest still needs a tag (401)."""
    async with Live(tmp_path, Secret(SECRET), nodes=2, rounds=1, fanout=1) as live, \
            aiohttp.ClientSession() as session:
        for base in (live.node_url(), live.barrier_url):
            for method, path, status, reason in (("GET", "/no/such/path", 404, "not_found"),
                                                 ("TRACE", "/v1/status", 405, "method_not_allowed"),
                                                 ("DELETE", "/healthz", 405, "method_not_allowed"),
                                                 ("PUT", "/metrics", 405, "method_not_allowed")):
                async with session.request(method, f"{base}{path}") as resp:
                    assert (resp.status, (await resp.json())["reason"]) == (status, reason), (base, method, path)
            for path in ("/healthz", "/metrics", "/v1/status", "/openapi.json"):
                async with session.head(f"{base}{path}") as resp:
                    assert resp.status == 200, (base, path)
        async with session.get(f"{live.node_url()}/v1/model") as resp:
            assert (resp.status, (await resp.json())["reason"]) == (401, "unsigned")
        async with session.post(f"{live.barrier_url}/v1/arrive", json={"rank": 0, "round": 0}) as resp:
            assert (resp.status, (await resp.json())["reason"]) == (401, "unsigned")


def test_documents_say_what_the_handlers_take() -> None:
    """The metrics' media type as served, `since` bounded as the handler reads it and naming its constant, an
    address that is not empty, the signature's scheme in both documents."""
    from prometheus_client import CONTENT_TYPE_LATEST

    from mosaicd.daemon.barrier.release_log import HISTORY_KEPT

    for name in ("node", "barrier"):
        doc = document(name)
        assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [CONTENT_TYPE_LATEST]
        assert doc["components"]["securitySchemes"]["mosaicSignature"]["name"] == "Authorization"
        assert doc["security"] == [{}, {"mosaicSignature": []}]
    barrier = document("barrier")
    since = barrier["paths"]["/v1/history"]["get"]["parameters"][0]
    assert since["schema"]["maximum"] == 10**12 - 1 and f"HISTORY_KEPT, {HISTORY_KEPT}" in since["description"]
    register = barrier["paths"]["/v1/register"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert register["properties"]["address"]["minLength"] == 1
    fragments = document("node")["paths"]["/v1/fragments"]["post"]["responses"]
    for status in ("400", "403", "409"):
        enum = fragments[status]["content"]["application/json"]["schema"]["allOf"][1]["properties"]["reason"]["enum"]
        for reason in enum:  # the description names every reason of its status
            assert reason in fragments[status]["description"], (status, reason)
    assert {r.value for r in Reason if STATUS_OF_REASON.get(r, 400) == 400} == set(
        fragments["400"]["content"]["application/json"]["schema"]["allOf"][1]["properties"]["reason"]["enum"])


@pytest.fixture(params=["insecure", "signed"])
async def targets(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[dict[str, str], bytes]]:
    """A node in the middle of a run (waiting at round 1's barrier, its peer never comes) and a barrier whose
    run is over: nothing that the fuzzer sends can start a long poll (registration is closed, every arrival is at
    a released or a wrong round), and the node parses what it is sent; and an asynchronous node that serves and
    trains nothing (`cluster --sync async`'s: its document has /v1/pair and no /v1/model). `signed`: all with the
    cluster secret SECRET (the fuzzer's requests are signed by HOOKS), else --insecure. Their URLs, and the secret
    (b"": none)."""
    secret = Secret(SECRET) if request.param == "signed" else None
    async with Live(tmp_path / "mid", secret, nodes=3, rounds=4, fanout=1, round_deadline=600) as mid, \
            Live(tmp_path / "over", secret, nodes=2, rounds=2, fanout=1) as over:
        await mid.play()
        waiting = [p for p in mid.peers if p.rank != 2]
        mid.tasks += [asyncio.ensure_future(p.gossip(mid.vectors[p.rank])) for p in waiting]
        for _ in range(over.settings.rounds):
            await over.play()
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in over.peers)), 30)
        await asyncio.wait_for(over.barrier.done.wait(), 10)
        node = next(p for p in mid.peers if p.rank == 0)
        for _ in range(100):
            if node.phase == "waiting":
                break
            await asyncio.sleep(0.05)
        assert node.phase == "waiting" and node.round == 1
        # an asynchronous node serving (it trains nothing: the fuzzer's requests are all it hears)
        run = Settings.load(sync="async", task="quadratic", run_id=RUN["run_id"], nodes=2, rounds=3, fanout=1,
                            fragments=2, dim=8, insecure=secret is None, out=tmp_path / "async")
        lone = AsyncNode(run, build_task(run.run_config()), 0, ["127.0.0.1:1", "127.0.0.1:2"],
                         secret if secret is not None else Secret(None))
        runner = web.AppRunner(async_app(lone), access_log=None, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield ({"node": f"http://{node.address}", "barrier": over.barrier_url,
                    "async": f"http://127.0.0.1:{runner.addresses[0][1]}"}, SECRET if secret is not None else b"")
        finally:
            await runner.cleanup()
        assert not any(t.done() for t in mid.tasks), "the fuzzer moved the run on"


# positive_data_acceptance cannot apply: a schema-valid fragment body is any bytes (not a CBOR message of this
# run), and on a finished run every registration and arrival is refused; use_after_free and
# ensure_resource_availability need links between operations (there are none); there is no authentication
CHECKS_NOT_APPLICABLE = ("positive_data_acceptance,use_after_free,ensure_resource_availability,ignored_auth,"
                         "object_level_authorization,missing_required_header")


# loaded by the schemathesis process (SCHEMATHESIS_HOOKS): a fragment body is bytes on the wire, as octet-stream's;
# with MOSAIC_SCHEMATHESIS_SECRET, every request is signed as a member signs it (daemon/http/auth.py's `signer`):
# as rank 0 with the run's key, a registration with the registration key, over the body as it is sent
HOOKS = """
import os
import time
from urllib.parse import urlsplit

import requests
import schemathesis

from mosaic_proto.auth import Credentials, run_key

schemathesis.serializer.alias("application/cbor", "application/octet-stream")
SECRET = os.environ.get("MOSAIC_SCHEMATHESIS_SECRET", "").encode()
RUN = os.environ.get("MOSAIC_SCHEMATHESIS_RUN", "")


class Signed(requests.auth.AuthBase):
    def __call__(self, request):
        path = urlsplit(request.url).path or "/"
        run = "register" if path.endswith("/v1/register") else RUN
        body = request.body or b""
        body = body.encode() if isinstance(body, str) else bytes(body)
        request.headers.update(Credentials(run_key(SECRET, run), run).headers(
            request.method, path, "0", 0, body, time.time(), os.urandom(12).hex()))
        return request


if SECRET:
    @schemathesis.hook
    def before_call(context, case, kwargs):
        kwargs["auth"] = Signed()
"""


async def refused_by_auth(base: str) -> float:
    """How many requests a daemon refused for want of a valid tag (its mosaic_auth_refused_total, all reasons)."""
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("mosaic_auth_refused_total"))


@pytest.mark.slow  # ~15 s a case on 2 idle cores: three schemathesis processes, 50 examples per operation at most
async def test_schemathesis_finds_no_server_error_and_no_answer_off_the_schema(
        targets: tuple[dict[str, str], bytes], tmp_path: Path) -> None:
    """Signed (every request signed by the hook, as a member signs it: none is refused for its tag, so the checks
    reach the handlers) and --insecure."""
    urls, secret = targets
    (tmp_path / "mosaic_schemathesis_hooks.py").write_text(HOOKS)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "mosaic_schemathesis_hooks", "MOSAIC_SCHEMATHESIS_RUN": RUN["run_id"],
           "MOSAIC_SCHEMATHESIS_SECRET": secret.decode(),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    failures = []
    for name, base in urls.items():
        command = [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json", "--checks", "all",
                   "--exclude-checks", CHECKS_NOT_APPLICABLE, "--phases", "examples,coverage,fuzzing",
                   "--max-examples", "50", "--workers", "1", "--request-timeout", "5", "--seed", "1",
                   "--generation-database", "none", "--suppress-health-check", "all", "--no-color"]
        proc = await asyncio.create_subprocess_exec(*command, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 240)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        print(f"== {name}\n{out.decode(errors='replace')[-3000:]}")
        if proc.returncode != 0:
            failures.append(f"== {name}\n{out.decode(errors='replace')[-12000:]}")
    assert not failures, "\n".join(failures)
    if secret:
        assert [await refused_by_auth(base) for base in urls.values()] == [0] * len(urls)
