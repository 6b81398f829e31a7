"""With a cluster secret, on a real loopback cluster: an outsider's unsigned, forged, replayed, wrong-run and
non-member requests are refused (401/403, counted by reason) and change nothing; the run's models still equal
`mosaicd simulate`'s. Without a secret, nothing listens beyond loopback unless --insecure."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaic_proto import Fragmentation, FragmentBatch, Layout, encode
from mosaic_proto.auth import Credentials, run_key
from mosaicd import Settings
from mosaicd.daemon.http.auth import REGISTER_RUN
from mosaicd.experiments.cluster import Cluster

SECRET = b"a-cluster-secret-of-enough-bytes-0123456789"


def signed(key_secret: bytes, run: str, method: str, url: str, sender: str, round: int, body: bytes = b"",
           at: float | None = None) -> dict[str, str]:
    path = url.split("://", 1)[1].split("/", 1)[1].split("?", 1)[0]
    return Credentials(run_key(key_secret, run), run).headers(method, "/" + path, sender, round, body,
                                                              time.time() if at is None else at, os.urandom(8).hex())


def metric_total(kit: Any, url: str, prefix: str) -> dict[str, float]:
    out = {}
    for line in kit.http("GET", f"{url}/metrics").body.decode().splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def call(kit: Any, method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         content_type: str | None = None) -> Any:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    if content_type:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null") if "json" in resp.headers.get(
                "Content-Type", "") else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_outsiders_are_refused_and_the_run_equals_simulate(tmp_path: Path, kit: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    run = dict(nodes=5, rounds=300, fragments=4, fanout=2, dim=64, seed=7, eval_every=50)
    # 0.02 s a round at least (kit.pace; the models are the same), 6 s in all: the requests below reach
    # members still running, on a fast host too
    settings = Settings(**run, secret_file=secret, node_profile=kit.pace(tmp_path, 0.02), out=tmp_path / "run")
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=180)
    answers: dict[str, tuple[int, Any]] = {}
    try:
        kit.wait_until(lambda: cluster.barrier_port and cluster.node_ports, 30, "the cluster's ports")
        barrier = f"http://127.0.0.1:{cluster.barrier_port}"
        node = f"http://127.0.0.1:{cluster.node_ports[0]}"
        def at_round_2() -> bool:
            try:
                return call(kit, "GET", f"{barrier}/v1/status")[1]["round"] >= 2
            except OSError:  # not listening yet
                return False

        kit.wait_until(at_round_2, 60, "round 2")
        status = call(kit, "GET", f"{node}/v1/status")[1]
        t = status["round"] + 1  # a round that has not happened yet: a forged message would be buffered
        layout = Layout.flat(run["dim"])
        fragmentation = Fragmentation.build(layout, run["fragments"], run["seed"], "random")
        values = np.full(fragmentation.sizes[0], 3e38, dtype=np.float32)
        batch = FragmentBatch("mosaic", t, 1, run["fragments"], fragmentation.fingerprint, {0: values})
        poison = encode(batch)
        frag_url = f"{node}/v1/fragments"
        cbor = "application/cbor"
        answers["unsigned"] = call(kit, "POST", frag_url, poison, content_type=cbor)
        answers["bad_tag"] = call(kit, "POST", frag_url, poison, signed(b"not-the-secret-but-long-enough", "mosaic",
                                                                         "POST", frag_url, "1", t, poison), cbor)
        answers["wrong_run"] = call(kit, "POST", frag_url, poison, signed(SECRET, "other-run", "POST", frag_url, "1",
                                                                           t, poison), cbor)
        answers["stale_tag"] = call(kit, "POST", frag_url, poison, signed(SECRET, "mosaic", "POST", frag_url, "1", t,
                                                                           poison, at=time.time() - 3600), cbor)
        answers["bad_body"] = call(kit, "POST", frag_url, poison, signed(SECRET, "mosaic", "POST", frag_url, "1", t,
                                                                          b"another body"), cbor)
        # a member's key, speaking for another member: the message says sender 1, the signature says 2
        answers["sender_mismatch"] = call(kit, "POST", frag_url, poison,
                                          signed(SECRET, "mosaic", "POST", frag_url, "2", t, poison), cbor)
        model_url = f"{node}/v1/model"  # the latest model
        once = signed(SECRET, "mosaic", "GET", model_url, "barrier", 0)
        answers["model_signed"] = call(kit, "GET", model_url, headers=once)
        answers["replayed"] = call(kit, "GET", model_url, headers=once)
        answers["model_unsigned"] = call(kit, "GET", model_url)
        register = json.dumps({"address": "127.0.0.1:9"}).encode()
        answers["register_unsigned"] = call(kit, "POST", f"{barrier}/v1/register", register,
                                            content_type="application/json")
        answers["register_seat"] = call(kit, "POST", f"{barrier}/v1/register", register, signed(
            SECRET, REGISTER_RUN, "POST", f"{barrier}/v1/register", "127.0.0.1:9", 0, register), "application/json")
        arrive = json.dumps({"rank": 1, "round": 0, "report": None}).encode()
        answers["arrive_unsigned"] = call(kit, "POST", f"{barrier}/v1/arrive", arrive, content_type="application/json")
        answers["arrive_for_another"] = call(kit, "POST", f"{barrier}/v1/arrive", arrive, signed(
            SECRET, "mosaic", "POST", f"{barrier}/v1/arrive", "2", 0, arrive), "application/json")
        node_refusals = metric_total(kit, node, "mosaic_auth_refused_total")
        barrier_refusals = metric_total(kit, barrier, "mosaic_auth_refused_total")
        node_status = call(kit, "GET", f"{node}/v1/status")[1]
    finally:
        thread.join(timeout=200)
    assert "summary" in result, result
    expected = {"unsigned": 401, "bad_tag": 401, "wrong_run": 401, "stale_tag": 401, "bad_body": 401,
                "sender_mismatch": 403, "replayed": 401, "model_unsigned": 401, "register_unsigned": 401,
                "register_seat": 409, "arrive_unsigned": 401, "arrive_for_another": 403}
    for case, status_code in expected.items():
        assert answers[case][0] == status_code, (case, answers[case])
    for case in ("unsigned", "bad_tag", "wrong_run", "stale_tag", "bad_body", "replayed", "sender_mismatch"):
        assert answers[case][1]["reason"] == case, (case, answers[case])
    assert answers["model_signed"][0] == 200 and answers["register_seat"][1]["reason"] == "registration_closed"
    for reason in ("unsigned", "bad_tag", "wrong_run", "stale_tag", "bad_body", "replayed"):
        assert node_refusals.get(f'mosaic_auth_refused_total{{reason="{reason}"}}', 0) >= 1, (reason, node_refusals)
    assert barrier_refusals.get('mosaic_auth_refused_total{reason="unsigned"}', 0) >= 2, barrier_refusals
    assert "secret" not in json.dumps(node_status).lower() or SECRET.decode() not in json.dumps(node_status)
    summary = result["summary"]
    reference = kit.reference_hashes(Settings(**run))
    assert summary["model_sha256"] == reference  # nothing the outsider sent reached a model
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_bytes(), path  # never in logs or outputs


def test_no_secret_no_listening_beyond_loopback(kit: Any, tmp_path: Path) -> None:
    """A node without a secret is refused beyond loopback and on loopback alike (a barrier makes its own: below)."""
    for host, said in (("0.0.0.0", "listening beyond loopback needs --secret-file"),
                       ("127.0.0.1", "needs --secret-file")):
        proc = subprocess.run([*kit.mosaicd, "node", "--barrier-url", "http://127.0.0.1:9", "--host", host,
                               "--port", "0"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert proc.returncode == 1, proc.stderr
        line, = [line for line in proc.stderr.splitlines() if "error" in line]
        assert f"--host {host}: " in line and said in line and "--insecure" in line, proc.stderr
    short = tmp_path / "short"
    short.write_text("tiny")
    proc = subprocess.run([*kit.mosaicd, "barrier", "--secret-file", str(short), "--port", "0"],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and "at least 16 bytes" in proc.stderr and "tiny" not in proc.stderr


def test_a_barrier_started_by_hand_without_a_secret_makes_one_and_refuses_unsigned_requests_at_once(
        kit: Any, tmp_path: Path) -> None:
    """Loopback is not private on a shared machine: `mosaicd barrier` with no secret flag makes OUT.secret (600, beside
    --out, never printed), says how to hand it to nodes, refuses an unsigned registration at once (401, not held
    open), and a barrier started again with the same --out keeps the same secret."""
    import socket

    def up(url: str) -> bool:
        try:
            return kit.http("GET", url, timeout=2).status == 200
        except OSError:
            return False

    out = tmp_path / "run"
    secret_path = tmp_path / "run.secret"
    said = []
    for start in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([*kit.mosaicd, "barrier", "--task", "quadratic", "--nodes", "3", "--fanout",
                                 "1", "--port", str(port), "--out", str(out), "--register-deadline", "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        try:
            health = f"http://127.0.0.1:{port}/healthz"
            kit.wait_until(lambda: up(health), 30, "the barrier")  # noqa: B023 (called at once)
            sent = time.monotonic()
            resp = kit.http("POST", f"http://127.0.0.1:{port}/v1/register", b"{}", "application/json")
            assert (resp.status, resp.json()["reason"]) == (401, "unsigned")
            assert time.monotonic() - sent < 10  # at once (a loaded host's), not held until --register-deadline 60
            if start == 0:
                secret = secret_path.read_bytes()
            assert secret_path.stat().st_mode & 0o777 == 0o600 and secret_path.read_bytes() == secret
        finally:
            proc.terminate()
            stderr = proc.communicate(timeout=30)[1]
        said.append(stderr)
        assert f"--secret-file {secret_path}" in stderr and secret.strip().decode() not in stderr, stderr
    assert "made now" in said[0] and "kept from an earlier start" in said[1]
    for path in out.rglob("*"):
        assert not path.is_file() or secret.strip() not in path.read_bytes(), path


async def test_a_peer_signs_with_the_secret_it_is_handed_or_is_refused(tmp_path: Path) -> None:
    """`mosaicd.Peer` with no --secret-file: refused (unless --insecure), even beside a `mosaicd.Barrier` of the same
    program; with that barrier's `secret` handed to it, it signs with it. No registry passes secrets around."""
    from mosaicd import Barrier, Peer
    from mosaicd.daemon.http import auth

    options = Settings(barrier_url="http://127.0.0.1:9", port=0).daemon_options()
    with pytest.raises(auth.SecretError, match="needs --secret-file.*secret=barrier.secret.*--insecure"):
        async with Peer(options, Layout.flat(4)):
            pass
    barrier = Barrier(Settings(nodes=2, rounds=1, fanout=1, out=tmp_path / "run"))
    assert barrier.secret.value and len(barrier.secret.value) >= 32 and "..." in repr(barrier.secret)
    assert Peer(options, Layout.flat(4), secret=barrier.secret).inbox.keyring.secret == barrier.secret.value
    assert Peer(options.model_copy(update={"insecure": True}), Layout.flat(4)).inbox.keyring is None
    assert not hasattr(auth, "_PROCESS_SECRETS")


