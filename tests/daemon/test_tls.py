"""TLS between members (--tls-cert/--tls-key/--tls-ca, mutual with --tls-client-auth), with certificates made at
test time by trustme: a mutual-TLS cluster with a cluster secret still gives the in-memory reference's models;
a --tls-client-auth server refuses clients without a certificate from its CA and plain HTTP; peer lists may name
https:// addresses; settings errors name the flags."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trustme
from aiohttp import web

from mosaicd import Settings
from mosaicd.daemon.http.client import Client, HttpError
from mosaicd.daemon.http.membership import MembershipError, embedded_barrier_url, read_peer_list
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.http.tls import TlsError, client_context, scheme, server_context
from mosaicd.settings import DaemonOptions, SettingsError
from mosaicd.status import StatusError, cluster_view

RUN = dict(nodes=5, rounds=30, fragments=4, fanout=2, dim=64, seed=11, eval_every=10)


@dataclass
class Pem:
    cert: Path
    key: Path


@dataclass
class Certs:
    authority: trustme.CA
    ca: Path          # the cluster's CA certificate (--tls-ca)
    member: Pem       # signed by it, for 127.0.0.1 and localhost
    stranger: Pem     # signed by another CA, for 127.0.0.1
    localhost: Pem    # signed by the cluster's CA, for the name localhost only

    def member_flags(self, pem: Pem | None = None) -> list[str]:
        pem = pem or self.member
        return ["--tls-cert", str(pem.cert), "--tls-key", str(pem.key), "--tls-ca", str(self.ca)]

    def ca_only(self) -> Any:
        """A client that verifies servers against the CA and shows no certificate of its own."""
        return SimpleNamespace(tls_cert=None, tls_key=None, tls_ca=self.ca)


def write(cert: trustme.LeafCert, folder: Path, name: str) -> Pem:
    pem = Pem(folder / f"{name}.crt", folder / f"{name}.key")
    cert.private_key_pem.write_to_path(str(pem.key))
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(pem.cert), append=i > 0)
    return pem


def issue(ca: trustme.CA, folder: Path, name: str, *identities: str) -> Pem:
    return write(ca.issue_cert(*identities), folder, name)


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    folder = tmp_path / "tls"
    folder.mkdir()
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))
    return Certs(ca, folder / "ca.crt", issue(ca, folder, "member", "127.0.0.1", "localhost"),
                 issue(other, folder, "stranger", "127.0.0.1", "localhost"),
                 issue(ca, folder, "localhost", "localhost"))


def tls_options(certs: Certs, pem: Pem | None = None, **extra: Any) -> DaemonOptions:
    pem = pem or certs.member
    return DaemonOptions(host="127.0.0.1", port=0, tls_cert=pem.cert, tls_key=pem.key, tls_ca=certs.ca, **extra)


# -- a real cluster: mutual TLS and the cluster secret together ---------------------------------------------------

@pytest.mark.slow  # about 10 s on 2 cores: 6 processes
def test_mutual_tls_cluster_with_secret_equals_the_reference(tmp_path: Path, kit: Any, certs: Certs) -> None:
    from mosaicd.experiments.cluster import free_ports

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    ports = free_ports(RUN["nodes"] + 1)
    barrier_port, node_ports = ports[0], ports[1:]
    barrier_url = f"https://127.0.0.1:{barrier_port}"
    procs: dict[str, subprocess.Popen] = {}
    common = ["--host", "127.0.0.1", "--log-json", "--secret-file", str(secret), "--tls-client-auth",
              "--linger", "60"]

    def spawn(name: str, port: int, *args: str, pem: Pem) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen([*kit.by_hand, *args, "--port", str(port), *common,
                                            *certs.member_flags(pem), *kit.role_flags(args[0], RUN)],
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()[-3000:]

    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"), pem=certs.member)
        for i, port in enumerate(node_ports):  # every node its own certificate from the cluster's CA
            pem = issue(certs.authority, tmp_path / "tls", f"node-{i}", "127.0.0.1")
            spawn(f"node-{i}", port, "node", "--barrier-url", barrier_url, "--out", str(tmp_path / f"node-{i}"),
                  pem=pem)
        summary_file = tmp_path / "run" / "summary.json"

        def finished() -> bool:
            for name, proc in procs.items():
                assert proc.poll() is None, (name, log(name))
            return summary_file.exists() and json.loads(summary_file.read_text())["status"] != "running"

        kit.wait_until(finished, 120, "the run to finish")
        # mosaicd status speaks TLS too: with the CA and a member's certificate it sees every node
        proc = subprocess.run([*kit.by_hand, "status", barrier_url, "--json", *certs.member_flags()],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        view = json.loads(proc.stdout)
        assert view["barrier"]["phase"] == "finished"
        assert [n["reachable"] for n in view["nodes"]] == [True] * RUN["nodes"]
        # ... without a client certificate, the --tls-client-auth barrier refuses it
        proc = subprocess.run([*kit.by_hand, "status", barrier_url, "--tls-ca", str(certs.ca)], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 1 and barrier_url in proc.stderr, proc.stderr
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "finished" and summary["dropped"] == []
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN))
    for name in procs:
        text = (tmp_path / f"{name}.log").read_text()
        assert "http://127.0.0.1" not in text, name  # every URL between members is https
        assert "auth_refused" not in text and "send_failed" not in text, name


@pytest.mark.slow  # about 5 s on 2 cores
def test_peer_list_of_https_addresses_runs_over_tls(tmp_path: Path, kit: Any, certs: Certs) -> None:
    from mosaicd.experiments.cluster import free_ports

    run = dict(nodes=3, rounds=5, fragments=2, fanout=1, dim=16, seed=2)
    ports = free_ports(run["nodes"])
    peers = tmp_path / "peers.txt"
    peers.write_text("".join(f"https://127.0.0.1:{p}\n" for p in ports))
    procs = {}
    try:
        for port in ports:
            with open(tmp_path / f"node-{port}.log", "wb") as log:
                procs[port] = subprocess.Popen(
                    [*kit.by_hand, "node", "--peer-list", str(peers), "--port", str(port), "--host", "127.0.0.1",
                     "--out", str(tmp_path / f"out-{port}"), "--log-json", "--tls-client-auth",
                     *certs.member_flags(), *kit.flags(run)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for port, proc in procs.items():
            assert proc.wait(timeout=120) == 0, (tmp_path / f"node-{port}.log").read_text()[-3000:]
    finally:
        kit.stop_all(procs)
    summary = json.loads((tmp_path / f"out-{min(ports)}" / "summary.json").read_text())
    assert summary["addresses"] == [f"127.0.0.1:{p}" for p in sorted(ports)]  # ranks: host:port, sorted
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))


# -- who gets through the handshake --------------------------------------------------------------------------------

async def hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def get(url: str, context: Any) -> int:
    async with Client(timeout=5, retries=0, ssl_context=context) as client:
        status, _, _ = await client.request("GET", url)
        return status


def raw_get(port: int, context: ssl.SSLContext | None) -> tuple[str, bytes | str]:
    """GET /hello on a bare socket (TLS when `context`): ("answer", its bytes), or (the step that failed, the
    error): "handshake" or "exchange"."""
    step = "handshake"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
            sock = context.wrap_socket(plain, server_hostname="127.0.0.1") if context else plain
            step = "exchange"
            sock.sendall(b"GET /hello HTTP/1.0\r\n\r\n")
            return "answer", sock.recv(4096)
    except (OSError, ssl.SSLError) as exc:
        return step, f"{type(exc).__name__}: {exc}"


def tls12(ca: Path) -> ssl.SSLContext:
    """A client without a certificate that trusts `ca`, limited to TLS 1.2, where the server checks the client's
    certificate inside the handshake (TLS 1.3 sends its refusal after the client's half of the handshake)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    return context


async def test_mutual_tls_server_refuses_clients_without_its_certificates(certs: Certs) -> None:
    app = web.Application()
    app.router.add_get("/hello", hello)
    options = tls_options(certs, tls_client_auth=True)
    runner, port = await serve(app, options)
    url = f"https://127.0.0.1:{port}/hello"
    try:
        assert await get(url, client_context(options)) == 200  # a member: CA-signed certificate, server verified
        refused = {
            "no client certificate": client_context(certs.ca_only()),
            "another CA's certificate": client_context(tls_options(certs, certs.stranger)),
        }
        for case, context in refused.items():
            with pytest.raises(HttpError) as exc:
                await get(url, context)
            assert exc.value.status is None, case  # the connection fails: no HTTP answer at all
        with pytest.raises(HttpError):  # plain HTTP on the TLS port
            await get(f"http://127.0.0.1:{port}/hello", None)
        # on the wire: a member gets its answer; the TLS 1.2 handshake fails for a client without a certificate;
        # with TLS 1.3 (the refusal comes after the client's half of the handshake) and plain HTTP, no answer
        step, answer = await asyncio.to_thread(raw_get, port, client_context(options))
        assert step == "answer" and answer.startswith(b"HTTP/1.0 200"), answer  # type: ignore[union-attr]
        anonymous = client_context(certs.ca_only())
        step, answer = await asyncio.to_thread(raw_get, port, tls12(certs.ca))
        assert step == "handshake", (step, answer)
        with_certificate = tls12(certs.ca)
        with_certificate.load_cert_chain(certs.member.cert, certs.member.key)
        assert (await asyncio.to_thread(raw_get, port, with_certificate))[0] == "answer"
        for context in (anonymous, None):
            step, answer = await asyncio.to_thread(raw_get, port, context)
            assert step != "answer" or answer == b"", (step, answer)
    finally:
        await runner.cleanup()


async def test_clients_verify_the_server(certs: Certs) -> None:
    app = web.Application()
    app.router.add_get("/hello", hello)
    for pem, why in ((certs.stranger, "a server certificate from another CA"),
                     (certs.localhost, "a certificate that does not name 127.0.0.1")):
        runner, port = await serve(app, tls_options(certs, pem))
        try:
            with pytest.raises(HttpError) as exc:
                await get(f"https://127.0.0.1:{port}/hello", client_context(tls_options(certs)))
            assert "certificate" in exc.value.detail.lower(), why
        finally:
            await runner.cleanup()
    runner, port = await serve(app, tls_options(certs))  # without --tls-client-auth, any verified client gets in
    try:
        assert await get(f"https://127.0.0.1:{port}/hello", client_context(certs.ca_only())) == 200
    finally:
        await runner.cleanup()


async def test_status_over_tls_names_the_failure(certs: Certs) -> None:
    app = web.Application()
    app.router.add_get("/v1/status", hello)
    runner, port = await serve(app, tls_options(certs, tls_client_auth=True))
    try:
        with pytest.raises(StatusError, match=f"https://127.0.0.1:{port}"):
            cluster_view(f"https://127.0.0.1:{port}", 5, client_context(certs.ca_only()))
    finally:
        await runner.cleanup()


# -- peer lists ------------------------------------------------------------------------------------------------------

def test_peer_list_may_name_https_addresses(tmp_path: Path, certs: Certs) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("# rank = sorted host:port\nhttps://127.0.0.1:9003/\n127.0.0.1:9001\nHTTPS://127.0.0.1:9002 # c\n")
    assert read_peer_list(peers) == ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
    assert read_peer_list(peers, tls=True) == ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
    with pytest.raises(MembershipError, match=r"line 2: 'https://127.0.0.1:9003/' is https://, but this node has "
                                              r"no --tls-cert"):
        read_peer_list(peers, tls=False)
    options = tls_options(certs).model_copy(update={"peer_list": peers})
    assert embedded_barrier_url(options) == "https://127.0.0.1:9001/barrier"
    plain = tmp_path / "plain.txt"
    plain.write_text("http://127.0.0.1:9001\n127.0.0.1:9002\n")
    assert read_peer_list(plain, tls=False) == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert embedded_barrier_url(DaemonOptions(peer_list=plain)) == "http://127.0.0.1:9001/barrier"
    with pytest.raises(MembershipError, match="line 1: 'http://127.0.0.1:9001' is http://, but this node speaks TLS"):
        read_peer_list(plain, tls=True)
    for bad in ("ftp://127.0.0.1:9001", "https://127.0.0.1:9001/v1", "https://127.0.0.1"):
        plain.write_text(bad + "\n")
        with pytest.raises(MembershipError, match="line 1: expected host:port"):
            read_peer_list(plain)


# -- settings ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_key": "k.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_cert": "c.pem", "tls_key": "k.pem", "tls_client_auth": True}, "--tls-client-auth needs --tls-ca"),
    ({"tls_ca": "ca.pem"}, "--tls-ca needs --tls-cert and --tls-key"),
    ({"barrier_url": "https://barrier:8000"}, "--barrier-url https://barrier:8000: an https:// barrier needs "
     "--tls-cert and --tls-key"),
    ({"barrier_url": "http://barrier:8000", "tls_cert": "c.pem", "tls_key": "k.pem"},
     "--barrier-url http://barrier:8000: with --tls-cert the members speak TLS"),
])
def test_tls_settings_errors_name_the_flags(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("+", r"\+")):
        Settings.load(**flags)


