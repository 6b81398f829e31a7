"""Warm start of a local cluster: the barrier process pays imports, data, task and torch's warm-up once, then forks
the nodes from that state.

`mosaicd cluster` starts `python -m mosaicd.experiments.warm` as the barrier (its MOSAIC_* environment is the
barrier's) and writes the nodes to start on its stdin, one JSON object: {"children": [{"name", "log", "env"}]}
(`env`: each node's MOSAIC_* variables; `cores`, where given: the cores it runs on). This process then

1. builds the run's task (data loaded and partitioned, model built: nothing in it depends on the rank) and warms
   torch up with one thread (`daemon.warmup`: no OpenMP pool exists at the fork), freezes the GC's objects so
   that the children's collections do not copy the shared pages;
2. forks one child per node: it dies with this process (PDEATHSIG), writes to its own log, runs on the cores it
   is given (`--pin-nodes`: `processes.node_cores`; nodes that share a core train one at a time, passing a token
   in a pipe of that core's made here: `core_turns`), takes its own MOSAIC_* environment, sets the run's torch
   threads and runs `run_node` as `mosaicd node` does, with the prebuilt task (`run_node` uses it only if the
   registered run is the one it was built for); it makes its own event loop, thread pool and sockets, so the nodes
   are separate processes talking HTTP as before. Each keeps the listening socket the launcher handed down for it
   (`http.server.LISTEN_FD`, in its `env`) and closes the others'; this process keeps only the barrier's;
3. runs the barrier (`run_barrier`, evaluating with the same prebuilt task), reaps the nodes and reports each
   one's pid and exit status as JSON lines on the file descriptor named by MOSAIC_WARM_REPORT_FD; on SIGTERM it
   passes the signal to the nodes, reaps them, and dies of it.

`mosaicd node --nodes-per-process N` (`run_group`: compose's MOSAIC_NODES_PER_CONTAINER) forks its nodes the same
way, from the process that paid the node's and its task's imports: member I has its own port, port file, state
folder and address (`DaemonOptions.member_fields`), registers with the barrier as a node of its own, and writes to
the process's console. The parent passes SIGTERM and SIGINT on (each member leaves the run as a node does), says on
the console which member ended with an error (the others go on: the barrier decides), and exits once all have, with
the first error's status (0 where none), as one node would.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, NoReturn

from mosaicd.daemon.entry import run_entry
from mosaicd.daemon.http.server import LISTEN_FD, ListenError, handed_socket
from mosaicd.daemon.loop import loop_factory, run
from mosaicd.daemon.node.core_turn import TOKEN, take_turns
from mosaicd.daemon.node.warmup import imports_done, set_threads, warm_up
from mosaicd.experiments.processes import REPORT_FD, STOP_GRACE_S, Children, die_with_parent, exit_text, pin_to
from mosaicd.logs import configure_logging, get_logger
from mosaicd.settings import Settings, SettingsError

REAP_DEADLINE_S = 60.0  # after the barrier's end, how long nodes may take to exit before they are killed
GROUP_STOP_S = 5.0  # a node group told to stop: how long its members may take to leave and exit (Docker waits 10)


def run_role(command: str, task: Any = None, sock: socket.socket | None = None,
             tell: Callable[[str], None] | None = None, settings: Settings | None = None) -> int:
    """What `mosaicd node` / `mosaicd barrier` do once the settings are in the environment, with the same errors
    and exit codes (cli.main's), given a prebuilt task (and the barrier's listening socket). `tell`: the error
    line also goes there (the report pipe: the log it is printed to may be on the disk that filled). `settings`:
    a node group's member's, its logging the parent's (configured by `mosaicd node`)."""
    if settings is None:
        try:
            settings = Settings.load()
        except SettingsError as exc:
            print(f"mosaicd {command}: error: {exc}", file=sys.stderr)
            return 2
        configure_logging(settings.log_level, settings.log_json)
    if command == "node":
        from mosaicd.daemon.node.run import run_node

        return run_entry(command, lambda: run(run_node(settings, task=task), settings.event_loop), tell)
    from mosaicd.daemon.barrier.run import run_barrier

    return run_entry(command, lambda: run(run_barrier(settings, task=task, sock=sock), settings.event_loop), tell)


