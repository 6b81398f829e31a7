"""mosaicd: the asyncio daemon, barrier peer, local cluster and experiment tooling around mosaic_proto."""

from .peer import Peer, PeerDropped
from .settings import Settings

__all__ = ["Peer", "PeerDropped", "Settings"]
