"""Starting an aiohttp app on the network, the one way: node and barrier listen alike."""

from __future__ import annotations

import socket

from aiohttp import web

from mosaicd.daemon.limits import guard_connections, handler_options
from mosaicd.daemon.tls import server_context
from mosaicd.settings import DaemonOptions


async def serve(app: web.Application, options: DaemonOptions,
                sock: socket.socket | None = None) -> tuple[web.AppRunner, int]:
    """Listen on --host/--port (TLS with --tls-cert); the runner (cleanup() stops it) and the port really bound.
    `sock`: a socket listening already (a warm start binds it before forking the nodes, who connect at once)."""
    context = server_context(options)  # before anything listens: a bad certificate or key is a usage error
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **handler_options(options))
    await runner.setup()
    guard_connections(runner, options, app)  # connection caps, under the open-file limit (daemon/limits.py)
    if sock is not None:
        await web.SockSite(runner, sock, ssl_context=context).start()
    else:
        await web.TCPSite(runner, options.host, options.port, ssl_context=context).start()
    return runner, runner.addresses[0][1] if runner.addresses else options.port
