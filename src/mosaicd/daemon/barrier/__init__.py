"""The barrier: `Barrier` (the adapter around `mosaic_proto.BarrierState`), its HTTP API and dashboard, the
journal a restarted barrier resumes from, the release log, the network evaluation and the barrier process."""