def test_tls_flags_and_variables(tmp_path: Path, certs: Certs, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from mosaicd.cli import main

    monkeypatch.setenv("MOSAIC_TLS_CERT", str(certs.member.cert))
    monkeypatch.setenv("MOSAIC_TLS_KEY", str(certs.member.key))
    monkeypatch.setenv("MOSAIC_TLS_CA", str(certs.ca))
    monkeypatch.setenv("MOSAIC_TLS_CLIENT_AUTH", "true")
    settings = Settings.load(barrier_url="https://127.0.0.1:9")
    assert settings.tls_client_auth and settings.tls_ca == certs.ca and scheme(settings) == "https"
    for name in ("MOSAIC_TLS_CERT", "MOSAIC_TLS_KEY", "MOSAIC_TLS_CA", "MOSAIC_TLS_CLIENT_AUTH"):
        monkeypatch.delenv(name)
    assert scheme(Settings.load()) == "http" and client_context(Settings.load()) is None
    with pytest.raises(SystemExit) as stopped:  # a flag for servers only is refused where it does not apply
        main(["simulate", "--tls-cert", "c.pem"])
    assert stopped.value.code == 2 and "--tls-cert does not apply to `mosaicd simulate`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        main(["barrier", "--tls-key", "k.pem", "--port", "0"])
    assert stopped.value.code == 2 and "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_unusable_certificate_files_are_named(tmp_path: Path, certs: Certs) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [(tls_options(certs).model_copy(update={"tls_cert": tmp_path / "absent.pem"}), "--tls-cert"),
             (tls_options(certs).model_copy(update={"tls_key": garbage}), "--tls-cert"),
             (tls_options(certs).model_copy(update={"tls_ca": garbage}), "--tls-ca")]
    for options, flag in cases:
        with pytest.raises(TlsError, match=flag):
            server_context(options)
    # a member's certificate with another member's key
    mixed = tls_options(certs).model_copy(update={"tls_key": certs.stranger.key})
    with pytest.raises(TlsError, match="--tls-key"):
        client_context(mixed)
