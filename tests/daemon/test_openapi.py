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
from mosaic_proto import Layout
from mosaicd import Peer, Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.node.routes import node_app

DAEMON = Path(mosaicd.daemon.__file__).parent
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def document(name: str) -> dict[str, Any]:
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
    return {"node": node_app(Peer(settings.daemon_options(), Layout.flat(4)).inbox), "barrier": barrier_app(barrier)}


@pytest.mark.parametrize("name", ["node", "barrier"])
def test_documents_name_exactly_the_routes(tmp_path: Path, name: str) -> None:
    doc = document(name)
    assert doc["openapi"].startswith("3.") and doc["info"]["title"]
    assert served(apps(tmp_path)[name]) == documented(doc)


@pytest.mark.parametrize("name", ["node", "barrier"])
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

    def __init__(self, tmp: Path, **run: Any) -> None:
        self.settings = Settings(**{**RUN, **run}, out=tmp)
        self.secret = Secret.of(self.settings) if self.settings.secret_file or self.settings.insecure else Secret.new()
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


@pytest.fixture
async def targets(tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """A node in the middle of a run (waiting at round 1's barrier, its peer never comes) and a barrier whose
    run is over: nothing that the fuzzer sends can start a long poll (registration is closed, every arrival is at
    a released or a wrong round), and the node parses what it is sent."""
    async with Live(tmp_path / "mid", nodes=3, rounds=4, fanout=1, round_deadline=600) as mid, \
            Live(tmp_path / "over", nodes=2, rounds=2, fanout=1) as over:
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
        yield {"node": f"http://{node.address}", "barrier": over.barrier_url}
        assert not any(t.done() for t in mid.tasks), "the fuzzer moved the run on"


# positive_data_acceptance cannot apply: a schema-valid fragment body is any bytes (not a CBOR message of this
# run), and on a finished run every registration and arrival is refused; use_after_free and
# ensure_resource_availability need links between operations (there are none); there is no authentication
CHECKS_NOT_APPLICABLE = ("positive_data_acceptance,use_after_free,ensure_resource_availability,ignored_auth,"
                         "object_level_authorization,missing_required_header")


# loaded by the schemathesis process (SCHEMATHESIS_HOOKS): a fragment body is bytes on the wire, as octet-stream's
HOOKS = """
import schemathesis

schemathesis.serializer.alias("application/cbor", "application/octet-stream")
"""


@pytest.mark.slow  # about 10 s on 2 idle cores: two schemathesis processes, 50 examples per operation at most
async def test_schemathesis_finds_no_server_error_and_no_answer_off_the_schema(targets: dict[str, str],
                                                                               tmp_path: Path) -> None:
    (tmp_path / "mosaic_schemathesis_hooks.py").write_text(HOOKS)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "mosaic_schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    failures = []
    for name, base in targets.items():
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
