"""The step contract, engine side: a step is checked against its plan row before it runs.

In: the plan (its workers' keys, mixtures and capture families) and a `Step`. Out:
`StepChecker.check(step) -> StepRow` (the plan row the step runs under), or a `StepContractError`
whose message names the step field that disagrees with the plan:

- `key`: the step's worker has that scheduling key, of the step's node;
- `mask`: a mixture of the key (not the empty step), and exactly the walks of the step's rows;
- `rows`: at most the mixture's cap, and in a mixed step at most the key's `rows_limits` per walk
  (a mixed step only on a combined key); on a kv node's batched capture at most its
  `tokens_per_row` tokens a row (a stateless node's tokens are its input items, not captured ones);
- `tokens`: at most the key's `token_budget` (a step of one row may pass it: a row that cannot be
  cut runs alone), and a row fed as a chunk at most its walk's `chunk_sizes` entry (the rest of
  a prompt after a cached prefix is fed whole on a walk that is not cut);
- `label` and `attention`: the mixture's own; a route of `none` on a kv node is refused (it would
  run attention the plan says is not there);
- `capture`, `padded_batch`, `token_bucket`: eager (none, 0, 0) - with at most the largest batch
  size of the mixture's capture families unless one of them is `eager_above` - or one of the
  mixture's capture families (`capture` or one of `also_captures`) with the padded batch one of
  its `batch_sizes` and at least the rows, and (packed families) the token bucket one of its
  `token_buckets` and at least the step's tokens; a batched family has no token bucket;
- `is_guided` (the step's guidance mode): a guided step only on a node with guidance sequences,
  and a captured step's family of the step's mode or of both (`CaptureFamily.guidance`). Whether
  the mode is the rows' own (some row's request requires guidance) `check_mode` checks with the
  engine's answer for its requests (`StepPlanRow.is_guidance_keyed` says when it matters).
The engine decides nothing the plan decided; it only refuses a step the plan does not allow.
"""
from __future__ import annotations

from collections import Counter
from operator import attrgetter
from dataclasses import dataclass
from typing import Callable

from mstar.plan.buckets import serves
from mstar.plan.guidance_mode import GuidanceRule
from mstar.plan.schema import CaptureFamily, KeyPlan, MixtureEntry, Plan
from mstar.runtime.step import Step

_walk_of = attrgetter("walk")
_tokens_of = attrgetter("num_tokens")
_is_partial_of, _chunk_start_of = attrgetter("is_partial"), attrgetter("chunk_start")


class StepContractError(ValueError):
    """A step that disagrees with its plan row; the message names the field."""


@dataclass(frozen=True)
class StepPlanRow:
    """What the engine runs a step under: its key, its mixture entry, and the key's walks whose
    one-walk steps run on decode kernels (a `split` step attends those rows separately)."""

    key: KeyPlan
    entry: MixtureEntry
    decode_walks: frozenset[str]
    is_guidance_keyed: bool = False  # some family of the key serves one guidance mode only


