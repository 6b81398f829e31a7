"""`mosaicd status URL|FOLDER`: a cluster as a table, from its barrier or any of its nodes, or a run from its folder.

The barrier's `/v1/status` names every member; each node's `/v1/status` says its phase, round, bytes and
loss; the barrier's newest evaluation gives each node's latest metric. An asynchronous run (`cluster --sync async`)
has no barrier on its data path: any of its nodes names every member (`addresses`), and so does the barrier that
counts and collects one (compose's: `members`); each node says its steps, inbox and outgoing queue depths and the
staleness of its last aggregation (`AsyncNodeStatus`). A run's folder (its --out: a finished,
failed or crashed run, or one still going) gives the same view from its files: summary.json, the newest rows
of nodes.csv, the per-node metrics of its newest evaluation. `--watch` redraws in place, `--json` prints the
same view for scripts. Piped, the table is plain text, one line per row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mosaicd.terminal import seconds

if TYPE_CHECKING:
    import ssl

REQUEST_TIMEOUT_S = 3.0  # seconds per request, unless --timeout says otherwise
HELP = "show a cluster (URL: its barrier or any node) or a run's folder: one row per node, and the run's metrics"


class StatusError(RuntimeError):
    """The URL did not answer as a Mosaic barrier or node."""


def fetch_json(url: str, timeout: float, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{url} answered HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise StatusError(f"{url}: no answer within {timeout:g} s (--timeout)") from None
        raise StatusError(f"{url}: {reason}") from None


def base_url(url: str) -> str:
    url = url if "://" in url else f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StatusError(f"URL: expected http://host:port (a barrier or a node), got {url!r}")
    return url.rstrip("/")


def member_statuses(scheme: str, addresses: list[str], timeout: float,
                    context: ssl.SSLContext | None) -> list[dict[str, Any] | None]:
    """Each member's /v1/status, asked in parallel, in the order given; None for one that did not answer."""
    from concurrent.futures import ThreadPoolExecutor

    def one(address: str) -> dict[str, Any] | None:
        try:
            return fetch_json(f"{scheme}://{address}/v1/status", timeout, context)
        except StatusError:
            return None

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(addresses)))) as pool:
        return list(pool.map(one, addresses))


