"""Starting an aiohttp app on the network, the one way: node and barrier listen alike."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from pathlib import Path

from aiohttp import web

from mosaicd.daemon.http.limits import guard_connections, handler_options
from mosaicd.daemon.http.tls import server_context
from mosaicd.files import write_whole
from mosaicd.settings import DaemonOptions

# connections the kernel queues until the loop accepts them: dozens of peers connect at each round's start, and a
# loop busy for a moment must not make them retry their SYN a second later (aiohttp's default is 128)
BACKLOG = 1024
# how long stopping waits for requests still being answered before it cuts them (aiohttp waits 60 s): a long poll
# of a process told to stop (Ctrl-C) is cut, and its client retries, as it would against a killed process
SHUTDOWN_S = 2.0


# the file descriptor of a socket listening already, that a launcher bound and handed down (`mosaicd cluster`):
# served on instead of binding --port here, which another process could take between the launcher's choice of the
# port and this process's start (seconds: the imports); the launcher's own `listening_sockets`
LISTEN_FD = "MOSAIC_LISTEN_FD"


class ListenError(RuntimeError):
    """This process cannot listen where it was told to; the message names the flag to change."""


def listen_error(exc: OSError, host: str, port: int) -> ListenError:
    """The one line for a failed bind: the port in use, an address this machine does not have, or a port it
    may not open."""
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return ListenError(f"--port {port}: {where} is in use (another process listens there); give another --port "
                           "(0: any free one)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ListenError(f"--host {host}: not an address of this machine ({exc.strerror})")
    if exc.errno == errno.EACCES:
        return ListenError(f"--port {port}: not allowed to listen on {where} (ports below 1024 need privileges)")
    return ListenError(f"--host {host} --port {port}: cannot listen on {where}: {exc.strerror or exc}")


async def serve(app: web.Application, options: DaemonOptions,
                sock: socket.socket | None = None) -> tuple[web.AppRunner, int]:
    """Listen on --host/--port (TLS with --tls-cert); the runner (cleanup() stops it) and the port really bound.
    `sock`: a socket listening already (a warm start binds it before forking the nodes, who connect at once)."""
    context = server_context(options)  # before anything listens: a bad certificate or key is a usage error
    sock = sock if sock is not None else handed_socket(options)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_S,
                           **handler_options(options))
    await runner.setup()
    guard_connections(runner, options, app)  # connection caps, under the open-file limit (daemon/limits.py)
    if sock is not None:
        await web.SockSite(runner, sock, ssl_context=context, backlog=BACKLOG).start()
    else:
        port = earlier_port(options)
        try:
            try:
                await web.TCPSite(runner, options.host, port, ssl_context=context, backlog=BACKLOG).start()
            except OSError as exc:
                if port == options.port or exc.errno != errno.EADDRINUSE:
                    raise
                port = options.port  # the earlier port is taken now: any free one
                await web.TCPSite(runner, options.host, port, ssl_context=context, backlog=BACKLOG).start()
        except OSError as exc:  # the port in use, a foreign address: one line naming the flag, not a traceback
            await runner.cleanup()
            raise listen_error(exc, options.host, options.port) from None
    bound = runner.addresses[0][1] if runner.addresses else options.port
    if options.port_file is not None:
        write_port(options.port_file, bound)
    return runner, bound


def handed_socket(options: DaemonOptions) -> socket.socket | None:
    """The listening socket this process was handed (`LISTEN_FD`), None where it was handed none. The variable is
    taken out of the environment: a process this one starts inherits no claim to it. ListenError where the
    descriptor is no socket listening on --host/--port (a launcher's mistake, said before anything is served)."""
    fd = os.environ.pop(LISTEN_FD, None)
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=int(fd))
    except (OSError, ValueError) as exc:
        raise ListenError(f"{LISTEN_FD}={fd}: no socket handed down ({exc})") from None
    host, port = sock.getsockname()[:2]
    if sock.type != socket.SOCK_STREAM or port != options.port or options.host not in (host, "localhost"):
        sock.close()
        raise ListenError(f"{LISTEN_FD}={fd}: the socket handed down is bound to {host}:{port}, not --host "
                          f"{options.host} --port {options.port}")
    sock.setblocking(False)
    return sock


def check_port(options: DaemonOptions) -> None:
    """ListenError now where --host/--port cannot be listened on (the port in use, a foreign address): for a barrier,
    before it touches the run's files in --out (`serve` binds only once the app, and so the barrier, exists)."""
    if options.port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(options.host or None, options.port,
                                                             type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as serve's: TIME_WAIT is no obstacle
            probe.bind(address)
    except OSError as exc:
        raise listen_error(exc, options.host, options.port) from None


def earlier_port(options: DaemonOptions) -> int:
    """--port, or with --port 0 the one --port-file names from this process's previous life (a restarted container
    keeps its address, so the run knows it as the same member)."""
    if options.port != 0 or options.port_file is None:
        return options.port
    try:
        return int(options.port_file.read_text().strip())
    except (OSError, ValueError):
        return 0


def write_port(path: os.PathLike[str], port: int) -> None:
    """--port-file: the port, written whole (a health check may read it at any moment)."""
    path = Path(path)
    path.absolute().parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, f"{port}\n")


# glibc malloc: blocks below MMAP_BELOW come from the heap, and up to KEEP_FREED bytes freed at its top stay there;
# a node's blocks of any size come from the heap (MMAP_MAX 0), where glibc would map those above MMAP_BELOW anew
MMAP_BELOW = 32 << 20  # glibc's own largest automatic value
KEEP_FREED = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_NODE_MALLOC = ((_M_MMAP_THRESHOLD, MMAP_BELOW), (_M_TRIM_THRESHOLD, KEEP_FREED), (_M_MMAP_MAX, 0))


def keep_freed_memory() -> bool:
    """Let this process reuse the memory a round frees, instead of handing it back to the system and faulting
    it in again (zeroed, page by page) in the next round; True where the C library took the settings.

    A round allocates and frees every message it sends and receives (s * d * 4 bytes each way, in pieces the
    socket reads come in); glibc returns freed memory above 2x its largest freed block at once, so each round
    pays page faults for all of it, a third of a receiving node's CPU time at d=1e6 (bench/round.py). And glibc
    maps every block above 32 MiB on its own and unmaps it when freed: a model of 8M values or more (its trained
    vector, the fragments gathered to send, the averages) was faulted in afresh every round, 12% of an 11M-value
    round's CPU at K=16 (bench/README.md); from the heap it is the last round's memory, reused. The peak memory
    is about the same (+5% at 11M values); between rounds the freed blocks stay mapped, at most KEEP_FREED at
    the heap's top. MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ or MALLOC_MMAP_MAX_ in the environment win.
    """
    if any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (or no C library symbols): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(option, value) for option, value in _NODE_MALLOC)
