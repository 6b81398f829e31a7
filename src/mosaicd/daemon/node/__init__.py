"""A member of a run: `Peer` (the adapter around `mosaic_proto.NodeState`), its HTTP API, metrics, checkpoints
and the node daemon's round loop (`run.py`)."""
