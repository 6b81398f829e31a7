"""The barrier process (`mosaicd barrier`): the `Barrier`, its app, served until the run ends."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from mosaic_proto import STOP_HOLD_S
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.collector import collect_run
from mosaicd.daemon.barrier.console import BarrierConsole, local_url
from mosaicd.daemon.barrier.evaluator import NetworkEvaluation
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.entry import EXIT_WITHIN_S, exit_within
from mosaicd.daemon.errors import RunEnded
from mosaicd.daemon.http.auth import Secret, check_listen, own_secret_file
from mosaicd.daemon.http.server import check_port, handed_socket, serve
from mosaicd.daemon.http.tls import scheme
from mosaicd.daemon.loop import loop_name
from mosaicd.logs import also_log_to, get_logger, json_logs, say
from mosaicd.outputs import MODE_ENV
from mosaicd.rundir import BARRIER_LOCK, release
from mosaicd.settings import Settings

EVALUATION_SETTLE_S = 10.0  # a run that stopped early waits this long at most for the rows of evaluations under way


async def run_barrier(settings: Settings, task: Any = None, sock: Any = None) -> int:
    """Serve the barrier until the run ends; 0 if it finished. `task`: a prebuilt one (the warm start's), used
    for evaluation if it is the run's; `sock`: a socket already listening (the warm start binds it early)."""
    from mosaicd.learning.tasks import require_task

    if evaluates(settings, task):  # it evaluates the average model: say now, not at the first evaluation, if it cannot
        require_task(settings.task)
    if settings.secret_file is None and not settings.insecure:  # secure by default, loopback too
        settings = own_secret(settings)
    secret = Secret.of(settings)  # resolved once, here: the Barrier and its checks get this value
    # where it cannot listen, say so before the Barrier opens its outputs (keeping an earlier run aside...)
    check_listen(settings, secret.keyring())
    if sock is None:
        sock = handed_socket(settings.daemon_options())  # its launcher's: the port is held already
    if sock is None:
        check_port(settings.daemon_options())
    stopped: list[str] = []  # SIGTERM (`docker stop`, `kill`) ends the barrier as Ctrl-C does: resumable, said so
    main = asyncio.current_task()

    def terminated() -> None:
        stopped.append("SIGTERM")
        exit_within(lambda: 130)  # stopped, whatever it waits for (exits 0 itself when the run had ended)
        if main is not None:
            main.cancel()
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminated)
    except (RuntimeError, ValueError):  # an event loop outside the main thread (a program's own): no signals
        pass
    try:
        return await serve_barrier(settings, secret, task, sock, stopped)
    except asyncio.CancelledError:
        if stopped:
            raise KeyboardInterrupt("SIGTERM") from None
        raise
    finally:
        release(settings.out / BARRIER_LOCK)


def own_secret(settings: Settings) -> Settings:
    """No --secret-file, no --insecure: the barrier's own secret (OUT.secret, `auth.own_secret_file`), and how to
    hand it to the nodes, said once on stderr (the path only, never the secret)."""
    path, made = own_secret_file(settings.out)
    say(f"mosaicd barrier: cluster secret {path} ({'made now' if made else 'kept from an earlier start'}, mode "
        f"600): give every node --secret-file {path} (MOSAIC_SECRET_FILE; copy it to other hosts), or start the "
        "barrier with --secret-file, or --insecure for none", "secret_file", path=str(path))
    return settings.model_copy(update={"secret_file": path})


