"""Steps of a key whose walks have batching rules (KeyPlan.batch_rules).

In:  the key's tables, its ready queue and each ready row's batch class (a hashable the caller
     computed from the rules: the tokens a row feeds, its loop iteration, its guidance mode).
Out: `pick_rule_rows(...) -> (walk index, request ids) | None`: the walk of the oldest ready row
     and, in FIFO order up to that walk's cap, the ready rows of that walk whose class equals the
     oldest row's. A walk without rules takes its FIFO prefix. Steps of such a key never mix walks
     (the compiler refuses a walk with rules in a combined walk, MW412). The rows picked keep to
     the key's step token budget as whole rows (such walks are never cut, compiler/chunking.py):
     the picking stops at the first row that would pass it, except that the oldest row runs alone
     when it passes the budget by itself (as token_budget.py's uncut rows).

The rows picked need not be a prefix of the queue (a row of another class stays, keeping its
place); the caller takes them with `KeyQueue.take_rows`. Cost: one pass over the walk's ready
rows, so only keys with rules pay it.
"""
from __future__ import annotations

from typing import Hashable, Optional

from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.ready_queues import KeyQueue


def pick_rule_rows(tables: KeyTables, queue: KeyQueue,
                   classes: dict[str, Hashable]) -> Optional[tuple[int, list[str]]]:
    heads = [(queue.runs[w].seq_at(0), w) for w, ids in enumerate(queue.ids) if ids]
    if not heads:
        return None
    walk = min(heads)[1]
    ids, tokens = queue.ids[walk], queue.tokens[walk]
    cap = tables.caps[1 << walk]
    if cap <= 0:
        return None
    rules = tables.rules[walk]
    wanted = classes.get(ids[0])
    chosen: list[str] = []
    left = tables.token_budget
    for request_id, num_tokens in zip(ids, tokens):
        if rules and classes.get(request_id) != wanted:
            continue
        if num_tokens > left and chosen:
            break  # whole rows within the step token budget (the first alone may pass it)
        chosen.append(request_id)
        left -= num_tokens
        if len(chosen) == cap:
            break
    return walk, chosen