class StepChecker:
    def __init__(self, plan: Plan):
        self.keys = {(w.rank, k.name): k for w in plan.workers for k in w.keys}
        self.families = {(w.rank, k.name): {c.name: c for c in k.captures} for w in plan.workers for k in w.keys}
        self.is_kv = {n.name: n.engine == "kv" for n in plan.nodes}
        self.has_guidance = {n.name: bool(n.guidance) for n in plan.nodes}
        self.guidance_rules = {n.name: GuidanceRule.of(n) for n in plan.nodes if n.guidance}
        self.is_guidance_keyed = {where: any(f.guidance != "any" for f in key.captures)
                                  for where, key in self.keys.items()}
        self.decode_walks = {
            where: frozenset(walk for i, walk in enumerate(key.walks)
                             if key.mixtures[1 << i].attention == "decode")
            for where, key in self.keys.items()
        }

    def check(self, step: Step) -> StepPlanRow:
        where = f"step of key {step.key} on worker {step.worker}"
        key = self.keys.get((step.worker, step.key))
        if key is None:
            raise StepContractError(f"{where}: key: worker {step.worker} has no scheduling key {step.key!r}")
        if key.node != step.node:
            raise StepContractError(f"{where}: node: the key runs node {key.node}, the step names {step.node}")
        if not 0 < step.mask < len(key.mixtures):
            raise StepContractError(f"{where}: mask {step.mask} is not a mixture of the key "
                                    f"(masks 1..{len(key.mixtures) - 1})")
        entry = key.mixtures[step.mask]
        _check_rows(where, key, entry, step)
        _check_tokens(where, key, step)
        if step.label != entry.label:
            raise StepContractError(f"{where}: label {step.label!r}, the plan's mixture has {entry.label!r}")
        if step.attention == "none" and self.is_kv.get(step.node, False):
            raise StepContractError(f"{where}: attention route none on a step of kv node {step.node}: "
                                    "its rows need attention over their KV cache")
        if step.attention != entry.attention:
            raise StepContractError(f"{where}: attention {step.attention!r}, the plan's mixture "
                                    f"{entry.walks} has {entry.attention!r}")
        if step.is_guided and not self.has_guidance.get(step.node, False):
            raise StepContractError(f"{where}: is_guided: a guided step of node {step.node}, which has no guidance "
                                    "sequences")
        _check_capture(where, self.families[(step.worker, step.key)], entry, step, self.is_kv.get(step.node, False))
        return StepPlanRow(key, entry, self.decode_walks[(step.worker, step.key)],
                           self.is_guidance_keyed[(step.worker, step.key)])


    def check_mode(self, step: Step, requires_guidance: Callable[[str, str], bool]) -> None:
        """A step of a key whose captures are keyed by guidance mode (`StepPlanRow.is_guidance_keyed`)
        is guided exactly when one of its rows' requests requires guidance: `requires_guidance(request
        id, node)`, the engine's answer by the plan's rule (the scheduler picked the capture by it)."""
        guided = next((row.request_id for row in step.rows if requires_guidance(row.request_id, step.node)), None)
        if (guided is not None) != step.is_guided:
            why = f"request {guided} requires guidance" if guided is not None else "no row's request requires guidance"
            raise StepContractError(f"step of key {step.key} on worker {step.worker}: is_guided {step.is_guided}, "
                                    f"but {why} on {step.node}")


def _check_rows(where: str, key: KeyPlan, entry: MixtureEntry, step: Step) -> None:
    walks = set(map(_walk_of, step.rows))  # read in C: no Python work per row
    unknown = sorted(walks - set(entry.walks))
    if unknown:
        raise StepContractError(f"{where}: mask {step.mask}: rows of walk {unknown[0]}, which the mixture "
                                f"{entry.walks} does not hold")
    missing = sorted(set(entry.walks) - walks) if step.rows else []
    if missing:
        raise StepContractError(f"{where}: mask {step.mask}: the mixture {entry.walks} has no row of "
                                f"walk {missing[0]}")
    if len(step.rows) > entry.cap:
        raise StepContractError(f"{where}: rows: {len(step.rows)} rows, past the mixture's cap {entry.cap}")
    if len(entry.walks) > 1:
        if not key.is_combined:
            raise StepContractError(f"{where}: mask {step.mask}: a step of walks {entry.walks} on key {key.name}, "
                                    "which combines no walks")
        for walk, count in Counter(map(_walk_of, step.rows)).items():
            limit = key.rows_limits.get(walk)
            if limit is not None and count > limit:
                raise StepContractError(f"{where}: rows: {count} rows of walk {walk}, past the key's "
                                        f"rows_limits {limit}")


def _check_eager_above(where: str, families: list[CaptureFamily], step: Step) -> None:
    """An eager step of a mixture that replays families: more rows than their largest batch size
    only when one of them runs eagerly above its buckets (`eager_above`)."""
    if not families or any(f.is_eager_above for f in families):
        return
    largest = max(families, key=lambda f: f.batch_sizes[-1] if f.batch_sizes else 0)
    if largest.batch_sizes and len(step.rows) > largest.batch_sizes[-1]:
        raise StepContractError(f"{where}: rows: {len(step.rows)} rows run eagerly, above the largest batch size "
                                f"{largest.batch_sizes[-1]} of capture {largest.name}, which does not run eagerly "
                                "above its buckets (no `eager_above`)")
