"""A request's prefix claim on a kv node, one way for the simulated and the torch engines (their
prefix caches and admission are the same, so their claims must be too).

In: the node's `Admission` and `PagePool`, the request's first sequence (`SeqKey`), its prompt and
the node's media placeholder id. Out: the tokens of the prompt's longest cached prefix the sequence
now starts on (whole pages), taken within first come, first started (kv/admission.py): no free page
an older waiting request needs (`room_to_start`), no page that would take a waiting request's room
(`claim_cap`). The caller then records the claim and makes the request wait with its budget
(`Admission.join`).
"""
from __future__ import annotations

from typing import Optional

from mstar.runtime.engine.kv.admission import Admission
from mstar.runtime.engine.kv.pages import PagePool, SeqKey
from mstar.runtime.engine.kv.prefix_cache import shareable_prefix


def claim_cached_prefix(admission: Admission, pool: PagePool, key: SeqKey, tokens: list[int],
                        media_token: Optional[int]) -> int:
    request_id = key[0]
    shareable = shareable_prefix(tokens, media_token)
    free_for_claims = admission.room_to_start(request_id, pool.num_free_pages)
    cap = admission.claim_cap(request_id, lambda: pool.cached_chain(key[1], shareable))
    return pool.claim_prefix(key, shareable, free_for_claims, cap)