def cluster_view(url: str, timeout: float = REQUEST_TIMEOUT_S, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """{"barrier": its status, "nodes": [one row per member]}; a node's URL leads to its barrier. `context`:
    how https:// members are verified (and this client shows itself to mutual-TLS ones)."""
    url = base_url(url)
    status = fetch_json(f"{url}/v1/status", timeout, context)
    if status.get("sync") == "async":  # a node of an asynchronous run: it names every member
        return async_view(url, status, list(status.get("addresses") or []), timeout, context)
    if status.get("role") != "barrier":
        barrier_url = status.get("barrier_url")
        if not barrier_url:
            raise StatusError(f"{url} is not a Mosaic barrier or node (no role, no barrier_url in /v1/status)")
        url, status = barrier_url.rstrip("/"), fetch_json(f"{barrier_url.rstrip('/')}/v1/status", timeout, context)
    members = status.get("members") or []
    if (status.get("settings") or {}).get("sync") == "async":  # the barrier of one (compose): its members' steps
        ranked = sorted(members, key=lambda m: m["rank"])
        return async_view(url, status, [m["address"] for m in ranked], timeout, context)
    nodes = member_statuses(urlsplit(url).scheme, [m["address"] for m in members], timeout, context)
    latest = status.get("latest") or {}
    rows = []
    for member, view in zip(members, nodes, strict=True):
        rank = member["rank"]
        last = (view or {}).get("last_round") or {}
        rows.append({
            "rank": rank, "address": member["address"], "reachable": view is not None,
            "phase": (view or {}).get("phase") or ("left" if rank in status.get("left", []) else "dropped"
                                                     if rank in status.get("dropped", []) else "unreachable"),
            "round": (view or {}).get("round", member.get("last_round")),
            "last_contact_s": member.get("last_contact_s"), "missed": member.get("missed", 0),
            "straggler": rank in (status.get("stragglers") or []), "dropped": rank in (status.get("dropped") or []),
            "bytes_out": last.get("bytes_out"), "bytes_in": last.get("bytes_in"), "loss": (view or {}).get("loss"),
            "metric": latest.get(str(rank)),
        })
    return {"url": url, "barrier": status, "nodes": rows}


def async_view(url: str, status: dict[str, Any], addresses: list[str], timeout: float = REQUEST_TIMEOUT_S,
               context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """{"sync": "async", "run": the settings and counts, "nodes": [one row per member]} of an asynchronous run,
    from the /v1/status (`status`) of one of its nodes or of its barrier (compose's, which only counts and
    collects: "barrier", its phase), which name every member (`addresses`, in rank order)."""
    views = member_statuses(urlsplit(url).scheme, addresses, timeout, context)
    rows = []
    for rank, (address, view) in enumerate(zip(addresses, views, strict=True)):
        v = view or {}
        last = v.get("last_aggregation") or {}
        rows.append({"rank": rank, "address": address, "reachable": view is not None,
                     "phase": v.get("phase", "unreachable"), "steps": v.get("steps"), "iterations": v.get("iterations"),
                     "steps_per_s": v.get("steps_per_s"), "inbox": v.get("inbox"),
                     "inbox_per_fragment": v.get("inbox_per_fragment"), "inbox_oldest_s": v.get("inbox_oldest_s"),
                     "queue": v.get("queue"), "queue_fragments": v.get("queue_fragments"),
                     "copies": last.get("copies"), "lag_steps_mean": last.get("lag_steps_mean"),
                     "lag_steps_max": last.get("lag_steps_max"), "wait_s_mean": last.get("wait_s_mean"),
                     "wait_s_max": last.get("wait_s_max"), "sent": v.get("sent"), "unsent": v.get("unsent"),
                     "stale": v.get("stale"), "superseded": v.get("superseded"), "averaged": v.get("averaged"),
                     "stopped_by": v.get("stopped_by")})
    settings = status.get("settings") or {}
    run = {"run_id": status.get("run_id"), "exchange": status.get("exchange", settings.get("exchange")),
           "settings": settings, "finished": sum(r["phase"] == "finished" for r in rows),
           "reachable": sum(r["reachable"] for r in rows)}
    view = {"url": url, "sync": "async", "run": run, "nodes": rows}
    if status.get("role") == "barrier":
        view["barrier"] = {"phase": status.get("phase"), "registered": status.get("registered"),
                           "expected": status.get("expected"), "error": status.get("failure")}
    return view


def folder_view(folder: Path) -> dict[str, Any]:
    """The view of `cluster_view` from a run's files: its summary (status, settings, progress, the newest
    evaluation), each node's newest row of nodes.csv and its metric in the newest evaluation."""
    from mosaicd.rundir import last_node_rows, read_rounds, read_summary

    summary = read_summary(folder)
    if summary is None:
        raise StatusError(f"{folder}: no readable summary.json (not a run's folder: give its --out)")
    if not isinstance(summary.get("settings"), dict) or "status" not in summary:
        raise StatusError(f"{folder}: its summary.json is not a run's (no status or settings): give a run's --out")
    settings = summary.get("settings") or {}
    final = summary.get("final") or {}
    progress = summary.get("progress") or {}
    done = progress.get("rounds_done")
    steps = (summary.get("asynchronous") or {}).get("steps") or {}  # an asynchronous run: each node's iterations
    if steps:
        done = min(steps.values())
    nodes = int(settings.get("nodes") or 0)
    addresses = summary.get("addresses") or []
    dropped = list(summary.get("dropped") or [])
    left = list(summary.get("left") or [])
    # live: the members still in the run (a summary's members may name one that left or was dropped since)
    members = [r for r in (summary.get("members") or range(nodes)) if r not in dropped and r not in left]
    if final and "per_node" not in final:  # a large run's summary leaves each node's metric to rounds.csv
        final = {**final, **next(reversed(read_rounds(folder)), {})}
    latest = {str(r): v for r, v in zip(final.get("nodes") or [], final.get("per_node") or [], strict=False)}
    last = last_node_rows(folder, nodes)
    status = str(summary.get("status"))
    barrier = {"role": "run folder", "run_id": settings.get("run_id"), "phase": status,
               "round": done if done is not None else "-", "rounds": settings.get("rounds"), "live": members,
               "members": [{"rank": r} for r in range(nodes)], "dropped": dropped, "left": left, "settings": settings,
               "metrics": final or None, "latest": latest, "error": summary.get("error"),
               "started": summary.get("started"), "wall_s": summary.get("wall_s"), "mode": summary.get("mode")}
    rows = []
    for rank in range(nodes):
        row = last.get(rank) or {}
        rows.append({
            "rank": rank, "address": addresses[rank] if rank < len(addresses) else "-", "reachable": False,
            "phase": "left" if rank in left else "dropped" if rank in dropped else status,
            "round": steps.get(str(rank), row.get("round")),
            "last_contact_s": None,
            "missed": 0, "straggler": False, "dropped": rank in dropped, "bytes_out": row.get("bytes_out"),
            "bytes_in": row.get("bytes_in"), "loss": row.get("loss"), "metric": latest.get(str(rank))})
    return {"url": str(folder), "barrier": barrier, "nodes": rows}


def view_of(target: str, timeout: float, context: ssl.SSLContext | None) -> dict[str, Any]:
    """A folder's view if `target` is a folder on this machine, else the cluster's at that URL."""
    if "://" not in target and Path(target).is_dir():
        return folder_view(Path(target))
    if "://" not in target and ":" not in target:  # neither a folder here nor host:port
        raise StatusError(f"{target}: no such folder (and not a URL: http://host:port of a barrier or a node)")
    return cluster_view(target, timeout, context)


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


def _ago(seconds: Any) -> str:
    return "-" if seconds is None else f"{_num(seconds, '.1f')}s ago"


def render_async(view: dict[str, Any]) -> Any:
    """An asynchronous run's renderable: its line and one row per node (steps, depths, staleness)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    run, s = view["run"], view["run"]["settings"]
    n = len(view["nodes"])
    barrier = view.get("barrier")
    where = f"node {view['url']}" if barrier is None else f"barrier {view['url']} ({barrier['phase']})"
    if barrier is not None and barrier["phase"] == "registering":  # no members yet: who has come, of how many
        where += f", registered {barrier['registered']}/{barrier['expected'] or '?'}"
    budget = "" if s.get("time_budget") is None else f" budget {s['time_budget']:g} s"
    head = Text(f"run {run['run_id']}  asynchronous ({run['exchange']})  finished {run['finished']}/{n}"
                f"  reachable {run['reachable']}/{n}  | task {s.get('task')} K={s.get('fragments')} "
                f"s={s.get('fanout')} sampler {s.get('sampler')}{budget} | {where}")
    if barrier is not None and barrier["error"]:
        head.append(f"\nerror: {barrier['error']}")
    note = Text("inbox: fragments waiting (oldest's wait); queue: messages to send (their fragments); lag: the node's "
                "step less the step of the copies its last aggregation averaged (mean/max); wait: their time in the "
                "inbox (mean/max)")
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("rank", "address", "phase", "steps", "steps/s", "inbox", "queue", "copies", "lag", "wait", "sent",
                 "stale", "superseded"):
        table.add_column(name, justify="right" if name not in ("address", "phase") else "left")
    for r in view["nodes"]:
        steps = "-" if r["steps"] is None else f"{r['steps']}/{r['iterations']}"
        oldest = f" ({_num(r['inbox_oldest_s'], '.2f')}s)" if r["inbox_oldest_s"] is not None else ""
        queue = "-" if r["queue"] is None else f"{r['queue']} ({r['queue_fragments']})"
        phase = r["phase"] if not r.get("stopped_by") else f"{r['phase']} ({r['stopped_by']})"  # budget, iterations
        table.add_row(str(r["rank"]), r["address"], phase, steps, _num(r["steps_per_s"], ".2f"),
                      _num(r["inbox"], "d") + oldest, queue, _num(r["copies"], "d"),
                      f"{_num(r['lag_steps_mean'], '.1f')}/{_num(r['lag_steps_max'], 'd')}",
                      f"{_num(r['wait_s_mean'], '.3f')}/{_num(r['wait_s_max'], '.3f')}s", _num(r["sent"], "d"),
                      _num(r["stale"], "d"), _num(r["superseded"], "d"))
    return Group(head, note, table)


def render(view: dict[str, Any]) -> Any:
    """A rich renderable: the run's line, its metrics, and the node table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if view.get("sync") == "async":
        return render_async(view)

    b = view["barrier"]
    s = b.get("settings") or {}
    metrics = b.get("metrics") or {}
    metric = metrics.get("metric", "metric")
    folder = b.get("role") == "run folder"
    rounds, at = b.get("rounds"), b.get("round")
    if folder or b.get("phase") == "finished":  # a finished barrier's open round is past the last one
        count = f"rounds done {min(at, rounds) if isinstance(at, int) and isinstance(rounds, int) else at}/{rounds}"
    else:
        count = f"round {at}/{rounds}"
    if b.get("phase") == "registering":  # no members yet: who has come, of how many (0: counted as they come)
        members = f"registered {b.get('registered', 0)}/{b.get('expected') or '?'}"
    else:
        members = f"live {len(b.get('live') or [])}/{len(b.get('members') or [])}"
    head = Text(f"run {b.get('run_id')}  {b.get('phase')}  {count}  {members}  dropped {b.get('dropped') or []}  "
                f"left {b.get('left') or []}  "
                f"| task {s.get('task')} K={s.get('fragments')} s={s.get('fanout')} sampler {s.get('sampler')} "
                + (f"| folder {view['url']}" + (f" ({b.get('mode')}, started {b.get('started')}, "
                                                f"{b.get('wall_s')}s)" if b.get("started") else "")
                   if folder else f"| barrier {view['url']}"))
    if b.get("error"):
        head.append(f"\nerror: {b['error']}")
    summary = Text(f"round {metrics.get('round', '-')}: {metric}"
                   f"  node-average {_num(metrics.get('node_average'), '.4f')}"
                   f"  average-model {_num(metrics.get('average_model'), '.4f')}"
                   f"  consensus {_num(metrics.get('consensus_distance'), '.4g')}"
                   f"  spread {_num(metrics.get('node_spread'), '.4g')}" if metrics else "no evaluation yet")
    if metrics and isinstance(metrics.get("reported"), dict):  # what the nodes' own training loops reported
        summary.append("\nreported (node average): " + "  ".join(f"{k} {_num(v, '.4g')}"
                                                               for k, v in metrics["reported"].items()))
    table = Table(box=None, header_style="bold", pad_edge=False)
    evaluated = f"{metric} @ {metrics['round']}" if isinstance(metrics.get("round"), int) else metric
    for name in ("rank", "address", "phase", "round", "contact", "missed", "straggler", "sent last round",
                 "received last round", "train loss", evaluated):  # each node's metric names its round
        table.add_column(name, justify="right" if name not in ("address", "phase") else "left")
    for r in view["nodes"]:
        table.add_row(str(r["rank"]), r["address"], r["phase"], _num(r["round"], "d"),
                      _ago(r["last_contact_s"]), str(r["missed"]), "yes" if r["straggler"] else "",
                      _bytes(r["bytes_out"]), _bytes(r["bytes_in"]), _num(r["loss"], ".4f"), _num(r["metric"], ".4f"))
    return Group(head, summary, table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL|FOLDER", help="the barrier's or any node's address, e.g. "
                        "http://127.0.0.1:8000, or a run's folder (its --out)")
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    parser.add_argument("--interval", type=seconds, default=1.0, help="seconds between redraws [default: 1.0]")
    parser.add_argument("--json", action="store_true", help="print the view as JSON (for scripts)")
    parser.add_argument("--timeout", type=seconds, default=REQUEST_TIMEOUT_S,
                        help=f"seconds per request [default: {REQUEST_TIMEOUT_S}]")
    tls = parser.add_argument_group("TLS: an https:// cluster (as its members' --tls-* flags)")
    tls.add_argument("--tls-ca", type=Path, help="PEM CA bundle that signed the members' certificates "
                     "[default: the system's CAs]")
    tls.add_argument("--tls-cert", type=Path, help="PEM client certificate, for members with --tls-client-auth")
    tls.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client context of --tls-ca/--tls-cert/--tls-key (None without them); ValueError naming the flag."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together (the certificate and its private key)")
    if args.tls_cert is None and args.tls_ca is None:
        return None
    from mosaicd.daemon.http.tls import client_context

    return client_context(args)


def main(args: argparse.Namespace) -> int:
    context = tls_context(args)
    try:
        if args.json:
            print(json.dumps(view_of(args.url, args.timeout, context), indent=2))
            return 0
        from mosaicd.terminal import console as make_console
        from mosaicd.terminal import show

        console = make_console()
        if not args.watch:
            show(console, render(view_of(args.url, args.timeout, context)))
            return 0
        from rich.live import Live

        with Live(render(view_of(args.url, args.timeout, context)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(render(view_of(args.url, args.timeout, context)), refresh=True)
                except StatusError as exc:  # the run ended, or the barrier is restarting: say so, keep watching
                    live.update(f"[{time.strftime('%H:%M:%S')}] {exc}", refresh=True)
    except StatusError as exc:
        raise ValueError(str(exc)) from None
