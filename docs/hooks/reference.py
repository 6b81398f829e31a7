"""MkDocs hook: the reference pages' tables, made from the code as the site is built, so that they cannot drift.

A line `<!-- reference: NAME -->` in a page is replaced by NAME's markdown: `settings` (every setting: its flag,
variable, TOML key, default, allowed values and commands, from the one `Settings` model), `commands` (each
subcommand's own flags, from `mosaicd`'s parser), `rest` (the node's and the barrier's routes, from their OpenAPI
documents) and `metrics` (what a node's and the barrier's /metrics serve, from their registries).
`tests/test_docs.py` checks the built pages against `mosaicd --help`, `openapi.json` and the registries.
"""

from __future__ import annotations

import argparse
import html
import json
import re
from collections.abc import Callable, Iterable
from enum import StrEnum
from importlib import resources
from typing import Any

MARKER = re.compile(r"^<!-- reference: (\w+) -->$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(lambda m: GENERATED[m.group(1)](), markdown)


def cell(text: object) -> str:
    """Text fit for one cell of a markdown table."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def prose(text: str) -> str:
    """Help text as markdown: its brackets (`[default: ...]`) are not links."""
    return text.replace("[", "\\[")


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def allowed(field: Any) -> str:
    """The values a setting takes, as its type and constraints say."""
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        return ", ".join(f"`{c.value}`" for c in annotation)
    if annotation in (bool, bool | None):
        return "on / off"
    bounds = []
    for item in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="),
                           ("max_length", "length <="), ("pattern", "matches")):
            value = getattr(item, attr, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    kind = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
    return " and ".join([kind, *bounds]) if bounds else kind


def default_text(name: str, field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if name == "out":
        return "a new folder per run, `runs/<run id>-<UTC time>` (cluster, simulate); `runs/latest` otherwise"
    if value is None or value == {}:
        return "none"
    return f"`{value.value if hasattr(value, 'value') else value}`"


def settings() -> str:
    from mosaicd.cli import GROUP_HELP, groups
    from mosaicd.settings import Settings, flag_name, needs_text

    parts = []
    for group, names in groups().items():
        rows = []
        for name in names:
            field = Settings.model_fields[name]
            flag = flag_name(name)
            flags = f"`{flag}` / `--no-{flag[2:]}`" if field.annotation in (bool, bool | None) else f"`{flag}`"
            commands = ", ".join(field.json_schema_extra["commands"])
            rows.append((f"{flags}<br>`MOSAIC_{name.upper()}`<br>TOML `{name}`",
                         f"{prose(field.description or '')}<br>*values:* {prose(allowed(field))}; "
                         f"*commands:* {commands}" + (f"; *has an effect with:* {prose(needs)}"
                                                      if (needs := needs_text(name)) else ""),
                         default_text(name, field)))
        parts.append(f"### {group}: {GROUP_HELP[group]}\n\n" + table(("setting", "what it does", "default"), rows))
    return "\n\n".join(parts)


def parsers() -> dict[str, argparse.ArgumentParser]:
    """`mosaicd` itself (its own flags, under "") and each subcommand, by name."""
    from mosaicd.cli import build_parser, subparsers

    parser = build_parser()
    return {"": parser, **subparsers(parser)}


def own_flags(command: str, parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A subcommand's flags, less the settings a run command takes (those are in the settings tables)."""
    from mosaicd.cli import COMMANDS
    from mosaicd.settings import Settings

    settings = set(Settings.model_fields) if command in COMMANDS else set()
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
            and a.dest not in settings]


def code(text: object) -> str:
    """Inline code for a table cell: HTML, so that a `|` in it neither splits the row nor shows a backslash."""
    return "<code>" + html.escape(str(text)).replace("|", "&#124;") + "</code>"


