"""How every entry point ends (`mosaicd node|barrier|cluster|simulate`, and the warm start's forked roles): an
error a user can act on is one line on stderr and exit 1, Ctrl-C is 130; only bugs leave a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from mosaicd.daemon.errors import OutputError, PeerDropped, RunEnded
from mosaicd.daemon.http.client import HttpError
from mosaicd.daemon.http.server import ListenError
from mosaicd.settings import SettingsError

# HttpError: a peer answered 4xx or stayed unreachable; PeerDropped: the barrier dropped this node; ListenError: the
# port or address to listen on cannot be had
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, TimeoutError, HttpError, PeerDropped,
                                                RunEnded, OutputError, ListenError)


def run_entry(command: str, main: Callable[[], int]) -> int:
    """`main()`'s exit code, or the one its error means (printed as `mosaicd COMMAND: error: ...`)."""
    try:
        return main()
    except KeyboardInterrupt:
        return 130
    except SettingsError as exc:  # the settings or the peer list the user wrote: a usage error
        print(f"mosaicd {command}: error: {exc}", file=sys.stderr)
        return 2
    except USER_ERRORS as exc:
        print(f"mosaicd {command}: error: {exc}", file=sys.stderr)
        return 1
