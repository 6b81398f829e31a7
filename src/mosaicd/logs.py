"""structlog setup: JSON lines when not on a terminal, readable lines on one."""

from __future__ import annotations

import logging
import os
import sys

# structlog.dev imports rich (and pygments) when installed, only to draw tracebacks, which format_exc_info below
# renders already: hidden while structlog is imported, so that a node or barrier does not import it (~0.1 s).
_rich_hidden = sys.modules.setdefault("rich", None) is None  # type: ignore[arg-type]
import structlog  # noqa: E402

if _rich_hidden:
    del sys.modules["rich"]  # importable again, for those who draw with it (status, progress)


class StderrLogger(structlog.PrintLogger):
    """Writes log lines to stderr. A line that cannot be written (a full disk under a log file) raises one OSError
    naming the file, so the process's run ends clearly; later lines are dropped instead of failing each caller."""

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
    """--log-json as given, else JSON when stderr is not a terminal."""
    return not sys.stderr.isatty() if json is None else json


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    json = json_logs(json)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=lambda *_: StderrLogger(sys.stderr),  # the stderr of the moment (pytest swaps it)
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