def _check_tokens(where: str, key: KeyPlan, step: Step) -> None:
    """The key's step token budget (one row that cannot be cut may pass it alone) and its chunk
    sizes: a cut row feeds at most its walk's chunk size."""
    if key.token_budget is not None and len(step.rows) > 1:
        num_tokens = sum(row.num_tokens for row in step.rows)
        if num_tokens > key.token_budget:
            raise StepContractError(f"{where}: tokens: {num_tokens} tokens, past the key's token_budget "
                                    f"{key.token_budget}")
    if not any(map(_is_partial_of, step.rows)) and not any(map(_chunk_start_of, step.rows)):
        return  # no row is a chunk (read in C: a decode step does no Python work per row here)
    for row in step.rows:
        # (a row past a cached prefix starts at chunk_start > 0 on any walk whose rows may be cut)
        if row.is_partial or (row.chunk_start and row.walk in key.chunk_sizes):
            size = key.chunk_sizes.get(row.walk)
            if size is None or row.num_tokens > size:
                raise StepContractError(f"{where}: rows: request {row.request_id} feeds a chunk of "
                                        f"{row.num_tokens} tokens of walk {row.walk}, whose chunk size is {size}")


def _check_capture(where: str, families: dict[str, CaptureFamily], entry: MixtureEntry, step: Step,
                   is_kv: bool) -> None:
    if step.padded_batch == 0:
        if step.capture is not None or step.token_bucket:
            raise StepContractError(f"{where}: an eager step (padded_batch 0) names capture {step.capture!r} "
                                    f"and token_bucket {step.token_bucket}")
        names = [entry.capture, *entry.also_captures] if entry.capture is not None else []
        _check_eager_above(where, [families[n] for n in names if n in families], step)
        return
    if step.capture is None or (step.capture != entry.capture and step.capture not in entry.also_captures):
        replays = " or ".join(repr(n) for n in [entry.capture, *entry.also_captures])
        raise StepContractError(f"{where}: capture {step.capture!r} with padded_batch {step.padded_batch}, "
                                f"the plan's mixture replays {replays}")
    family = families.get(step.capture)
    if family is None:
        raise StepContractError(f"{where}: capture {step.capture!r} is not a capture family of the key")
    if not serves(family, step.is_guided):
        mode = "guided" if step.is_guided else "unguided"
        raise StepContractError(f"{where}: capture {family.name} serves {family.guidance} steps, and this step is "
                                f"{mode} (is_guided {step.is_guided})")
    if step.padded_batch not in family.batch_sizes or step.padded_batch < len(step.rows):
        raise StepContractError(f"{where}: padded_batch {step.padded_batch} for {len(step.rows)} rows is not "
                                f"a captured batch size of {family.name} (batch_sizes {family.batch_sizes})")
    if family.kind == "batched":
        if step.token_bucket:
            raise StepContractError(f"{where}: token_bucket {step.token_bucket} on batched capture {family.name}")
        if not is_kv or max(map(_tokens_of, step.rows), default=0) <= family.tokens_per_row:
            return
        long = next((row for row in step.rows if row.num_tokens > family.tokens_per_row), None)
        if long is not None:
            raise StepContractError(f"{where}: rows: request {long.request_id} feeds {long.num_tokens} tokens, past "
                                    f"the {family.tokens_per_row} tokens a row of batched capture {family.name} holds")
        return
    num_tokens = sum(map(_tokens_of, step.rows))
    if step.token_bucket not in family.token_buckets or step.token_bucket < num_tokens:
        raise StepContractError(f"{where}: token_bucket {step.token_bucket} for {num_tokens} tokens is not a "
                                f"token bucket of {family.name} (token_buckets {family.token_buckets})")
