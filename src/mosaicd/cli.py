"""`mosaicd`: one command, subcommands for each role. Flags come from the one `Settings` model.

Only what the command line names is imported: `mosaicd --help` and the tools' parsers need no pydantic, numpy or
aiohttp, so that `mosaicd status` starts in a fraction of a second (`bench/startup_tools.py`).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import sys
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mosaicd.settings import Settings

COMMANDS = {
    "node": "run one node daemon (also: mosaicd --peer-list peers.txt ...)",
    "barrier": "run the barrier peer",
    "cluster": "run a barrier and --nodes node processes on 127.0.0.1",
    "simulate": "run all --nodes nodes in this process (same outputs and models as cluster)",
}
DATA_HELP = "download a data set (for users who are online)"
# tooling: subcommands with their own flags, no run settings (module: add_arguments, main; the module's docstring
# describes it); the help line is here, so that `mosaicd --help` imports none of them
TOOLS = {
    "status": ("mosaicd.status", "show a cluster (URL: its barrier or any node) or a run's folder: one row per node, "
               "and the run's metrics"),
    "runs": ("mosaicd.runs", "list the runs under a folder (default runs/): id, status, task, K, optimizer, rounds, "
             "metric"),
    "log": ("mosaicd.runlog", "show a run's logs (its barrier's, or a node's with --node), --follow as it goes"),
    "sweep": ("mosaicd.experiments.sweep", "run a grid of experiments from a TOML spec (resumable; see examples/)"),
    "report": ("mosaicd.experiments.report", "figures (PNG) and a results table (report.md) from a sweep's folder or "
               "one run's, or several runs compared"),
    "analyze": ("mosaicd.experiments.analysis", "spectral consensus rate of Mosaic gossip on identical quadratics, "
                "and the simulated consensus error"),
}
QUIET_TOOLS = {"status", "runs", "log"}  # they log nothing: no logging set up (structlog is not imported)

GROUP_ORDER = ("run", "learning", "network", "outputs")


@functools.cache
def groups() -> dict[str, list[str]]:
    """Each help group's settings, from the settings' own metadata (`settings.cli`)."""
    from mosaicd.settings import Settings

    meta = {n: f.json_schema_extra for n, f in Settings.model_fields.items()}
    assert all(isinstance(m, dict) for m in meta.values()), "every setting has cli() metadata (settings/flags.py)"
    return {g: [n for n, m in meta.items() if m["group"] == g] for g in GROUP_ORDER}  # type: ignore[index]


@functools.cache
def applies() -> dict[str, set[str]]:
    """The settings each subcommand takes (its metadata again); any other settings flag is refused, naming the
    subcommands it applies to."""
    from mosaicd.settings import Settings

    return {c: {n for n, f in Settings.model_fields.items() if c in f.json_schema_extra["commands"]}  # type: ignore
            for c in COMMANDS}


GROUP_HELP = {"run": "the run (identical on every node)", "learning": "local training and evaluation",
              "network": "listening, peers, deadlines", "outputs": "results and logs"}
NODE_NOTE = ("With --barrier-url the run and learning flags are the barrier's (set them there); with --peer-list "
             "rank 0 hosts the barrier and uses its own.")


def flag(name: str) -> str:
    from mosaicd.settings import flag_name

    return flag_name(name)


def _add_settings_flags(parser: argparse.ArgumentParser, command: str) -> None:
    from enum import StrEnum

    from mosaicd.settings import OPTION_TABLES, Settings, needs_text

    sections = {}
    for group, names in groups().items():
        section = sections[group] = parser.add_argument_group(f"{group}: {GROUP_HELP[group]}")
        for name in names:
            if name not in applies()[command]:
                continue
            field = Settings.model_fields[name]
            value = field.get_default(call_default_factory=True)
            default = value.value if hasattr(value, "value") else value
            if name == "out" and command in ("cluster", "simulate"):  # a new folder per run (rundir.claim_out)
                default = "a new runs/<run id>-<UTC time>"
            needs = f" (needs {needs_text(name)})" if needs_text(name) else ""  # settings/effects.py
            help_text = f"{field.description or ''}{needs} [default: {default}; env MOSAIC_{name.upper()}]".lstrip()
            choices = [c.value for c in field.annotation] if isinstance(field.annotation, type) and issubclass(
                field.annotation, StrEnum) else None
            metavar = field.json_schema_extra.get("metavar")  # type: ignore[union-attr]
            if name in OPTION_TABLES:  # repeated: each a key=value (settings.task_options reads them)
                section.add_argument(flag(name), dest=name, action="append", default=None, metavar=metavar,
                                     help=help_text)
            elif field.annotation in (bool, bool | None):
                section.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                     help=help_text)
            else:
                section.add_argument(flag(name), dest=name, default=None,  # pydantic checks choices, naming the flag
                                     metavar=metavar or ("{" + ",".join(choices) + "}" if choices else name.upper()),
                                     help=help_text)
    sections["outputs"].add_argument("--config", type=Path, help="TOML file with settings (keys as the flags, '-' or "
                                     "'_')")


def refuse_unknown(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Unknown flags: one line naming the flag with a 'did you mean' or the subcommands a setting applies to, then
    where the flags are listed; not the usage (40 lines, with the hint under them)."""
    sub = subparsers(parser).get(command) if command else None
    target = sub or parser
    unknown = [w.split("=", 1)[0] for w in extra if w.startswith("-")] or extra  # the flags, not their values
    word = unknown[0]
    name = word.removeprefix("--").removeprefix("no-").replace("-", "_")
    if command in COMMANDS and name in _setting_names() and name not in applies()[command]:
        where = [c for c, names in applies().items() if name in names]
        refuse_flag(target, f"{flag(name)} does not apply to `mosaicd {command}` (it is a setting of: "
                    f"{', '.join(where)})")
    known = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(word, known, n=1)
    refuse_flag(target, f"unrecognized argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}"
                + (f" (did you mean {close[0]}?)" if close else ""))