async def test_an_unsigned_request_to_a_node_that_does_not_know_its_run_yet_is_refused_at_once() -> None:
    """A registering node cannot tell which run's key applies, and holds signed requests until it can; an unsigned
    one needs no key to be refused: 401 at once, not 503 after --request-timeout."""
    import asyncio

    import aiohttp

    from mosaic_proto import CONTENT_TYPE, NodeState
    from mosaicd.daemon.http.auth import Keyring
    from mosaicd.daemon.http.server import serve
    from mosaicd.daemon.node.inbox import Inbox
    from mosaicd.daemon.node.routes import node_app
    from mosaicd.settings import DaemonOptions

    options = DaemonOptions(host="127.0.0.1", port=0, request_timeout=30)
    runner, port = await serve(node_app(Inbox(NodeState(), options, Keyring(SECRET))), options)
    try:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            for method, path in (("POST", "/v1/fragments"), ("GET", "/v1/model")):
                sent = loop.time()
                async with session.request(method, f"http://127.0.0.1:{port}{path}", data=b"x" * 64,
                                           headers={"Content-Type": CONTENT_TYPE}) as resp:
                    assert (resp.status, (await resp.json())["reason"]) == (401, "unsigned"), path
                assert loop.time() - sent < 10, path  # at once (a loaded host's), not at --request-timeout 30
    finally:
        await runner.cleanup()
