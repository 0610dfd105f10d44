"""The conductor stage: requests through their partitions' walks.

In: requests, and per-row step results (output values by edge). Out: rows that became ready
(request id, node, walk, tokens) for the schedulers, client emissions, stream chunks between
partitions, token counts, and ended requests whose engine state must be freed.
"""