def _child(child: dict[str, Any], task: Any, listening: socket.socket | None, parent: int, report: int, *,
           turns: Collection[int] = (), handed: Collection[int] = ()) -> NoReturn:
    """A forked node: never returns into the barrier's code. `child`: a cluster's node (its log and MOSAIC_*
    environment) or a node group's member (its `settings`; it writes to the group's console). `turns`: the cores'
    turn pipes' ends (`core_turns`), of which it keeps its own core's ("turn": its ends and how many nodes share it).
    `handed`: the nodes' listening sockets the launcher handed down, of which it keeps its own (its `LISTEN_FD`)."""
    if listening is not None:
        listening.close()  # the barrier's
    for fd in turns:
        if fd not in child.get("turn", ())[:2]:
            os.close(fd)
    own = child.get("env", {}).get(LISTEN_FD)
    for fd in handed:
        if str(fd) != own:
            os.close(fd)
    code = 1
    try:
        die_with_parent()
        if os.getppid() != parent:  # the barrier died before prctl: no orphan
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # not a node group's parent's
        if "cores" in child:  # before any thread starts: every thread of the node inherits it
            pin_to(child["cores"])
        if "turn" in child:  # its core's, shared with the nodes pinned to it
            take_turns(*child["turn"])
        if "log" in child:
            mode = os.O_APPEND if child.get("append") else os.O_TRUNC  # a resumed run's log goes on
            log = os.open(child["log"], os.O_WRONLY | os.O_CREAT | mode, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
        if "env" in child:
            for name in [n for n in os.environ if n.startswith("MOSAIC_")]:
                del os.environ[name]
            os.environ.update(child["env"])
        if task is not None:
            set_threads(task.run.threads)
        code = run_role("node", task, tell=partial(Children(report).error, child["name"]),
                        settings=child.get("settings"))
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def prebuild(settings: Settings) -> Any:
    """The run's task, built and warmed up; None where it cannot be (each node then builds its own, and reports
    why it cannot) or must not be (an accelerator: CUDA does not survive fork())."""
    from mosaicd.learning.tasks import build_task

    run = settings.run_config()
    log = get_logger(role="barrier")
    if str(getattr(run, "device", "cpu")) != "cpu":
        log.info("warm_start", prebuilt=False, reason=f"device {run.device}")
        return None
    started = time.perf_counter()
    try:
        task = build_task(run, settings.data_dir)
        task.initial(0)  # the model and its initial vector
        warm_up(task)
    except Exception as exc:  # noqa: BLE001 - the nodes build it again and say what is wrong
        log.warning("warm_start", prebuilt=False, reason=f"{type(exc).__name__}: {exc}")
        return None
    try:
        warm_protocol(run, task.layout)
    except ValueError:  # a run the model cannot be cut into (K above its size): each node says so as it starts
        pass
    log.info("warm_start", prebuilt=True, task=str(run.task), seconds=round(time.perf_counter() - started, 3))
    return task


def warm_protocol(run: Any, layout: Any) -> None:
    """What every node computes alike as its run starts, once here: the fragmentation's build (its numpy paths, the
    first time in a process) and the sampler's check of its picks against numpy's (once per process), which a forked
    node would otherwise pay for after registering, in round 0 (bench/README.md, issue 59 item 3)."""
    from mosaic_proto.fragmentation import Fragmentation
    from mosaic_proto.keyed_choice import matches_numpy

    Fragmentation.build(layout, run.fragments, run.seed, run.strategy)
    matches_numpy()


def core_turns(children: list[dict[str, Any]]) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """(core,) -> (the read and write ends of a pipe holding one token, how many nodes share that one core), where
    two or more do: the turn they take computing (`daemon/node/core_turn.py`)."""
    shared = Counter(tuple(child["cores"]) for child in children if len(child.get("cores", ())) == 1)
    turns = {}
    for cores, count in shared.items():
        if count > 1:
            read, write = os.pipe()
            os.write(write, TOKEN)
            turns[cores] = (read, write, count)
    return turns


def run_group(settings: Settings) -> int:
    """`mosaicd node --nodes-per-process N`: the node's imports paid here once, then N members forked (see the
    module's docstring); the exit status one node would have had."""
    from mosaicd.learning.tasks import import_task_modules

    read, write = os.pipe()
    children = Children(write)
    stop_by: list[float] = []

    def stop(signum: int, _frame: Any) -> None:
        if not stop_by:
            stop_by.append(time.monotonic() + GROUP_STOP_S)
        children.signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):  # also while importing: PID 1 of a container ignores the default
        signal.signal(signum, stop)
    import_task_modules(settings.task)  # only its modules: the run, and so the task, is the barrier's
    import mosaicd.daemon.node.run  # noqa: F401 - imported once, here, for every member
    loop_factory(settings.event_loop)
    imports_done()
    gc.collect()
    gc.freeze()
    count = settings.nodes_per_process
    members = [settings.model_copy(update=settings.member_fields(i)) for i in range(count)]
    if stop_by:  # told to stop before any member started: as a node told to stop before it registered
        return 0
    for i, member in enumerate(members):
        children.fork(str(i), partial(_child, {"name": str(i), "settings": member}, None, None))
    children.start_reaping()
    if stop_by:  # told while forking: those forked since hear it too
        children.signal(signal.SIGTERM)
    codes: dict[str, int] = {}
    said: dict[str, str] = {}
    pending = b""
    while len(codes) < count:
        if stop_by and time.monotonic() > stop_by[0]:
            children.signal(signal.SIGKILL)  # past the deadline: Docker would kill the lot soon anyway
            stop_by[0] = float("inf")
        if not select.select([read], [], [], 1.0)[0]:
            continue
        pending += os.read(read, 65536)
        *lines, pending = pending.split(b"\n")
        for line in lines:
            message = json.loads(line)
            name = str(message["name"])
            if "error" in message:
                said[name] = str(message["error"])
            elif "exit" in message:
                codes[name] = int(message["exit"])
                if codes[name] != 0 and not stop_by:
                    going = count - len(codes)
                    print(f"mosaicd node: member {name} of {count} ({member_address(members[int(name)])}) "
                          f"ended: {said.get(name) or exit_text(codes[name])}"
                          + (f"; {going} other member{'s go' if going > 1 else ' goes'} on" if going else ""),
                          file=sys.stderr, flush=True)
    failed = next((code for code in codes.values() if code != 0), 0)
    return 128 - failed if failed < 0 else failed


