"""mosaicd: the asyncio daemon, barrier, local cluster and experiment tooling around mosaic_proto."""

from __future__ import annotations

from typing import Any

__all__ = ["Barrier", "DaemonOptions", "Peer", "PeerDropped", "RunConfig", "Settings", "Task", "TorchTask",
           "configure_logging"]

_HOMES = {"Barrier": "mosaicd.daemon.embedded", "configure_logging": "mosaicd.logs",
          "Peer": "mosaicd.daemon.embedded", "PeerDropped": "mosaicd.daemon.errors",
          "DaemonOptions": "mosaicd.settings", "RunConfig": "mosaicd.settings", "Settings": "mosaicd.settings",
          "Task": "mosaicd.learning.tasks.base", "TorchTask": "mosaicd.learning.tasks.torch_task"}


def __getattr__(name: str) -> Any:
    """Imported on first use: `mosaicd status` or `--help` need none of the daemon (aiohttp, numpy)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'mosaicd' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_HOMES[name]), name)
