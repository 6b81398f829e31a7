"""How every entry point ends (`mosaicd node|barrier|cluster|simulate`, and the warm start's forked roles): an
error a user can act on is one line on stderr and exit 1, Ctrl-C is 130; only bugs leave a traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from mosaicd.daemon.errors import OutputError, PeerDropped, RunEnded, RunInterrupted
from mosaicd.daemon.http.client import HttpError
from mosaicd.daemon.http.server import ListenError
from mosaicd.settings import SettingsError

# HttpError: a peer answered 4xx or stayed unreachable; PeerDropped: the barrier dropped this node; ListenError: the
# port or address to listen on cannot be had
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, TimeoutError, HttpError, PeerDropped,
                                                RunEnded, OutputError, ListenError)


def run_entry(command: str, main: Callable[[], int], tell: Callable[[str], None] | None = None) -> int:
    """`main()`'s exit code, or the one its error means (printed as `mosaicd COMMAND: error: ...`; a run a person
    stopped, `RunInterrupted`, as `mosaicd COMMAND: ...` and 130). `tell`: the same line also goes there (a
    launcher's pipe: the log the line is printed to may be on a full disk)."""
    try:
        return main()
    except KeyboardInterrupt:
        return 130
    except RunInterrupted as exc:  # stopped, not failed: no error, and the run resumes (docs/faults.md)
        _say(f"mosaicd {command}: {exc}", tell)
        return 130
    except SettingsError as exc:  # the settings or the peer list the user wrote: a usage error
        _say(f"mosaicd {command}: error: {exc}", tell)
        return 2
    except USER_ERRORS as exc:
        _say(f"mosaicd {command}: error: {exc}", tell)
        return 1


def _say(line: str, tell: Callable[[str], None] | None) -> None:
    print(line, file=sys.stderr)
    if tell is not None:
        tell(line)


# A process told to stop (SIGTERM, Ctrl-C) exits within this, whatever it still waits for: a worker thread in the
# middle of a round's training (which nothing can interrupt, and which the interpreter would wait for at exit), a
# request to a slow peer or barrier. Docker kills a container 10 s after SIGTERM; a restarted node rejoins sooner.
EXIT_WITHIN_S = 1.5
_exit_promptly = False


def exit_promptly() -> None:
    """This process is a `mosaicd` command's (not a program that uses the roles as a library): `exit_within` may
    end it."""
    global _exit_promptly
    _exit_promptly = True


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def end_process(code: int) -> NoReturn:
    """A role's process (`mosaicd node`, `barrier`) whose run is over ends here, its output flushed: not waiting for
    a worker thread still in a round's training (a node told to stop) nor for the interpreter's teardown of torch
    and its threads, which on a loaded host put a container told to stop past Docker's patience (bench/stop_exit.py
    measures it). Its
    files are written and closed by then (log lines open their file each time, checkpoints are replaced whole)."""
    _flush()
    os._exit(code)


def told_to_stop(code: int) -> int:
    """A role told to stop has done what it must (left the run, closed its server): a command's process ends now
    (`end_process`), before its event loop waits for a worker thread still in a round's training; elsewhere (the
    roles as a library) `code` comes back."""
    if _exit_promptly:
        end_process(code)
    return code


def exit_within(code: Callable[[], int], seconds: float = EXIT_WITHIN_S) -> None:
    """Told to stop: unless the process has ended by then, end it after `seconds` with `code()` (the output
    flushed; worker threads not waited for). Nothing where the process is not a command's (`exit_promptly`)."""
    if not _exit_promptly:
        return

    def end() -> None:
        end_process(code())
    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


def on_signals(work: asyncio.Future, code: int = 0) -> list[str]:
    """SIGTERM and SIGINT cancel `work` (the node then leaves the run); the list gets the signal's name. The process
    ends within `EXIT_WITHIN_S` (with `code` if it has not ended by then)."""
    loop, seen = asyncio.get_running_loop(), []

    def stop(signum: signal.Signals) -> None:
        if not seen:
            seen.append(signum.name)
            work.cancel()
            exit_within(lambda: code)  # it leaves the run meanwhile; a round's training is not waited for
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signum)
    return seen
