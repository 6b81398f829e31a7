"""`mosaicd`: one command, subcommands for each role. Flags come from the one `Settings` model."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import sys
from enum import StrEnum
from importlib import import_module
from pathlib import Path
from typing import Any

from mosaicd.daemon.http.client import HttpError
from mosaicd.daemon.node.peer import PeerDropped
from mosaicd.logs import configure_logging
from mosaicd.outputs import SUMMARY_KEYS
from mosaicd.settings import Settings, SettingsError, TaskName

COMMANDS = {
    "node": "run one node daemon (also: mosaicd --peer-list peers.txt ...)",
    "barrier": "run the barrier peer",
    "cluster": "run a barrier and --nodes node processes on 127.0.0.1",
    "simulate": "run all --nodes nodes in this process (same outputs and models as cluster)",
}
# tooling: subcommands with their own flags, no run settings (module: HELP, add_arguments, main)
TOOLS = {"status": "mosaicd.status", "sweep": "mosaicd.experiments.sweep", "report": "mosaicd.experiments.report",
         "analyze": "mosaicd.experiments.analysis"}

RUN = ["run_id", "task", "nodes", "rounds", "fragments", "fanout", "sampler", "strategy", "seed", "aggregator",
       "trim", "clip_radius", "byzantine", "attack", "attack_scale"]
LEARNING = ["train", "local_steps", "lr", "batch_size", "momentum", "weight_decay", "eval_every", "threads",
            "partition", "alpha", "shards_per_node", "min_samples", "dim", "curvature", "heterogeneous",
            "device", "eval_samples"]
SIMULATE_ONLY = ["batched"]
NETWORK = ["host", "port", "advertise", "barrier_url", "peer_list", "expect_dns", "dns_settle", "round_deadline",
           "register_deadline", "drop_after", "request_timeout", "retries", "max_body_bytes", "secret_file",
           "header_timeout", "max_connections", "max_bodies", "register_rate",
           "insecure", "max_norm", "tls_cert", "tls_key", "tls_ca", "tls_client_auth",
           "barrier_grace", "allow_join", "state_dir", "checkpoint_every", "rejoin_max_age", "rejoin_dropped"]
OUTPUTS = ["out", "data_dir", "linger", "log_level", "log_json"]
GROUPS = {"run": RUN, "learning": LEARNING + SIMULATE_ONLY, "network": NETWORK, "outputs": OUTPUTS}
# which settings each subcommand takes; any other settings flag is refused, naming the subcommand
APPLIES = {
    "node": set(RUN + LEARNING + NETWORK + OUTPUTS) - {"expect_dns", "dns_settle"},
    "barrier": set(RUN + LEARNING + OUTPUTS) | {"host", "port", "expect_dns", "dns_settle", "round_deadline",
                                                "register_deadline", "drop_after", "request_timeout",
                                                "header_timeout", "max_connections", "max_bodies", "register_rate",
                                                "max_body_bytes", "secret_file", "insecure", "tls_cert", "tls_key",
                                                "tls_ca", "tls_client_auth", "allow_join"},
    "cluster": set(RUN + LEARNING) | {"round_deadline", "register_deadline", "drop_after", "request_timeout",
                                      "retries", "max_body_bytes", "secret_file", "max_norm", "out", "data_dir",
                                      "log_level", "log_json", "tls_cert", "tls_key", "tls_ca", "tls_client_auth",
                                      "barrier_grace", "checkpoint_every", "insecure"},
    "simulate": set(RUN + LEARNING + SIMULATE_ONLY) | {"out", "data_dir", "log_level", "log_json"},
}
GROUP_HELP = {"run": "the run (identical on every node)", "learning": "local training and evaluation",
              "network": "listening, peers, deadlines", "outputs": "results and logs"}
NODE_NOTE = ("With --barrier-url the run and learning flags are the barrier's (set them there); with --peer-list "
             "rank 0 hosts the barrier and uses its own.")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_settings_flags(parser: argparse.ArgumentParser, command: str) -> None:
    for group, names in GROUPS.items():
        section = parser.add_argument_group(f"{group}: {GROUP_HELP[group]}")
        for name in names:
            if name not in APPLIES[command]:
                continue
            field = Settings.model_fields[name]
            default = field.default.value if hasattr(field.default, "value") else field.default
            help_text = f"{field.description or ''} [default: {default}; env MOSAIC_{name.upper()}]".lstrip()
            choices = [c.value for c in field.annotation] if isinstance(field.annotation, type) and issubclass(
                field.annotation, StrEnum) else None
            if field.annotation in (bool, bool | None):
                section.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                     help=help_text)
            else:
                section.add_argument(flag(name), dest=name, default=None,  # pydantic checks choices, naming the flag
                                     metavar="{" + ",".join(choices) + "}" if choices else name.upper(),
                                     help=help_text)
    parser.add_argument_group("outputs: results and logs").add_argument(
        "--config", type=Path, help="TOML file with settings (keys as the flags, '-' or '_')")


def refuse_unknown(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Unknown flags get the subcommand's usage, a 'did you mean', or the subcommands a setting applies to."""
    sub = _subparsers(parser).get(command) if command else None
    target = sub or parser
    word = extra[0]
    name = word.split("=", 1)[0].removeprefix("--").removeprefix("no-").replace("-", "_")
    if command in APPLIES and name in Settings.model_fields and name not in APPLIES[command]:
        where = [c for c, names in APPLIES.items() if name in names]
        target.error(f"{flag(name)} does not apply to `mosaicd {command}` (it is a setting of: {', '.join(where)})")
    known = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
    target.error(f"unrecognized arguments: {' '.join(extra)}" + (f" (did you mean {close[0]}?)" if close else ""))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mosaic-learning")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mosaicd", description="Mosaic Learning: decentralized learning with "
                                     "model fragmentation.")
    parser.add_argument("--version", action="version", version=f"mosaicd {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text + (". " + NODE_NOTE if name == "node" else ""))
        _add_settings_flags(p, name)
        if name in ("cluster", "simulate"):
            p.add_argument("--quiet", action="store_true", help="no progress line")
        if name == "cluster":
            p.add_argument("--fail-fast", action="store_true", help="end the run when a node process dies (by "
                           "default it is reported, and the others go on without it)")
    data = sub.add_parser("data", help="download a data set (for users who are online)")
    data.add_argument("action", choices=["fetch"])
    data.add_argument("dataset", metavar="TASK", choices=[t.value for t in TaskName])
    data.add_argument("--data-dir", type=Path, default=None, help="where data sets live [default: data]")
    data.add_argument("--url", default=None, help="a mirror: the folder URL holding the official archives "
                      "[default: env MOSAIC_DATA_URL, else the official sites]")
    for name, module_name in TOOLS.items():
        module = import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__.split("\n\n")[0]))
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    flags: dict[str, Any] = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None)
                             is not None}
    return Settings.load(config=args.config, **flags)


