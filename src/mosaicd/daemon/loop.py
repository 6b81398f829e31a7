"""The event loop a process runs its role on (`--event-loop`): uvloop where it is installed, asyncio's own otherwise.

uvloop's sockets, HTTP transports and TLS are C (libuv), asyncio's are Python: the nodes' and the barrier's loops
spend most of their time there (bench/README.md, "Speed 4"). `run` is the one way a role starts its loop, so that
`mosaicd node`, `mosaicd barrier`, `mosaicd cluster`'s launcher and its forked nodes choose alike. The loop moves
the same bytes in the same order of decisions: no model depends on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mosaicd.settings import UVLOOP_MISSING, EventLoop, SettingsError

T = TypeVar("T")


def loop_factory(choice: EventLoop | str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the loop `choice` asks for: uvloop's, or None (asyncio's default) for asyncio, and for auto where
    uvloop cannot be imported. uvloop asked for and missing: SettingsError naming --event-loop."""
    choice = EventLoop(choice)
    if choice is EventLoop.ASYNCIO:
        return None
    try:
        import uvloop
    except ImportError:
        if choice is EventLoop.UVLOOP:
            raise SettingsError(f"--event-loop (MOSAIC_EVENT_LOOP): {UVLOOP_MISSING} (got 'uvloop')") from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: EventLoop | str = EventLoop.AUTO) -> T:
    """`asyncio.run(main)` on the loop `choice` asks for."""
    try:
        factory = loop_factory(choice)
    except BaseException:
        main.close()  # never started: no "never awaited" warning on top of the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def sleep_at_least(seconds: float) -> None:
    """`asyncio.sleep` that never returns early: uvloop's timers count milliseconds and may fire up to one early,
    and a --node-profile's stretched training or latency must last at least what it says."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        await asyncio.sleep(left)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """"uvloop" or "asyncio": the loop this code runs on (or `loop`), as the start-up log and /v1/status say it."""
    loop = loop if loop is not None else asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.split(".")[0] == "uvloop" else "asyncio"
