"""The scheduler stage: ready rows per scheduling key in, one `Batch` per worker step out.

In: ready rows (request id, node, walk, tokens) from the run loop, the worker's plan tables (keys,
mixtures, caps, rows limits, bucket lookups, speculation switches, TP groups). Out: `Batch`es
(plain data: rows, mixture mask, capture bucket, attention route), holds after out-of-memory
failures, speculative next steps and TP follower copies. It touches no tensors.
"""
