"""Per-key lookup tables, built once from the plan when a scheduler starts.

Input: one KeyPlan of a WorkerPlan (and whether this worker only follows it under TP).
Output: flat lists indexed by mixture mask or walk index, so a step decides caps, labels,
attention routes and capture buckets by indexing, never by searching the plan.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Optional

from mstar.plan.buckets import EAGER, CapturePick, pick_smallest, serves
from mstar.plan.schema import CaptureFamily, KeyPlan
from mstar.runtime.scheduler.errors import SchedulerError

#: Stands for "no rows limit" for a walk: larger than any cap.
NO_LIMIT = 1 << 62


class PlanTableError(SchedulerError):
    """The plan's tables for a key are inconsistent (a missing mixture mask, an unknown capture)."""




@dataclass
class KeyTables:
    """Everything the builder needs about one scheduling key, as direct lookups.

    caps[mask], labels[mask], attention[mask], families[mask], is_mixed[mask]: per mixture mask;
    families[mask] is the mixture's `capture`, more_families[mask] its `also_captures` (() for most).
    limits[w]: most rows of walk w in a mixed step (NO_LIMIT when the plan gives none).
    limited_walks[mask]: (walk, limit) for each walk of a mixed mask that has a rows limit.
    rules[w]: what rows of walk w must agree on to share a step (KeyPlan.batch_rules; () = nothing);
    has_rules: some walk of the key has rules (its steps are then composed by batch_rules.py).
    is_guidance_keyed: some capture family of the key serves one guidance mode only, so a step's
    pick needs its mode (whether any row's request requires guidance; the scheduler tracks them).
    token_budget: most tokens a step feeds (NO_LIMIT without one); chunk_sizes[w]: the most
    tokens of one row of walk w a step feeds (0: rows of w run whole); is_token_limited: either
    applies (token_budget.py fits each step to them). context_scale: a chunk token after c tokens
    of its row's KV counts 1 + c / context_scale against the budget (0: one each;
    KeyPlan.chunk_context_scale).
    """

    index: int
    name: str
    node: str
    walks: list[str]
    walk_index: dict[str, int]
    caps: list[int]
    labels: list[Optional[str]]
    attention: list[str]
    families: list[Optional[CaptureFamily]]
    more_families: list[tuple[CaptureFamily, ...]]
    is_mixed: list[bool]
    limits: list[int]
    limited_walks: list[list[tuple[int, int]]]
    is_followed: bool
    rules: list[tuple[str, ...]]
    has_rules: bool
    is_guidance_keyed: bool = False
    token_budget: int = NO_LIMIT
    chunk_sizes: tuple[int, ...] = ()
    is_token_limited: bool = False
    context_scale: int = 0

    @classmethod
    def from_plan(cls, index: int, key: KeyPlan, is_followed: bool) -> "KeyTables":
        num_masks = 1 << len(key.walks)
        by_mask = {entry.mask: entry for entry in key.mixtures}
        missing = [mask for mask in range(1, num_masks) if mask not in by_mask]
        if missing:
            raise PlanTableError(f"key {key.name}: no mixture entry for masks {missing}")
        families = {family.name: family for family in key.captures}
        caps = [0] * num_masks
        labels: list[Optional[str]] = [None] * num_masks
        attention = ["none"] * num_masks
        picked: list[Optional[CaptureFamily]] = [None] * num_masks
        more: list[tuple[CaptureFamily, ...]] = [()] * num_masks
        for mask in range(1, num_masks):
            entry = by_mask[mask]
            caps[mask] = entry.cap
            labels[mask] = entry.label
            attention[mask] = entry.attention
            if entry.capture is not None:
                if entry.capture not in families:
                    raise PlanTableError(
                        f"key {key.name}: mixture {entry.walks} names unknown capture {entry.capture}"
                    )
                picked[mask] = families[entry.capture]
            unknown_more = [name for name in entry.also_captures if name not in families]
            if unknown_more or (entry.also_captures and entry.capture is None):
                raise PlanTableError(f"key {key.name}: mixture {entry.walks} lists also_captures {entry.also_captures} "
                                     f"beside capture {entry.capture}: {unknown_more or 'no first family'}")
            more[mask] = tuple(families[name] for name in entry.also_captures)
        unknown = sorted(set(key.rows_limits) - set(key.walks))
        if unknown:
            raise PlanTableError(f"key {key.name}: rows limits for walks not in the key: {unknown}")
        return cls(
            index=index,
            name=key.name,
            node=key.node,
            walks=list(key.walks),
            walk_index={walk: i for i, walk in enumerate(key.walks)},
            caps=caps,
            labels=labels,
            attention=attention,
            families=picked,
            more_families=more,
            is_mixed=[bin(mask).count("1") > 1 for mask in range(num_masks)],
            limits=[key.rows_limits.get(walk, NO_LIMIT) for walk in key.walks],
            limited_walks=[
                [
                    (w, key.rows_limits[walk]) for w, walk in enumerate(key.walks)
                    if mask >> w & 1 and walk in key.rows_limits
                ] if bin(mask).count("1") > 1 else []
                for mask in range(num_masks)
            ],
            is_followed=is_followed,
            rules=[tuple(key.batch_rules.get(walk, ())) for walk in key.walks],
            has_rules=bool(key.batch_rules),
            is_guidance_keyed=any(family.guidance != "any" for family in key.captures),
            token_budget=key.token_budget if key.token_budget is not None else NO_LIMIT,
            chunk_sizes=tuple(key.chunk_sizes.get(walk, 0) for walk in key.walks),
            is_token_limited=key.token_budget is not None or bool(key.chunk_sizes),
            context_scale=key.chunk_context_scale or 0,
        )

    def pick_capture(self, mask: int, num_rows: int, num_tokens: list[int], is_guided: bool = False) -> CapturePick:
        """The bucket a step of `num_rows` rows with these per-row token counts pads to (or eager),
        among the families of the step's guidance mode (`is_guided`: some row requires guidance;
        a family of the other mode is never replayed). With several families, the one whose key
        holds the step with the smallest (tokens, padded batch); see `pick_smallest`."""
        family = self.families[mask]
        if family is None:
            return EAGER
        if self.more_families[mask]:
            return pick_smallest((family, *self.more_families[mask]), num_rows, num_tokens, is_guided)
        if is_guided or family.guidance != "any":  # (unkeyed keys' steps skip the call)
            if not serves(family, is_guided):
                return EAGER
        pad = family.batch_pad
        padded = pad[num_rows] if num_rows < len(pad) else 0
        if padded == 0:
            return EAGER
        if family.kind == "batched":
            # a row past the family's tokens a row (a prompt on a batched capture of its walk) fits
            # no graph of it: eager, as pick_smallest says (it padded to the family, and the engine
            # refused every such step: StepContractError)
            if max(num_tokens, default=0) > family.tokens_per_row:
                return EAGER
            return CapturePick(family.name, padded, 0)
        buckets = family.token_buckets
        at = bisect_left(buckets, sum(num_tokens))
        if at == len(buckets):
            return EAGER
        return CapturePick(family.name, padded, buckets[at])
