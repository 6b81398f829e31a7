"""The asyncio daemon, by role: `node` (a member: `Peer`, its round loop and API), `barrier` (the adapter around
`BarrierState`, its API, journal and evaluation) and `http` (what both use: server, client, errors, auth, TLS,
limits, membership)."""
