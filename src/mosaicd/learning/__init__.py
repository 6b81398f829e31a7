"""The learning side of a run: workloads (tasks), data sets and their loaders, partitions, evaluation."""
