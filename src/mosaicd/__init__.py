"""mosaicd: the asyncio daemon, barrier, local cluster and experiment tooling around mosaic_proto."""

from mosaicd.daemon.peer import Peer, PeerDropped
from mosaicd.settings import DaemonOptions, RunConfig, Settings

__all__ = ["DaemonOptions", "Peer", "PeerDropped", "RunConfig", "Settings"]
