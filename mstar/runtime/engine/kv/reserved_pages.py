"""The page admission of a kv node whose KV is held per request rather than in pages (Whisper's
decoder: its self-attention cache grows per request, its cross-attention pool is the request's own).

In: the plan's pool for the node (pages, page size, max_seq_len; `--kv-pages` overrides the pages),
each request's prompt and max_tokens. Out: `refusal(...)` for a request that could never fit,
`admit(rows)` -> the requests short of pages this step, `release(id)` when a request ends,
`num_held` for the server's gauge.

A request reserves its whole budget, min(prompt + max_tokens, max_seq_len) tokens' worth of pages,
at its first row, through the shared admission policy (kv/admission.py). That is the decision the
policy makes for a new request's first row on a paged node (its whole budget must fit beside what
the started requests may still claim), and a started request's growth within its budget is never
refused, so admitting by the reservation makes the decisions the simulated engine makes for the
same pool and requests: `--kv-pages` and the plan's pool bound the decoder as they bound the sim.
"""
from __future__ import annotations

import math
from typing import Optional

from mstar.runtime.engine.kv.admission import Admission, PageNeed


class ReservedPages:
    def __init__(self, node: str, num_pages: int, page_size: int, max_seq_len: int):
        self.node, self.num_pages, self.page_size, self.max_seq_len = node, num_pages, page_size, max_seq_len
        self.admission = Admission()
        self.num_held = 0

    def budget_pages(self, num_prompt_tokens: int, max_tokens: Optional[int]) -> int:
        """max_tokens None: up to max_seq_len."""
        num_tokens = num_prompt_tokens + (max_tokens if max_tokens is not None else self.max_seq_len)
        return math.ceil(min(num_tokens, self.max_seq_len) / self.page_size)

    def refusal(self, num_prompt_tokens: int, max_tokens: Optional[int]) -> Optional[str]:
        pages = self.budget_pages(num_prompt_tokens, max_tokens)
        if pages <= self.num_pages:
            return None
        return (f"can never fit: node {self.node}: prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) need "
                f"{pages} KV pages of {self.page_size} but the pool has only {self.num_pages}")

    def admit(self, requests: list[tuple[str, int]], is_partial_ok: bool) -> list[str]:
        """Reserve the budgets of the not yet started requests among (request id, budget pages), in
        step order; returns the ids short of pages (without `is_partial_ok`, when any is short
        nothing is reserved and no row of the step may run)."""
        needs = [PageNeed(request_id, budget, budget) for request_id, budget in dict(requests).items()
                 if not self.admission.is_started(request_id)]
        failed = self.admission.shortfall(needs, self.num_pages - self.num_held)
        if failed and not is_partial_ok:
            return failed
        for need in needs:
            if need.request_id not in failed:
                self.admission.grant(need)
                self.num_held += need.num_pages
        return failed

    def release(self, request_id: str) -> None:
        self.num_held -= self.admission.release(request_id)
