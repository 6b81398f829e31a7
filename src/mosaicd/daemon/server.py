"""Starting an aiohttp app on the network, the one way: node and barrier listen alike."""

from __future__ import annotations

from aiohttp import web

from mosaicd.settings import DaemonOptions


async def serve(app: web.Application, options: DaemonOptions) -> tuple[web.AppRunner, int]:
    """Listen on --host/--port; the runner (cleanup() stops it) and the port really bound."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, options.host, options.port).start()
    return runner, runner.addresses[0][1] if runner.addresses else options.port