def refuse_flag(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit 2 with `message` and a pointer to the flags' list, in two lines."""
    parser.exit(2, f"{parser.prog}: error: {message}\n{parser.prog} --help lists every flag\n")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers of `parser`, by name (none: {})."""
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


def _setting_names() -> set[str]:
    from mosaicd.settings import Settings

    return set(Settings.model_fields)


class _VersionAction(argparse.Action):
    """--version, looked up only when asked for (importlib.metadata takes a tenth of a second to import)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"mosaicd {_version()}")
        parser.exit(0)


ALL = "*"


def build_parser(command: str | None = ALL) -> argparse.ArgumentParser:
    """The `mosaicd` parser. `command`: the subcommand to give its flags (the others are only listed, so that
    nothing they need is imported); ALL: every one; None: none (`mosaicd --help`, `--version`)."""
    parser = argparse.ArgumentParser(prog="mosaicd", description="Mosaic Learning: decentralized learning with "
                                     "model fragmentation.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = (lambda name: True) if command == ALL else (lambda name: name == command)  # noqa: E731
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text + (". " + NODE_NOTE if name == "node" else ""))
        if not wanted(name):
            continue
        _add_settings_flags(p, name)
        if name in ("cluster", "simulate"):
            p.add_argument("--quiet", action="store_true", help="no progress line")
            p.add_argument("--resume", action="store_true", help="go on with the interrupted run in --out, exactly, "
                           "with its settings (cluster: the barrier's journal and the nodes' checkpoints, at any "
                           "ports; simulate: its last checkpoint)")
        if name == "cluster":
            from mosaicd.experiments.processes import PIN_CHOICES

            p.add_argument("--fail-fast", action="store_true", help="end the run when a node process dies (by "
                           "default it is reported, and the others go on without it)")
            p.add_argument("--pin-nodes", default="auto", metavar="{" + ",".join(PIN_CHOICES) + "}",
                           help="run each node process on one core, alternating over the cores this command may "
                           "use, the nodes of a core training one at a time: on; auto (the default) where the nodes "
                           "outnumber those cores; off: the kernel places them (two runs on the same cores: give "
                           "each its own with taskset, or off)")
    data = sub.add_parser("data", help=DATA_HELP, description=DATA_HELP)
    if wanted("data"):
        from mosaicd.settings import TaskName

        data.add_argument("action", choices=["fetch"])
        data.add_argument("dataset", metavar="TASK", choices=[t.value for t in TaskName])
        data.add_argument("--data-dir", type=Path, default=None, help="where data sets live [default: data]")
        data.add_argument("--url", default=None, help="a mirror: the folder URL holding the official archives "
                          "[default: env MOSAIC_DATA_URL, else the official sites]")
    for name, (module_name, help_text) in TOOLS.items():
        if not wanted(name):
            sub.add_parser(name, help=help_text)
            continue
        module = import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0]))
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    from mosaicd.settings import Settings

    flags: dict[str, Any] = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None)
                             is not None}
    return Settings.load(config=args.config, **flags)


