"""mosaicd: the asyncio daemon, barrier peer, local cluster and experiment tooling around mosaic_proto."""

from mosaicd.daemon.peer import Peer, PeerDropped
from mosaicd.settings import Settings

__all__ = ["Peer", "PeerDropped", "Settings"]