def member_address(settings: Settings) -> str:
    """Where a member listens, for the console: its port, or the one its port file holds (`earlier_port`)."""
    from mosaicd.daemon.http.server import earlier_port

    if port := earlier_port(settings.daemon_options()):
        return f"{settings.host}:{port}"
    return "port not yet bound" if settings.port_file is None else f"port in {settings.port_file}: none yet"


def main() -> NoReturn:
    spec = json.loads(sys.stdin.buffer.read() or b"{}")
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, as the nodes' stdin
    children = Children(int(os.environ.pop(REPORT_FD)))
    try:
        settings = Settings.load()
    except SettingsError as exc:
        print(f"mosaicd barrier: error: {exc}", file=sys.stderr)
        os._exit(2)
    configure_logging(settings.log_level, settings.log_json)
    task = prebuild(settings)
    # imported once, here, for every node and the barrier: a module a child imported after the fork would be paid
    # for once per node, while the run goes on (bench/README.md, issue 59 item 3); the codec its first connection to
    # a host name needs too
    import encodings.idna  # noqa: F401

    import mosaicd.daemon.barrier.run  # noqa: F401
    import mosaicd.daemon.node.run  # noqa: F401
    loop_factory(settings.event_loop)  # uvloop too, where it runs the roles

    try:  # the launcher's, listening already: the nodes' registrations wait in its backlog while the barrier starts
        listening = handed_socket(settings.daemon_options())
    except ListenError as exc:
        print(f"mosaicd barrier: error: {exc}", file=sys.stderr)
        os._exit(1)
    turns = core_turns(spec.get("children", []))
    gc.collect()
    gc.freeze()  # the objects made so far stay where they are: shared with the nodes, not copied by their GC
    pipes = [fd for read, write, _ in turns.values() for fd in (read, write)]
    handed = [int(child["env"][LISTEN_FD]) for child in spec.get("children", []) if LISTEN_FD in child.get("env", {})]
    for child in spec.get("children", []):
        turn = turns.get(tuple(child.get("cores", ())))
        children.fork(child["name"], partial(_child, {**child, "turn": turn} if turn is not None else child, task,
                                             listening, turns=pipes, handed=handed))
    for fd in [*pipes, *handed]:  # the nodes' own: a node that ended leaves no backlog here to connect to
        os.close(fd)
    children.start_reaping()

    def terminate(signum: int, _frame: Any) -> None:
        children.signal(signum)
        children.end(STOP_GRACE_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, terminate)
    code = 1
    try:
        code = run_role("barrier", task, listening, tell=partial(children.error, "barrier"))
    finally:
        if code == 130:  # stopped (SIGTERM, which the barrier takes as Ctrl-C, or Ctrl-C): so are its nodes
            children.signal(signal.SIGTERM)
        children.end(REAP_DEADLINE_S)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