def _print_final(summary: dict) -> None:
    final = summary.get("final") or {}
    out = summary["settings"]["out"]
    keys = SUMMARY_KEYS
    print(json.dumps({"out": out, **{k: final.get(k) for k in keys}, "wall_s": summary.get("wall_s")}))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv.insert(0, "node")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        refuse_unknown(parser, args.command, extra)
    if args.command is None:
        parser.print_help()
        raise SystemExit(2)
    if args.command in TOOLS:
        configure_logging()
        try:
            raise SystemExit(import_module(TOOLS[args.command]).main(args))
        except KeyboardInterrupt:
            raise SystemExit(130) from None
        except SettingsError as exc:  # a spec or flag the user wrote: a usage error
            parser.exit(2, f"mosaicd {args.command}: error: {exc}\n")
        except (ValueError, FileNotFoundError) as exc:
            parser.exit(1, f"mosaicd {args.command}: error: {exc}\n")
    if args.command == "data":
        from mosaicd.learning.data import fetch

        try:
            fetch(args.dataset, args.data_dir or Settings.model_fields["data_dir"].default, base_url=args.url)
        except (ValueError, OSError) as exc:
            parser.exit(1, f"mosaicd data: error: {exc}\n")
        return
    if args.command == "node" and args.barrier_url:
        given = [flag(n) for n in RUN + LEARNING if getattr(args, n, None) is not None]
        if given:
            parser.exit(2, f"mosaicd node: error: {', '.join(given)}: with --barrier-url the run's settings are the "
                        "barrier's; give them to `mosaicd barrier`\n")
    try:
        settings = load_settings(args)
    except SettingsError as exc:
        parser.exit(2, f"mosaicd {args.command}: error: {exc}\n")
    configure_logging(settings.log_level, settings.log_json)
    try:
        raise SystemExit(run_command(args, settings))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except (ValueError, FileNotFoundError, TimeoutError, HttpError, PeerDropped) as exc:  # HttpError: 4xx, unreachable
        parser.exit(1, f"mosaicd {args.command}: error: {exc}\n")


def run_command(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "node":
        from mosaicd.daemon.node.run import run_node
        return asyncio.run(run_node(settings))
    if args.command == "barrier":
        from mosaicd.daemon.barrier.run import run_barrier
        return asyncio.run(run_barrier(settings))
    if args.command == "cluster":
        from mosaicd.experiments.cluster import ClusterFailed, run_cluster
        try:
            _print_final(run_cluster(settings, progress=not args.quiet, fail_fast=args.fail_fast))
        except ClusterFailed as exc:
            print(f"mosaicd cluster: error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "simulate":
        from mosaicd.experiments.simulate import run_simulation
        _print_final(run_simulation(settings, progress=not args.quiet))
        return 0
    raise AssertionError(args.command)