def commands() -> str:
    from mosaicd.cli import COMMANDS, applies

    parts = []
    for name, parser in parsers().items():
        rows = []
        for action in own_flags(name, parser):
            what = ", ".join(code(o) for o in action.option_strings) or code(action.metavar or action.dest)
            values = ", ".join(code(c) for c in action.choices) if action.choices else cell(action.metavar or "")
            default = "" if action.default in (None, False, argparse.SUPPRESS) else code(action.default)
            rows.append((what, values, default, prose((action.help or "").replace("%(default)s", str(action.default)))))
        text = f"### {f'mosaicd {name}'.strip()}\n\n{prose(parser.description or '')}\n\n"
        if name in COMMANDS:
            text += f"Takes {len(applies()[name])} settings (the tables above whose commands name `{name}`) and:\n\n"
        header = ("flag or argument", "values", "default", "what it does")
        text += table(header, rows) if rows else "No flags of its own."
        parts.append(text)
    return "\n\n".join(parts)


def openapi(package: str) -> dict[str, Any]:
    return json.loads(resources.files(package).joinpath("openapi.json").read_text())


def rest() -> str:
    parts = []
    for role, package in (("node", "mosaicd.daemon.node"), ("barrier", "mosaicd.daemon.barrier")):
        doc = openapi(package)
        parts.append(f"## The {role}: {doc['info']['title']}\n\n{doc['info'].get('description', '')}")
        for path, methods in doc["paths"].items():
            for method, op in methods.items():
                if method not in ("get", "post", "put", "delete", "patch"):
                    continue
                only = {"barrier": " (a `--sync barrier` node only)", "async": " (an asynchronous node only: "
                        "`cluster --sync async`)"}.get(methods.get("x-mosaic-sync", ""), "")
                text = (f"### `{method.upper()} {path}`\n\n**{op.get('summary', '')}**{only}\n\n"
                        f"{op.get('description', '')}")
                params = [(f"`{p['name']}`", p["in"], "yes" if p.get("required") else "no", p.get("description", ""))
                          for p in op.get("parameters", [])]
                if params:
                    text += "\n\n" + table(("parameter", "in", "required", "what"), params)
                body = op.get("requestBody", {}).get("content", {})
                if body:
                    text += "\n\nRequest body: " + ", ".join(f"`{c}`" for c in body)
                answers = [(f"`{code}`", r.get("description", ""), ", ".join(f"`{c}`" for c in r.get("content", {})))
                           for code, r in op.get("responses", {}).items()]
                text += "\n\n" + table(("status", "meaning", "content"), answers)
                parts.append(text)
    return "\n\n".join(parts)


def families(registry: Any) -> list[tuple[str, str, str, str]]:
    """(name, type, labels, help) of every family a registry serves."""
    found = {}
    for family in registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels if k not in ("le", "quantile")})
        found[family.name] = (family.type, ", ".join(f"`{label}`" for label in labels), family.documentation)
    return [(f"`{name}`", *found[name]) for name in sorted(found)]


def metrics() -> str:
    from mosaic_proto import NodeState
    from mosaicd.daemon.barrier.metrics import EVALUATION_GAUGES, BarrierMetrics
    from mosaicd.daemon.http.auth import Keyring
    from mosaicd.daemon.node.inbox import Inbox
    from mosaicd.daemon.node.routes import node_app
    from mosaicd.settings import DaemonOptions

    barrier = BarrierMetrics()
    barrier.evaluated({key: 0.0 for key in EVALUATION_GAUGES})  # the evaluation's gauges appear with the first one
    inbox = Inbox(NodeState(), DaemonOptions(), Keyring(b"0" * 32))
    node_app(inbox)  # a node's app adds its limits', its secret's and its fragments streams' counters
    header = ("metric", "type", "labels", "what it counts")
    return (f"## A node's `/metrics`\n\n{table(header, families(inbox.metrics.registry))}\n\n"
            f"## The barrier's `/metrics`\n\n{table(header, families(barrier.registry))}")


GENERATED: dict[str, Callable[[], str]] = {"settings": settings, "commands": commands, "rest": rest,
                                           "metrics": metrics}
