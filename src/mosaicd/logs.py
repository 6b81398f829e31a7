"""structlog setup: lines for people (the default, on a terminal or not), or JSON lines for log shippers
(--log-json, MOSAIC_LOG_JSON=true). The lines for people fold repeated warnings: one line per kind (its event)
every WARN_EVERY_S, which says how many were folded since the last; JSON logs keep every line."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

# structlog.dev imports rich (and pygments) when installed, only to draw tracebacks, which format_exc_info below
# renders already: hidden while structlog is imported, so that a node or barrier does not import it (~0.1 s).
_rich_hidden = sys.modules.setdefault("rich", None) is None  # type: ignore[arg-type]
import structlog  # noqa: E402

if _rich_hidden:
    del sys.modules["rich"]  # importable again, for those who draw with it (status, progress)


class StderrLogger(structlog.WriteLogger):
    """Writes log lines to stderr. A line that cannot be written (a full disk under a log file) raises one OSError
    naming the file, so the process's run ends clearly; later lines are dropped instead of failing each caller.
    structlog's WriteLogger, not its PrintLogger: a line and its newline go out in one write. `print` writes them
    apart, and on an unbuffered stderr (the images' PYTHONUNBUFFERED) a process killed between the two left a line
    without its end, to which the next process writing the same file (a node started again) joined its first line."""

    failed = False

    def msg(self, message: str) -> None:
        if StderrLogger.failed:
            return
        try:
            super().msg(message)
        except OSError as exc:
            StderrLogger.failed = True
            raise OSError(exc.errno, exc.strerror, _stderr_path()) from None

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


def _stderr_path() -> str:
    """The file stderr writes to (Linux /proc), for the error that says it could not."""
    try:
        return os.readlink("/proc/self/fd/2")
    except OSError:
        return "stderr"


def json_logs(json: bool | None) -> bool:
    """--log-json as given; by default lines for people, on a terminal or not (a container's console, a log
    file): JSON only when asked for."""
    return bool(json)


WARN_EVERY_S = 10.0  # lines for people: at most one warning line of each kind this often


class FoldRepeats:
    """A structlog processor for the console of people: a warning of a kind (its event name) already said within
    the last `every` seconds is dropped and counted; the next one said carries `folded=N` (those dropped since
    the line before). Errors and lines of other levels pass as they are."""

    def __init__(self, every: float = WARN_EVERY_S, clock: Any = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self.said: dict[str, float] = {}
        self.folded: dict[str, int] = {}

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("level") not in ("warning", "warn"):
            return event
        kind, now = str(event.get("event")), self.clock()
        said = self.said.get(kind)
        if said is not None and now - said < self.every:
            self.folded[kind] = self.folded.get(kind, 0) + 1
            raise structlog.DropEvent
        self.said[kind] = now
        folded = self.folded.pop(kind, 0)
        if folded:
            event["folded"] = f"{folded} more since the last (one line per {self.every:g}s)"
        return event


class ToFiles:
    """A structlog processor that appends every event, as a JSON line, to a log file: `files["barrier"]` the
    barrier's (role=barrier), `files["node"]` the others', `files["*"]` (any key starting with "*") all. Each line
    opens the file anew (a few lines a second): a folder moved aside (an earlier run's, `rundir.keep_earlier_run`)
    does not take later lines with it. A file that cannot be written is left alone (the console still says what
    happens)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.render = structlog.processors.JSONRenderer()

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        role = "barrier" if event.get("role") == "barrier" else "node"
        paths = {path for key, path in self.files.items() if key == role or key.startswith("*")}
        if paths:
            line = self.render(logger, method, dict(event)) + "\n"
            for path in paths:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path, "a", encoding="utf-8") as f:
                        f.write(line)
                except OSError:
                    pass
        return event


class AtLeast:
    """Drops the events below `level` (the console's, where log files take more)."""

    def __init__(self, level: str) -> None:
        self.level = getattr(logging, level.upper())

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if getattr(logging, str(event.get("level", "info")).upper(), logging.INFO) < self.level:
            raise structlog.DropEvent
        return event


_JSON_LINES = [False]  # whether configure_logging made the console JSON lines (what `say` follows)


def say(text: str, event: str, **fields: object) -> None:
    """A line for the person who started the process (how to go on, where a secret lies): on stderr as it is, or,
    where the console is JSON lines (--log-json), a JSON line of its own with the text as `detail`."""
    if _JSON_LINES[0]:
        structlog.get_logger().warning(event, detail=text, **fields)
    else:
        print(text, file=sys.stderr, flush=True)


class LibraryRecords(logging.Handler):
    """The standard library's log records (aiohttp's "Error handling request" with its traceback, asyncio's) as
    lines of this process's log: through the same processors, so one JSON line each under --log-json (the traceback
    in its `exception` field), not plain text among them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            log = structlog.get_logger().bind(logger=record.name)
            method = getattr(log, record.levelname.lower(), log.warning)
            method(record.getMessage(), **({"exc_info": record.exc_info} if record.exc_info else {}))
        except Exception:  # noqa: BLE001 (logging must not raise: the standard library's own rule)
            self.handleError(record)


def configure_logging(level: str = "info", json: bool | None = None, files: dict[str, Path] | None = None) -> None:
    """The console at `level` (JSON lines or lines for people); `files`: log files (`ToFiles`) that take every
    line of info and up, whatever the console's level."""
    json = json_logs(json)
    _JSON_LINES[0] = json
    _TO_FILES[0] = to_files = ToFiles(dict(files or {}))
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    least = min(getattr(logging, level.upper()), logging.INFO) if files else getattr(logging, level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            to_files, AtLeast(level),  # with no files, neither does anything (`also_log_to` may add one)
            *([] if json else [FoldRepeats()]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(least),
        logger_factory=lambda *_: StderrLogger(sys.stderr),  # the stderr of the moment (pytest swaps it)
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, LibraryRecords)]:
        root.removeHandler(handler)
    root.addHandler(LibraryRecords())
    root.setLevel(logging.WARNING)  # the libraries' warnings and errors (aiohttp's access log stays off)


_TO_FILES: list[ToFiles | None] = [None]  # configure_logging's, which `also_log_to` adds a file to


def also_log_to(path: Path) -> None:
    """From now on every line (info and up) also goes to `path`, as the files `configure_logging` was given: a
    by-hand barrier's OUT/logs/barrier.log, opened once it holds OUT. Not where this process's output already goes
    there (a cluster's barrier, whose output the cluster writes to that file)."""
    try:
        if os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(path)):
            return
    except (OSError, ValueError):
        pass
    if _TO_FILES[0] is not None:  # the loggers already bound hold this processor: they write there too
        _TO_FILES[0].files[f"*{path}"] = path


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
