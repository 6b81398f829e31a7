"""The asyncio daemon: a node's round loop, `Peer`, the barrier adapter, HTTP routes and client, membership."""