async def serve_barrier(settings: Settings, secret: Secret, task: Any, sock: Any, stopped: list[str]) -> int:
    evaluate = NetworkEvaluation(settings.data_dir, task) if evaluates(settings, task) else None
    if evaluate is not None:
        evaluate.import_modules(settings.task)  # while the nodes start: their training leaves it little CPU later
    barrier = Barrier(settings.run_config(), settings.daemon_options(), secret=secret, evaluate=evaluate,
                      hold_out=True, mode=os.environ.get(MODE_ENV, "barrier"))
    if settings.log_file is None:  # by hand too, its log where `cluster` leaves it, once OUT is its own
        also_log_to(settings.out / "logs" / "barrier.log")
    check_listen(settings, barrier.keyring, barrier=True)  # its warning, once the run in --out is known to be ours
    runner, port = await serve(barrier_app(barrier), settings, sock)
    get_logger(role="barrier").info("listening", host=settings.host, port=port, expected=barrier.state.expected,
                                    event_loop=loop_name())
    console = None if json_logs(settings.log_json) else asyncio.ensure_future(
        BarrierConsole(barrier, local_url(settings.host, port, scheme(settings))).run())
    # --sync async: no rounds; once the roster is made the barrier collects the members' reports (collector.py)
    collecting = asyncio.ensure_future(collect_run(barrier, settings)) if str(settings.sync) == "async" else None
    try:
        await barrier.done.wait()
        await barrier.settle(EVALUATION_SETTLE_S)  # failed or interrupted: the rows of evaluations under way
        if console is not None:
            await console
        # a run its members stopped stays a moment, so that every member told to stop is heard and counted
        await asyncio.sleep(max(settings.linger, STOP_HOLD_S if barrier.stopped_by_members() else 1.0))
    except asyncio.CancelledError:  # Ctrl-C, or SIGTERM
        barrier.interrupt()
        if not barrier.done.is_set():
            interrupted(barrier, stopped[0] if stopped else "Ctrl-C")
            await barrier.settle(EXIT_WITHIN_S * 2 / 3)  # the rows of evaluations under way, before the process ends
            raise
        if not stopped or console is not None and not console.done():
            raise
        # SIGTERM while it lingered after the run's end (`compose down`): it exits as the run ended, not 130
    finally:
        if collecting is not None:
            collecting.cancel()
        await runner.cleanup()
    if barrier.stopped_by_members():  # its members were told to stop: interrupted, as by Ctrl-C, resumable
        return 130
    if barrier.output_error is not None:  # ended early (a write that failed): one line, naming the path
        raise RunEnded(barrier.output_error)
    collected = barrier.ending.collected
    return 0 if barrier.state.phases.finished or collected and collected.get("status") == "finished" else 1


def evaluates(settings: Settings, task: Any = None) -> bool:
    """Whether the barrier evaluates the average model (the nodes evaluate their own): whenever it has the run's
    task, given or the default one, as `cluster` and `simulate` do; an own loop's run (--own-loop) has none, and
    only combines what its nodes report (`mosaicd.Barrier(evaluate=...)` gives it one)."""
    return task is not None or not settings.own_loop


def interrupted(barrier: Barrier, how: str) -> None:
    """Ctrl-C before the run ended: the summary says so (not "running" for good) and the console how to go on. The
    journal stays at the last decision and the nodes are not told: started again, the barrier resumes the run, and
    nodes still retrying (--barrier-grace) carry on with it; an asynchronous run's members train on meanwhile, and
    the barrier started again collects their reports."""
    state, options = barrier.state, barrier.options
    if not barrier.interrupted(how):  # its summary says finished (or failed) already: so it stays
        return
    if not state.phases.goes_on:
        say(f"mosaicd barrier: {options.out}: interrupted while nodes registered; the same command starts the run "
            "again", "interrupted")
        return
    if str(barrier.run.sync) == "async":  # on no data path: its members train on, and wait for it once done
        say(f"mosaicd barrier: {options.out}: interrupted while its members train (asynchronous: they go on without "
            f"it); the same command (--out {options.out}) collects the run; a member that is done waits for it up "
            "to its --register-deadline", "interrupted")
        return
    say(f"mosaicd barrier: {options.out}: interrupted with {state.round} of {barrier.run.rounds} rounds done; the same "
        f"command (--out {options.out}) resumes the run; its nodes wait for it --barrier-grace "
        f"{options.barrier_grace:g}s", "interrupted", round=state.round)
