"""Per-node step runners: the rows of one step of one node in, row results out."""
