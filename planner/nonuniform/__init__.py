"""The failure-aware search: damaged nodes' TP partitions, replica templates of different shapes, and the
joint allocation of templates and microbatches (`allocation/`)."""
