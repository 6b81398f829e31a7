"""Experiment tooling: the in-process simulator, the local cluster launcher, progress, sweeps, reports, analysis."""