def _print_final(summary: dict) -> None:
    from mosaicd.outputs import SUMMARY_KEYS

    final = summary.get("final") or {}
    out = summary["settings"]["out"]
    block = summary.get("asynchronous") or {}  # an asynchronous run: what stopped it, and each node's steps
    stops = {"stopped": block["stopped"], "steps": block.get("steps") or None,
             **({"stopped_by": block.get("stopped_by") or None} if " and " in str(block["stopped"]) else {})} \
        if block.get("stopped") else {}
    print(json.dumps({"out": out, **{k: final.get(k) for k in SUMMARY_KEYS}, "wall_s": summary.get("wall_s"),
                      **stops}))


def _command_of(argv: list[str]) -> str | None:
    """The subcommand argv names (its first word), if any; None for `mosaicd`, `--help`, `--version`."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def main(argv: list[str] | None = None) -> None:
    import signal

    # SIGTERM ends any command as Ctrl-C does, from its first moment (the roles then take it over): a process that
    # is PID 1 of a container, as mosaicd is in the image, would otherwise ignore it while it starts up, and
    # `docker stop` would wait its 10 s and kill it
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command has started (its imports): nothing was written
        raise SystemExit(130) from None
    finally:
        _forget_caught_interrupts()


def _forget_caught_interrupts() -> None:
    """The exit code is the one the command chose. CPython 3.11 marks an interrupt raised inside a string given to
    `exec` (Ctrl-C landing in a dataclass's generated methods as torch is imported) as never caught, and then ends
    the process by SIGINT (-2) whatever the command caught and returned; compiling and running a string clears that
    mark (run_eval_code_obj), and no interrupt escapes `main`."""
    exec("None")


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv.insert(0, "node")
    if _command_of(argv) == "node":  # its imports without garbage collections, until its task's are done too
        from mosaicd.daemon.node.warmup import collect_after_imports

        collect_after_imports()
    parser = build_parser(_command_of(argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        refuse_unknown(parser, args.command, extra)
    if args.command == "cluster":
        from mosaicd.experiments.processes import pin_refusal

        if (refused := pin_refusal(args.pin_nodes)) is not None:  # one line, as a setting's bad value; not the usage
            refuse_flag(subparsers(parser)["cluster"], refused)
    if args.command is None:
        parser.print_help()
        raise SystemExit(2)
    if args.command in TOOLS:
        run_tool(parser, args)
    from mosaicd.settings import Settings, SettingsError

    if args.command == "data":
        from mosaicd.learning.data import fetch

        try:
            fetch(args.dataset, args.data_dir or Settings.model_fields["data_dir"].default, base_url=args.url)
        except (ValueError, OSError) as exc:
            parser.exit(1, f"mosaicd data: error: {exc}\n")
        return
    if args.command == "node" and args.barrier_url:
        from mosaicd.settings import RunConfig

        given = [flag(n) for n in RunConfig.model_fields if getattr(args, n, None) is not None]
        if given:
            parser.exit(2, f"mosaicd node: error: {', '.join(given)}: with --barrier-url the run's settings are the "
                        "barrier's; give them to `mosaicd barrier`\n")
    checked = None
    try:
        settings = load_settings(args)
        if settings.own_loop and args.command != "barrier":
            raise SettingsError("--own-loop: the nodes of an own loop's run are mosaicd.Peer in your program; "
                                "`mosaicd barrier --own-loop` serves its barrier")
        async_node = args.command == "node" and settings.peer_list is not None and settings.barrier_url is None
        if args.command not in ("simulate", "cluster", "barrier") and not async_node \
                and str(settings.sync) != "barrier":
            raise SettingsError(f"--sync {settings.sync}: a node of a barrier takes the barrier's run (`mosaicd "
                                "barrier --sync async`); `mosaicd node --peer-list` runs asynchronously with no "
                                "barrier")
        if args.command == "barrier" and str(settings.sync) == "async" and settings.own_loop:
            raise SettingsError("--sync async: `mosaicd barrier --own-loop` serves Peers that gossip in rounds; an "
                                "asynchronous barrier collects the reports of `mosaicd node` daemons")
        if args.command == "cluster" and str(settings.sync) == "async":
            from mosaicd.experiments.cluster_async import refusal

            if (refused := refusal(settings, resume=args.resume)) is not None:
                raise SettingsError(refused)
        if args.command != "node" or settings.barrier_url is None:  # a node of a barrier takes the barrier's task
            from mosaicd.learning.tasks import check_task

            checked = check_task(settings.run_config(), settings.data_dir)  # a user's task: it builds, or one line
    except SettingsError as exc:
        parser.exit(2, f"mosaicd {args.command}: error: {exc}\n")
    from mosaicd.daemon.entry import run_entry
    from mosaicd.logs import configure_logging, json_logs

    level = settings.log_level
    if args.command in ("barrier", "node") and not json_logs(settings.log_json) and level in ("debug", "info"):
        level = "warning"  # its console says what happens (barrier/ and node/console.py); the log, what goes wrong
    configure_logging(level, settings.log_json, log_files(args.command, settings))
    task = checked if args.command == "simulate" else None  # other commands' processes build their own
    del checked
    code = run_entry(args.command, lambda: run_command(args, settings, task))
    if args.command in ("node", "barrier"):
        from mosaicd.daemon.entry import end_process

        end_process(code)  # at once, as it ends: a container told to stop is gone within 2 s
    raise SystemExit(code)


def run_tool(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A tool's `main(args)`; its errors end in one line (exit 2: a usage error, 1: anything else)."""
    if args.command not in QUIET_TOOLS:
        from mosaicd.logs import configure_logging

        configure_logging()
    try:
        raise SystemExit(import_module(TOOLS[args.command][0]).main(args))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BrokenPipeError:  # `mosaicd log RUN | head`: the reader has what it wanted; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None
    except (ValueError, OSError) as exc:
        settings = sys.modules.get("mosaicd.settings")  # a SettingsError only where settings were imported
        usage = settings is not None and isinstance(exc, settings.SettingsError)  # a spec or flag the user wrote
        parser.exit(2 if usage else 1, f"mosaicd {args.command}: error: {exc}\n")


def log_files(command: str, settings: Settings) -> dict[str, Path] | None:
    """The log files of a node or barrier (`logs.ToFiles`): --log-file's, and rank 0 of a --peer-list's in its
    OUT/logs/ (barrier.log, node-0.log: as `cluster` leaves them, for `mosaicd log` and `mosaicd runs`)."""
    files: dict[str, Path] = {}
    if command in ("node", "barrier") and settings.log_file is not None:
        files["*"] = Path(settings.log_file)
    if command == "node" and settings.peer_list is not None and settings.barrier_url is None:
        from mosaicd.daemon.http.membership import listed_addresses, own_address

        options = settings.daemon_options()
        try:
            rank0 = listed_addresses(options)[0] == own_address(options, options.port)
        except (ValueError, OSError):  # said in one line once the node starts (check_peer_list)
            rank0 = False
        if rank0:
            files.update(barrier=Path(settings.out) / "logs" / "barrier.log",
                         node=Path(settings.out) / "logs" / "node-0.log")
    return files or None


def check_peer_list(settings: Settings) -> None:
    """A node of a peer list: the file (ValueError naming its line) and the run it makes with its members counted
    (SettingsError worded as `cluster` words a bad --nodes) checked before anything starts, on every member."""
    from mosaicd.daemon.http.membership import listed_addresses
    from mosaicd.settings import SettingsError

    assert settings.peer_list is not None
    addresses = listed_addresses(settings.daemon_options())  # ValueError naming the file and line, or this node
    try:
        settings.run_config().with_nodes(len(addresses))
    except SettingsError as exc:
        raise SettingsError(f"--peer-list {settings.peer_list} lists {len(addresses)} nodes: {exc}") from None


def _interrupt(signum: int, frame: Any) -> None:
    import signal

    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_command(args: argparse.Namespace, settings: Settings, task: Any = None) -> int:
    """The command's run; `task`: the user's task `check_task` built (simulate runs it rather than build another)."""
    if args.command in ("node", "barrier"):
        from mosaicd.daemon.entry import exit_promptly

        exit_promptly()  # told to stop, it exits within 2 s (`entry.exit_within`)
    if args.command == "node":
        if settings.nodes_per_process > 1:  # members forked after the imports, each a node of the barrier's
            from mosaicd.experiments.warm import run_group
            return run_group(settings)
        if settings.peer_list is not None:
            check_peer_list(settings)
        if str(settings.sync) == "async":  # a peer list's member (main refuses any other node)
            from mosaicd.daemon.loop import run
            from mosaicd.daemon.node.async_run import run_peer_list_node
            return run(run_peer_list_node(settings), settings.event_loop)
        from mosaicd.daemon.embedded import run_node  # the node role, hosting the barrier as a peer list's rank 0
        from mosaicd.daemon.loop import run
        return run(run_node(settings), settings.event_loop)
    if args.command == "barrier":
        from mosaicd.daemon.barrier.run import run_barrier
        from mosaicd.daemon.loop import run
        return run(run_barrier(settings), settings.event_loop)
    if args.command in ("cluster", "simulate"):
        import signal

        signal.signal(signal.SIGTERM, _interrupt)  # ends as Ctrl-C does: a failed summary, a resumable folder
    if args.command == "cluster" and str(settings.sync) == "async":
        from mosaicd.experiments.cluster import ClusterFailed
        from mosaicd.experiments.cluster_async import run_cluster_async
        try:
            _print_final(run_cluster_async(settings, progress=not args.quiet, replace=settings.replace,
                                           fail_fast=args.fail_fast, pin=args.pin_nodes))
        except ClusterFailed as exc:
            print(f"mosaicd cluster: error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "cluster":
        from mosaicd.experiments.cluster import ClusterFailed, run_cluster
        try:
            _print_final(run_cluster(settings, progress=not args.quiet, fail_fast=args.fail_fast,
                                     resume=args.resume, replace=settings.replace, pin=args.pin_nodes))
        except ClusterFailed as exc:
            print(f"mosaicd cluster: error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "simulate":
        from mosaicd.experiments.simulate import run_simulation

        _print_final(run_simulation(settings, progress=not args.quiet, resume=args.resume, replace=settings.replace,
                                    task=task))
        return 0
    raise AssertionError(args.command)
