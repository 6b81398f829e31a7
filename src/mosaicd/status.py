"""`mosaicd status URL`: the cluster as a table, from its barrier or any of its nodes.

The barrier's `/v1/status` names every member; each node's `/v1/status` says its phase, round, bytes and
loss; the barrier's newest evaluation gives each node's latest metric. `--watch` redraws in place,
`--json` prints the same view for scripts.
"""

from __future__ import annotations

import argparse
import json
import math
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HELP = "show a running cluster: one row per node, and the run's metrics (URL: its barrier or any node)"


class StatusError(RuntimeError):
    """The URL did not answer as a Mosaic barrier or node."""


def fetch_json(url: str, timeout: float, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{url} answered HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:
        raise StatusError(f"{url}: {getattr(exc, 'reason', exc)}") from None


def base_url(url: str) -> str:
    url = url if "://" in url else f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StatusError(f"URL: expected http://host:port (a barrier or a node), got {url!r}")
    return url.rstrip("/")


def cluster_view(url: str, timeout: float = 3.0, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """{"barrier": its status, "nodes": [one row per member]}; a node's URL leads to its barrier. `context`:
    how https:// members are verified (and this client shows itself to mutual-TLS ones)."""
    url = base_url(url)
    status = fetch_json(f"{url}/v1/status", timeout, context)
    if status.get("role") != "barrier":
        barrier_url = status.get("barrier_url")
        if not barrier_url:
            raise StatusError(f"{url} is not a Mosaic barrier or node (no role, no barrier_url in /v1/status)")
        url, status = barrier_url.rstrip("/"), fetch_json(f"{barrier_url.rstrip('/')}/v1/status", timeout, context)
    members = status.get("members") or []

    def node(member: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return fetch_json(f"{urlsplit(url).scheme}://{member['address']}/v1/status", timeout, context)
        except StatusError:
            return None

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(members)))) as pool:
        nodes = list(pool.map(node, members))
    latest = status.get("latest") or {}
    rows = []
    for member, view in zip(members, nodes, strict=True):
        rank = member["rank"]
        last = (view or {}).get("last_round") or {}
        rows.append({
            "rank": rank, "address": member["address"], "reachable": view is not None,
            "phase": (view or {}).get("phase") or ("dropped" if rank in status.get("dropped", []) else "unreachable"),
            "round": (view or {}).get("round", member.get("last_round")),
            "last_contact_s": member.get("last_contact_s"), "missed": member.get("missed", 0),
            "straggler": rank in (status.get("stragglers") or []), "dropped": rank in (status.get("dropped") or []),
            "bytes_out": last.get("bytes_out"), "bytes_in": last.get("bytes_in"), "loss": (view or {}).get("loss"),
            "metric": latest.get(str(rank)),
        })
    return {"url": url, "barrier": status, "nodes": rows}


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return "-"


def render(view: dict[str, Any]) -> Any:
    """A rich renderable: the run's line, its metrics, and the node table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    b = view["barrier"]
    s = b.get("settings") or {}
    metrics = b.get("metrics") or {}
    metric = metrics.get("metric", "metric")
    head = Text(f"run {b.get('run_id')}  {b.get('phase')}  round {b.get('round')}/{b.get('rounds')}  "
                f"live {len(b.get('live') or [])}/{len(b.get('members') or [])}  dropped {b.get('dropped') or []}  "
                f"| task {s.get('task')} K={s.get('fragments')} s={s.get('fanout')} sampler {s.get('sampler')} "
                f"| barrier {view['url']}")
    summary = Text(f"round {metrics.get('round', '-')}: {metric}"
                   f"  node-average {_num(metrics.get('node_average'), '.4f')}"
                   f"  average-model {_num(metrics.get('average_model'), '.4f')}"
                   f"  consensus {_num(metrics.get('consensus_distance'), '.4g')}"
                   f"  spread {_num(metrics.get('node_spread'), '.4g')}" if metrics else "no evaluation yet")
    table = Table(box=None, header_style="bold")
    for name in ("rank", "address", "phase", "round", "contact", "missed", "straggler", "sent", "received", "loss",
                 metric):
        table.add_column(name, justify="right" if name not in ("address", "phase") else "left")
    for r in view["nodes"]:
        table.add_row(str(r["rank"]), r["address"], r["phase"], _num(r["round"], "d"),
                      f"{_num(r['last_contact_s'], '.1f')}s ago", str(r["missed"]), "yes" if r["straggler"] else "",
                      _bytes(r["bytes_out"]), _bytes(r["bytes_in"]), _num(r["loss"], ".4f"), _num(r["metric"], ".4f"))
    return Group(head, summary, table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="the barrier's or any node's address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between redraws [default: 1.0]")
    parser.add_argument("--json", action="store_true", help="print the view as JSON (for scripts)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per request [default: 3.0]")
    tls = parser.add_argument_group("TLS: an https:// cluster (as its members' --tls-* flags)")
    tls.add_argument("--tls-ca", type=Path, help="PEM CA bundle that signed the members' certificates "
                     "[default: the system's CAs]")
    tls.add_argument("--tls-cert", type=Path, help="PEM client certificate, for members with --tls-client-auth")
    tls.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client context of --tls-ca/--tls-cert/--tls-key (None without them); ValueError naming the flag."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together (the certificate and its private key)")
    from mosaicd.daemon.http.tls import client_context

    return client_context(args)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    context = tls_context(args)
    try:
        if args.json:
            print(json.dumps(cluster_view(args.url, args.timeout, context), indent=2))
            return 0
        if not args.watch:
            console.print(render(cluster_view(args.url, args.timeout, context)))
            return 0
        with Live(render(cluster_view(args.url, args.timeout, context)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(render(cluster_view(args.url, args.timeout, context)), refresh=True)
                except StatusError as exc:  # the run ended, or the barrier is restarting: say so, keep watching
                    live.update(f"[{time.strftime('%H:%M:%S')}] {exc}", refresh=True)
    except StatusError as exc:
        raise ValueError(str(exc)) from None
