"""`DaemonOptions`: how one process listens, reaches the others, waits and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mosaicd.extras import require
from mosaicd.settings.effects import defaults, void_setting
from mosaicd.settings.flags import cli
from mosaicd.settings.values import UVLOOP_MISSING, EventLoop, uvloop_installed


class DaemonOptions(BaseModel):
    """How one process listens, reaches the others, waits and writes. Nothing here changes the models."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out: Path = Field(Path("runs/latest"), description="output directory (`cluster`, `simulate`: when not given, a "
                      "new folder per run, runs/<run id>-<UTC time>)", **cli("outputs"))
    replace: bool = Field(False, description="start a new run in an --out that holds one: `cluster` and `simulate` "
                          "remove its files (summary, CSVs, logs, journal, checkpoints; nothing else); the barrier "
                          "keeps a finished run's files in OUT/earlier/ (without it, it refuses to wait for nodes "
                          "of a run that is over)", **cli("outputs", "barrier", "cluster", "simulate"))
    tensorboard: Path | None = Field(None, description="also write each evaluated round's metrics as TensorBoard "
                                     "scalars, to DIR/<the run folder's name> (the [tensorboard] extra)",
                                     **cli("outputs", "barrier", "cluster", "simulate"))
    mlflow: Path | None = Field(None, description="also log the run's settings and each evaluated round's metrics "
                                "to the MLflow store DIR/mlflow.db, experiment --run-id (the [mlflow] extra)",
                                **cli("outputs", "barrier", "cluster", "simulate"))
    # the network
    host: str = Field("127.0.0.1", description="address to listen on", **cli("network", "node", "barrier"))
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)",
                      **cli("network", "node", "barrier"))
    advertise: str | None = Field(None, description="host:port other nodes use to reach this one",
                                  **cli("network", "node"))
    barrier_url: str | None = Field(None, description="barrier peer, e.g. http://barrier:8000",
                                    **cli("network", "node"))
    peer_list: Path | None = Field(None, description="file of host:port lines; rank 0 hosts the barrier",
                                   **cli("network", "node"))
    expect_dns: str | None = Field(None, description="barrier: count nodes as the addresses this name resolves to",
                                   **cli("network", "barrier"))
    dns_settle: float = Field(3.0, gt=0, description="barrier with --expect-dns: seconds the DNS answer must hold "
                              "still before it counts (raise it when many replicas start slowly)",
                              **cli("network", "barrier"))
    nodes_per_address: int = Field(1, ge=1, le=256, description="barrier with --expect-dns: nodes behind each "
                                   "address the name resolves to (a container of `mosaicd node --nodes-per-process "
                                   "N` is one address): the run counts the addresses times this",
                                   **cli("network", "barrier"))
    expect_settle: float | None = Field(None, gt=0, description="barrier: count nodes as those registered once "
                                        "none new has registered for this many seconds, or for twice the longest "
                                        "pause between registrations so far (replicas whose number the barrier is "
                                        "not told: compose --scale on the host's network)",
                                        **cli("network", "barrier"))
    port_file: Path | None = Field(None, description="write the port listened on to this file (with --port 0: for a "
                                   "health check); a process started again with --port 0 takes that port back when "
                                   "it is free, so peers find it at the same address", **cli("network", "node",
                                                                                              "barrier"))
    register_deadline: float = Field(300.0, gt=0, description="seconds to wait for every node to register",
                                     **cli("network", "node", "barrier", "cluster"))
    drop_after: int = Field(2, ge=1, description="rounds a member may miss before it is dropped",
                            **cli("network", "node", "barrier", "cluster"))
    request_timeout: float = Field(30.0, gt=0, description="seconds per HTTP request",
                                   **cli("network", "node", "barrier", "cluster"))
    retries: int = Field(3, ge=0, description="retries of a failed send", **cli("network", "node", "cluster"))
    max_body_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="largest accepted request body; bodies "
                                "received at once hold at most this together: a daemon's memory grows by at most "
                                "this plus 64 MiB while it receives them",
                                **cli("network", "node", "barrier", "cluster"))
    # limits under abuse (daemon/limits.py)
    header_timeout: float = Field(20.0, gt=0, description="seconds a connection may take to send a request's "
                                  "head, from connecting or from its previous answer: idle or slower ones are "
                                  "closed (a body must arrive within --request-timeout, else 408)",
                                  **cli("network", "node", "barrier"))
    max_connections: int = Field(4096, ge=8, description="connections served at once (fewer where the open-file "
                                 "limit is lower), a quarter of them from one address; a newcomer beyond it "
                                 "closes the oldest idle one, or is answered 503 when none is idle",
                                 **cli("network", "node", "barrier"))
    max_bodies: int = Field(4, ge=1, description="request bodies received at once, half of them (at least one) "
                            "from one address, together at most --max-body-bytes; others wait a moment, then 503",
                            **cli("network", "node", "barrier"))
    register_rate: float = Field(5.0, gt=0, description="barrier: registrations a second one address may make "
                                 "while registration is open, in bursts of --nodes + 10; beyond it 429",
                                 **cli("network", "node", "barrier"))
    secret_file: Path | None = Field(None, description="file holding the cluster secret (16+ bytes): every request "
                                     "between members is signed with it and checked (MOSAIC_SECRET_FILE)",
                                     **cli("network", "node", "barrier", "cluster"))
    max_norm: float | None = Field(None, gt=0, description="refuse a received fragment whose norm is over this many "
                                   "times the node's own (a guard against faults, not against attacks)",
                                   **cli("network", "node", "cluster", "simulate"))
    insecure: bool = Field(False, description="run without --secret-file: anyone who reaches a port (on loopback, "
                           "any local user) can join the run and send it models; without it a node refuses to start "
                           "with no secret, `mosaicd barrier` makes its own (OUT.secret) and `mosaicd cluster` one "
                           "for each run", **cli("network", "node", "barrier", "cluster"))
    tls_cert: Path | None = Field(None, description="PEM certificate (chain) this member serves TLS with and shows "
                                  "as a client; with it every URL between members is https:// (needs --tls-key)",
                                  **cli("network", "node", "barrier", "cluster"))
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert",
                                 **cli("network", "node", "barrier", "cluster"))
    tls_ca: Path | None = Field(None, description="PEM CA bundle that signed the members' certificates: clients "
                                "verify servers against it (else the system's CAs), and --tls-client-auth servers "
                                "their clients", **cli("network", "node", "barrier", "cluster"))
    tls_client_auth: bool = Field(False, description="mutual TLS: accept only clients showing a certificate that "
                                  "--tls-ca signed (needs --tls-ca)", **cli("network", "node", "barrier", "cluster"))
    event_loop: EventLoop = Field(EventLoop.AUTO, description="the event loop node, barrier and launcher run on: "
                                  "auto (uvloop where it is installed: its sockets and TLS are C), uvloop, or "
                                  "asyncio (Python's own); no model depends on it",
                                  **cli("network", "node", "barrier", "cluster"))
    # surviving faults
    barrier_grace: float = Field(120.0, gt=0, description="node: seconds to keep retrying an unreachable barrier "
                                 "(it may be restarting: it resumes the run from OUT/barrier-state.json)",
                                 **cli("network", "node", "cluster"))
    allow_join: bool = Field(False, description="barrier: let new nodes join during the run (they get the next "
                             "free rank and a live peer's model, and are sampled from the next round on)",
                             **cli("network", "node", "barrier"))
    state_dir: Path | None = Field(None, description="node: where it checkpoints its model and round (default: "
                                   "OUT/state/<host_port>); a node started again with it rejoins the run",
                                   **cli("network", "node"))
    checkpoint_every: int = Field(1, ge=0, description="node: checkpoint every N rounds (--sync async: N "
                                  "iterations; 0: never)",
                                  **cli("network", "node", "cluster"))
    rejoin_max_age: int = Field(2, ge=0, description="node: a rejoining node takes its checkpoint if it is at most "
                                "this many rounds old, else a live peer's model", **cli("network", "node"))
    resume_round: int | None = Field(None, ge=0, description="barrier and node: resume the interrupted run of OUT "
                                     "from this open round (the newest the journal keeps or the one before), every "
                                     "member started again with its checkpoint of it, at any address; `mosaicd "
                                     "cluster --resume` picks it", **cli("network", "node", "barrier"))
    leave_on_signal: bool = Field(True, description="node: on SIGTERM or SIGINT, tell the barrier it leaves the run "
                                  "(it is not waited for from then on), then exit 0; `mosaicd cluster` turns it off: "
                                  "there Ctrl-C interrupts the whole run, which --resume continues",
                                  **cli("network", "node"))
    rejoin_dropped: bool = Field(False, description="node: when the barrier drops it (it was cut off or stalled), "
                                 "register again and rejoin at the next round boundary instead of exiting",
                                 **cli("network", "node"))
    nodes_per_process: int = Field(1, ge=1, le=256, description="node: this many nodes in one process (a "
                                   "container), forked after the imports so that they share their memory; member I "
                                   "(from 0) listens on --port + I (0: any free port), writes --port-file.I and "
                                   "checkpoints in --state-dir/I, and registers with the barrier as a node of its "
                                   "own", **cli("network", "node"))

    @field_validator("tensorboard", "mlflow")
    @classmethod
    def _tracker(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None:  # said before the run starts, not by the barrier once the nodes are up
            require("it", *{"tensorboard": ("tensorboard",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}[
                info.field_name])
        return value

    @field_validator("event_loop")
    @classmethod
    def _event_loop(cls, value: EventLoop) -> EventLoop:
        if value is EventLoop.UVLOOP and not uvloop_installed():  # said at start, not when the loop is made
            raise ValueError(UVLOOP_MISSING)
        return value

    @field_validator("barrier_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query:
            raise ValueError("expected http://host:port (the barrier's address, e.g. http://barrier:8000)")
        return value.rstrip("/")

    @property
    def nodes_counted(self) -> bool:
        """The run's node count is counted, not given by --nodes: the addresses a DNS name resolves to, the nodes
        registered once none new come, a peer list's lines (a restarted barrier takes its journal's count)."""
        return bool(self.expect_dns or self.expect_settle or self.peer_list)

    def member_fields(self, index: int) -> dict[str, Any]:
        """The settings member `index` of --nodes-per-process has of its own (its port, port file, state folder,
        advertised address; none where the process is one node)."""
        if self.nodes_per_process == 1:
            return {}
        fields: dict[str, Any] = {"nodes_per_process": 1, "port": self.port + index if self.port else 0}
        if self.port_file is not None:
            fields["port_file"] = Path(f"{self.port_file}.{index}")
        if self.state_dir is not None:
            fields["state_dir"] = Path(self.state_dir) / str(index)
        if self.advertise is not None:
            host, _, port = self.advertise.rpartition(":")
            fields["advertise"] = f"{host}:{int(port) + index}"
        return fields

    @model_validator(mode="after")
    def _tls(self) -> DaemonOptions:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together (the certificate and its private key)")
        if (void := void_setting(self, DaemonOptions.model_fields, defaults(DaemonOptions))) is not None:
            raise ValueError(void)  # --tls-ca without a certificate, --dns-settle without --expect-dns, ...
        if self.nodes_per_process > 1:
            if self.port and self.port + self.nodes_per_process - 1 > 65535:
                raise ValueError(f"--nodes-per-process {self.nodes_per_process}: its members listen on --port "
                                 f"{self.port} to {self.port + self.nodes_per_process - 1}, past 65535")
            if self.advertise is not None and (not self.port or not self.advertise.rpartition(":")[2].isdigit()):
                raise ValueError(f"--nodes-per-process {self.nodes_per_process} with --advertise: member I "
                                 "advertises HOST:PORT + I, so it needs --advertise HOST:PORT and a --port other "
                                 "than 0")
        if self.barrier_url is not None:
            https = urlsplit(self.barrier_url).scheme == "https"
            if https and self.tls_cert is None:
                raise ValueError(f"--barrier-url {self.barrier_url}: an https:// barrier needs --tls-cert and "
                                 "--tls-key (every member of a TLS cluster serves TLS)")
            if not https and self.tls_cert is not None:
                raise ValueError(f"--barrier-url {self.barrier_url}: with --tls-cert the members speak TLS: "
                                 "give the barrier's https:// address")
        return self

