"""Which outputs a partition counts as the request's output tokens: its walks' `count_tokens`
edges, else (none marked) the text its walks send to the client. One rule for the lowering
(lower_tables.count_names, on walk trees) and the checks (check_submodels' MW126, on the AST).

In: each edge of the partition's walks as (output name, has count_tokens, goes to the client as
text). Out: the counted output names.
"""
from __future__ import annotations

from typing import Iterable


def counted_names(edges: Iterable[tuple[str, bool, bool]]) -> frozenset[str]:
    edges = list(edges)
    counted = {name for name, is_count_tokens, _ in edges if is_count_tokens}
    if not counted:
        counted = {name for name, _, is_client_text in edges if is_client_text}
    return frozenset(counted)
