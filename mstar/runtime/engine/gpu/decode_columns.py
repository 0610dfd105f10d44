"""The GPU runner's columnar decode step: the bookkeeping of a step of steady decode rows done over
columns (numpy arrays and C iteration: `map`, `zip`, set and dict methods) instead of row by row.

In: the runner (`gpu/runner.py`, `GpuDecoderRunner`) and a step's `(StepRow, CallInfo,
RequestState)` rows, or the run loop's `(request id, walk, call, request)` rows of a step to launch
ahead. Out: `steady_rows(runner, rows, is_mixed_ok)` -> `SteadyRows` (the step's columns), or
None when no row (or, without `is_mixed_ok`, some row) is not steady, and then the runner takes
its per-row path for the whole step, so what the runner does for such a step is unchanged;
`start_steady` launches a steady or mixed step and returns what collects it (`TokenRows`: the
rows' results and the same answer in columns); `prelaunch_steady` launches the next step ahead,
False when its rows need the per-row path.

A step is steady when every row of it is: one call for all rows, whose first input is a token the
node loops back on the device and whose outputs are all sampled tokens; the row feeds that token
(no value on the row; its request's last token here, one token), is not a chunk, and its request
has started on the node (an admission budget), holds a row slot and a KV sequence, and has a
history here; the requests are distinct; no row would pass max_seq_len; no row's pages are on the
host (KV offload: the per-row path moves them back first); and the pool's free pages cover what
the started requests may still claim (`GpuDecoderRunner._admit`'s exact case: no row is then short,
so no page moves out). A steady row needs at most one page:
the rows that need one are asked of the admission policy, in step order, through the runner's
`_admit`, exactly as on the per-row path; the others need nothing. A refused row whose request
has started and would take its sequence past the pool's pages ends that request alone with the
per-row path's error (`DecoderRunner._past_pool` over the items asked): held, it waited until the
run loop called it stalled, 30 s on, the pool held all the while.

A mixed step (a chunk step: steady decode rows beside prompt chunks, a new request's prompt, a
request's first decode row): with `is_mixed_ok` (the engine runs partial steps and the step's
route is not `decode`) the steady rows are found row by row among the others (the steady call is
that of the step's last row, else its first: the scheduler puts prompt rows first), the step-wide
conditions above still hold for the whole step (distinct requests, the free pages' margin, no
steady row past max_seq_len), and the other rows go through the per-row path's own functions
(`_items`, `_within_length`, `_admit`, `_claim`'s rule, `RowSpec`, the commit with their tokens,
`_token_outputs`), merged with the columns in step order wherever order is seen: the admission
(one `_admit` in step order when a row at a page boundary comes before another row; else the
others' `_admit`, then the boundary rows', as above: two admissions in a row decide as one over
both, since the requests are distinct, the policy's running counts after a granted row are its
state after the grant, and a granted row leaves the free pages' margin over the started
requests' claims at or above zero, so `_admit`'s shortcut still holds; pages are taken in step
order either way), the row slots a new request takes, the `RowSpec`s and sampling rows of the
one launch, and the results. The results are a plain list (the engine reads the rows' answer in
columns itself), or, when a chunk before the last answers no token, a `TokenRows` with
`token_ids` None.

What the columns replace, row for row (the per-row path in gpu/runner.py and runners/decoder.py):
`_prepare` and the row item, the length check, `_claim`, the `RowSpec`s' lengths and page tables,
the KV commit, and `_token_outputs` (history, sampled counts, last tokens, the stop check). A
`RowSpec` and a `RowResult` are still built for each row: the executor and the run loop take them.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, eq, itemgetter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import numpy as np

from mstar.runtime.engine.gpu.packing import RowSpec
from mstar.runtime.engine.kv.pages import SequenceColumn
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.engine.runners.request_state import RequestState
from mstar.runtime.step import RowResult, StepRow

if TYPE_CHECKING:
    from mstar.runtime.engine.gpu.runner import GpuDecoderRunner, _Ahead, _CallFacts, _Item
    from mstar.runtime.engine.runners.decoder import _Prepared
    from mstar.runtime.engine.kv.offload import Offload

_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of calls in C
_params_of, _temperature_of = attrgetter("params"), attrgetter("temperature")
_last_token_of, _history_of = attrgetter("last_token"), attrgetter("history")
_has_penalty, _has_biases = attrgetter("has_penalty"), attrgetter("has_biases")
_wants_logprobs = attrgetter("wants_logprobs")
_first, _second, _third, _fourth = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_NOT_AHEAD = (None, -1)  # a row the step launched ahead does not hold: (walk, index there)


class TokenRows(list):
    """A step's `RowResult`s (the list itself) and the same answer in columns: `token_ids` (int64,
    one a row, in step order) and `stop_rows` (indices of the rows with is_stop), which the
    engine returns as `StepResult.token_ids` and `stop_rows` without reading the rows again."""

    token_ids: Optional[np.ndarray]  # None: the step's rows have no answer in columns (a chunk answers no token)
    stop_rows: list[int]


@dataclass
class SteadyRows:
    """A steady step's columns, in step order (module docstring)."""

    request_ids: list[str]
    requests: list[RequestState]
    walk: str
    facts: "_CallFacts"
    column: SequenceColumn  # each row's KV sequence: positions written before the step, positions held
    slots: list[int]  # row slots (the device token table)
    fed: list[list[int]]  # the token each row feeds (its request's last token; the device holds it too)
    call: CallInfo  # the steady rows' call (whether it sends its token as text: logit additions, ignore_eos)
    others: list[int] = field(default_factory=list)  # a mixed step: step indices of the rows that are not steady
    at: Optional[list[int]] = None  # a mixed step: each steady row's step index (else its index is its own)


def _any_on_host(offload: "Offload", request_ids: Iterable[str]) -> bool:
    """Whether KV offload holds the pages of one of these requests on the host."""
    on_host = offload.offloaded
    return bool(on_host) and any(request_id in on_host for request_id in request_ids)


def steady_rows(runner: "GpuDecoderRunner", rows: list[tuple[StepRow, CallInfo, RequestState]],
                is_mixed_ok: bool = False) -> Optional[SteadyRows]:
    """The step's columns when every row is steady (module docstring), else None. With
    `is_mixed_ok`, a step with some steady rows gets their columns too, with the other rows' step
    indices in `others` (module docstring, "A mixed step"). Reads only. (On CPython a stage of a C
    `map` over the rows' objects costs about what five plain bytecodes do: the checks mix one
    plain pass and C passes, and neither calls a function per row.)"""
    offload = runner.offload
    if not rows or (offload is not None and _any_on_host(offload, (row.request_id for row, _, _ in rows))):
        return None
    # a pure step's rows share one call; a mixed step's decode rows are those of one end's call
    call, name = rows[-1][1], _loop_back_input(runner, rows[-1][1])
    if name is None and is_mixed_ok and rows[0][1] is not call:
        call, name = rows[0][1], _loop_back_input(runner, rows[0][1])
    if name is None:
        return None
    facts = runner._facts_of(call)
    ids: list[str] = []
    others: list[int] = []
    append = ids.append
    for index, (row, row_call, _) in enumerate(rows):  # the rows' own fields: one pass
        if row_call is not call or row.is_partial or row.inputs.get(name) is not None:
            if not is_mixed_ok:
                return None
            others.append(index)
        append(row.request_id)
    node, requests = runner.node.name, list(map(_third, rows))
    pool, admission = runner.pool, runner.admission
    if len(set(ids)) != len(ids) or pool.num_free_pages < admission.num_outstanding:
        return None
    is_steady: list[bool] = []
    if others:  # a mixed step: its other rows' fields rule them out; the rest are checked below
        is_steady = [True] * len(rows)
        for index in others:
            is_steady[index] = False
        ids, requests = list(compress(ids, is_steady)), list(compress(requests, is_steady))
    # the requests' state: C passes (`None in` compares lists and ints here, never a dataclass)
    fed: list[Any] = list(map(dict.get, map(_last_token_of, requests), repeat(node)))
    slots: list[Any] = list(map(runner.held_row_slots.get, ids))
    if (not ids or None in fed or None in slots or set(map(len, fed)) != {1}
            or not admission.budgets.keys() >= set(ids)
            or not all(map(dict.__contains__, map(_history_of, requests), repeat(node)))):
        if not is_mixed_ok:
            return None
        # which of them are steady, row by row (the per-row path takes the others)
        budgets = admission.budgets
        is_ready = [last is not None and len(last) == 1 and slot is not None and request_id in budgets
                    and node in request.history for request_id, request, last, slot in zip(ids, requests, fed, slots)]
        if not any(is_ready):
            return None
        kept = iter(is_ready)
        is_steady = [is_it and next(kept) for is_it in is_steady] if is_steady else is_ready
        others = [index for index, is_it in enumerate(is_steady) if not is_it]
        ids, requests, fed, slots = (list(compress(values, is_ready)) for values in (ids, requests, fed, slots))
    at = list(compress(range(len(rows)), is_steady)) if others else None
    column = pool.column(list(zip(ids, repeat(runner.guidance.first))))
    if column is None or int(column.num_tokens.max()) + 1 > runner.max_seq_len:
        return None  # (a row past max_seq_len gets its error on the per-row path)
    walk = rows[0][0].walk if at is None else rows[int(at[0])][0].walk
    return SteadyRows(ids, requests, walk, facts, column, slots, fed, call, others, at)


def _loop_back_input(runner: "GpuDecoderRunner", call: CallInfo) -> Optional[str]:
    """The input a steady row of `call` feeds from the device token table, None when the call
    cannot have steady rows (its first input is not a device loop-back, or not every output is
    a sampled token)."""
    facts = runner._facts_of(call)
    if facts.is_image_flow or not facts.outputs or not all(map(_second, facts.outputs)) or not facts.inputs:
        return None
    name, is_loop_back, _ = facts.inputs[0]  # `_prepare` feeds the loop-back when the row has no value
    return name if is_loop_back else None


def _grant_one_page_each(runner: "GpuDecoderRunner", request_ids: list[str]) -> bool:
    """The pages of steady rows at a page boundary in one pass, when the admission policy would
    pass each row (`Admission.grant_one_page_each`): the same pages in the same order and the same
    admission state as asking row by row (the per-row admission of 64 rows made every 16th step
    of a lockstep decode twice as long). False, with nothing changed: ask row by row. Serves the
    step launched and the step launched ahead."""
    pool, label = runner.pool, runner.guidance.first
    if not runner.admission.grant_one_page_each(request_ids, pool.num_free_pages):
        return False
    for request_id in request_ids:
        if not pool.reserve((request_id, label), 1):
            raise RuntimeError(f"KV pages vanished between the check and the grant for {request_id}")
    return True


@dataclass
class _Step:
    """A steady or mixed step on its way through `start_steady` and its finish."""

    steady: SteadyRows
    at: Sequence[int]  # each steady row's step index
    items: list["_Item"] = field(default_factory=list)  # a mixed step's other rows (the per-row path's), in order
    items_at: list[int] = field(default_factory=list)  # their step indices
    ahead: Optional["_Ahead"] = None
    claimed: Any = None  # the steady rows the step launched ahead holds (a bool array), when it holds any
    there: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # their indices there
    items_claimed: dict[int, int] = field(default_factory=dict)  # index in items -> index there
    fresh: Optional[list[int]] = None  # the steady rows launched here (None: all)
    fresh_items: list[int] = field(default_factory=list)  # the other rows launched here (indices in items)
    pending: Any = None
    places: list[int] = field(default_factory=list)  # the fresh other rows' indices in the step launched
    asked: list["_Prepared"] = field(default_factory=list)  # the items the admission policy was asked about


def start_steady(runner: "GpuDecoderRunner", steady: SteadyRows, rows: list[tuple[StepRow, CallInfo, RequestState]],
                 is_partial_ok: bool, worker: int) -> tuple[list[RowResult], list[str], Callable[[], list[RowResult]]]:
    """`DecoderRunner.start` for a steady or mixed step (its route and bucket already set on the
    runner): the other rows' items (a mixed step), admit the rows that need memory, claim what the
    step launched ahead holds, launch the rest, commit every row's KV length; returns (results
    now, rows short of memory, finish)."""
    step = _Step(steady, steady.at if steady.at is not None else range(len(steady.request_ids)))
    results: list[RowResult] = []
    if steady.others:
        results, ready = runner._items([rows[index] for index in steady.others])
        step.items = runner._within_length(ready, results)  # type: ignore[assignment]
        index_of = dict(zip([rows[index][0].request_id for index in steady.others], steady.others))
        step.items_at = [index_of[item.row.request_id] for item in step.items]
    failed, is_running = _admit_step(runner, step, rows, is_partial_ok)
    if failed and is_partial_ok:  # a started request that can never get its pages ends now, as on the per-row path
        failed = runner._past_pool(step.asked, failed, results)
    if not is_running:
        return results, failed, list  # nothing runs (nor claims what the step launched ahead holds)
    _claim_ahead(runner, step, worker)
    _launch(runner, step, worker)
    step.steady.column.commit_one_each()
    sampled = set(step.steady.request_ids)
    for item in step.items:  # the per-row commit
        row = item.row
        runner.pool.commit((row.request_id, runner.guidance.first), len(item.tokens_fed),
                           None if item.is_loop_back else item.tokens_fed)
        if not row.is_partial:
            sampled.add(row.request_id)
    runner._last_rows[worker] = sampled
    return results, failed, partial(_finish, runner, step)


def _admit_step(runner: "GpuDecoderRunner", step: _Step, rows: list[tuple[StepRow, CallInfo, RequestState]],
                is_partial_ok: bool) -> tuple[list[str], bool]:
    """Admit the step's rows that need memory, as the per-row path does and in its order; drop
    those refused. Returns (rows short of memory, whether anything runs); the items asked stay on
    `step.asked`, where `start_steady` finds the rows that can never get their pages."""
    steady, items = step.steady, step.items
    refused: set[int] = set()  # steady rows the admission policy refused
    failed: list[str] = []
    needy = np.flatnonzero(steady.column.num_tokens >= steady.column.num_held).tolist()
    if items and needy and step.at[needy[0]] < step.items_at[-1]:
        # a row at a page boundary before another row: one admission of both, in step order
        needy_items = [runner._prepare(*rows[step.at[index]]) for index in needy]
        asked, _ = _merged(needy_items, [step.at[index] for index in needy], items, step.items_at)
        step.asked = asked
        granted, failed = runner._admit(asked, [], is_partial_ok)
        if failed and not is_partial_ok:
            return failed, False
        is_granted = {id(item) for item in granted}
        refused = {index for index, item in zip(needy, needy_items) if id(item) not in is_granted}
        _keep_items(step, is_granted)
        needy = []
    elif items:  # every other row comes before the rows at a page boundary: asked first, as in step order
        step.asked = list(items)
        granted, failed = runner._admit(step.asked, [], is_partial_ok)
        if failed and not is_partial_ok:
            return failed, False
        _keep_items(step, {id(item) for item in granted})
    if needy and _grant_one_page_each(runner, [steady.request_ids[index] for index in needy]):
        needy = []
    if needy:  # a row at a page boundary: the admission policy decides, as on the per-row path
        asked = [runner._prepare(*rows[step.at[index]]) for index in needy]
        step.asked = step.asked + asked
        granted, more = runner._admit(asked, [], is_partial_ok)
        if more and not is_partial_ok:
            return more, False
        failed = failed + more
        is_granted = {id(item) for item in granted}
        refused = {index for index, item in zip(needy, asked) if id(item) not in is_granted}
    if refused:
        keep = [index not in refused for index in range(len(steady.request_ids))]
        step.steady, step.at = _take(steady, keep), list(compress(step.at, keep))
    return failed, bool(step.steady.request_ids or step.items)


def _keep_items(step: _Step, is_granted: set[int]) -> None:
    """Keep the other rows the admission policy let run (ids of their items), in order."""
    kept = [id(item) in is_granted for item in step.items]
    step.items, step.items_at = list(compress(step.items, kept)), list(compress(step.items_at, kept))


def _claim_ahead(runner: "GpuDecoderRunner", step: _Step, worker: int) -> None:
    """The rows of the step that the step launched ahead already ran (`_claim`'s rule); the rows
    it ran that nobody claims get their device loop-back token back."""
    step.ahead = ahead = runner._ahead.pop(worker, None)
    if ahead is None:
        return
    ids, items, walk = step.steady.request_ids, step.items, step.steady.walk
    found = list(map(ahead.rows.get, ids, repeat(_NOT_AHEAD)))
    claimed = np.fromiter(map(eq, map(_first, found), repeat(walk)), dtype=bool, count=len(ids))
    there = np.fromiter(map(_second, found), dtype=np.int64, count=len(ids))[claimed]
    pool, label = runner.pool, runner.guidance.first
    for index, item in enumerate(items):  # the other rows, row by row (`_Ahead.holds`: `_claim`'s rule)
        request_id = item.row.request_id
        place = ahead.rows.get(request_id)
        if place is not None and ahead.holds(item, pool.num_tokens((request_id, label))):
            step.items_claimed[index] = place[1]
    runner.num_claimed_rows += int(there.shape[0]) + len(step.items_claimed)
    if ahead.chunks:
        runner.num_claimed_chunks += sum(items[index].row.request_id in ahead.chunks for index in step.items_claimed)
    if len(set(there.tolist()) | set(step.items_claimed.values())) != len(ahead.slots):  # some are nobody's now
        runner._restore_unclaimed(ahead, set(compress(ids, claimed))
                                  | {items[index].row.request_id for index in step.items_claimed})
    # (numpy calls kept few: on a step's cold caches each costs about 5 us here, five times a warm loop's)
    step.claimed, step.there = (claimed, there) if there.shape[0] else (None, there)


def _launch(runner: "GpuDecoderRunner", step: _Step, worker: int) -> None:
    """Launch the rows the step launched ahead does not hold: the steady rows' `RowSpec`s from
    the columns, the other rows' as the per-row path builds them, in step order."""
    steady, items, walk = step.steady, step.items, step.steady.walk
    fresh = step.fresh = None if step.claimed is None else np.flatnonzero(~step.claimed).tolist()
    fresh_items = step.fresh_items = [index for index in range(len(items)) if index not in step.items_claimed]
    num_fresh = len(steady.request_ids) if fresh is None else len(fresh)
    if not (num_fresh or fresh_items):
        return
    decode_walks = runner._decode_walks
    key_glue = runner._key_glue(worker, [walk] * bool(num_fresh) + [items[k].row.walk for k in fresh_items])
    walk_index = {name: index for index, name in enumerate(key_glue.constants.walks)} if key_glue else {}
    pick: Callable[[Sequence[Any]], Sequence[Any]] = (
        (lambda seq: seq) if fresh is None else itemgetter(*fresh) if len(fresh) > 1
        else (lambda seq: (seq[fresh[0]],)) if fresh else (lambda seq: ()))
    num_tokens = steady.column.num_tokens
    specs = list(map(RowSpec, repeat(None), (num_tokens if fresh is None else num_tokens[fresh]).tolist(),
                     steady.column.page_tables(fresh), pick(steady.slots), repeat(walk in decode_walks),
                     repeat(walk_index.get(walk, 0))))
    requests = list(pick(steady.requests))
    calls = [steady.call] * len(requests)
    fed: Optional[list[list[int]]] = None  # a steady row's fed token is among its samples
    if fresh_items:
        pool, label = runner.pool, runner.guidance.first
        other_specs = [RowSpec(None if item.is_loop_back else item.tokens_fed,
                               pool.num_tokens((item.row.request_id, label)),
                               pool.page_table((item.row.request_id, label)),
                               runner._row_slot(item.row.request_id), item.row.walk in decode_walks,
                               walk_index.get(item.row.walk, 0)) for item in (items[k] for k in fresh_items)]
        other_at, fresh_at = [step.items_at[k] for k in fresh_items], pick(step.at)
        specs, step.places = _merged(specs, fresh_at, other_specs, other_at)
        requests, _ = _merged(requests, fresh_at, [items[k].request for k in fresh_items], other_at)
        calls, _ = _merged(calls, fresh_at, [items[k].call for k in fresh_items], other_at)
        # a prompt row's repetition penalty counts the tokens it feeds, as on the per-row path
        fed, _ = _merged([[] for _ in fresh_at], fresh_at, [items[k].tokens_fed for k in fresh_items], other_at)
    step.pending = runner.executor.launch(specs, sampling_of(runner, requests, calls, fed=fed),
                                          *runner._step_bucket, route=runner._route, glue=key_glue)


def _finish(runner: "GpuDecoderRunner", step: _Step) -> list[RowResult]:
    """The step's results in step order: the steady rows' from the columns (`TokenRows`), the
    other rows' as the per-row path gives them."""
    tokens, item_tokens = _tokens(runner, step)
    outputs = _token_outputs(runner, step.steady, tokens)
    steady_logprobs, item_logprobs = _logprobs(runner, step)
    for index, row_logprobs in steady_logprobs.items():
        outputs[index].logprobs = row_logprobs
    if not step.items:
        return outputs
    node, is_cut = runner.node.name, False
    ran = []
    for index, (item, token) in enumerate(zip(step.items, item_tokens)):  # the per-row path's outputs
        if item.row.is_partial:  # a chunk before the last: its KV is written, its token unused
            item.request.history.setdefault(node, []).extend(item.tokens_fed)
            ran.append(RowResult(item.row.request_id))
            is_cut = True
        else:
            ran.append(runner._token_outputs(item, token))
            if index in item_logprobs:
                ran[-1].logprobs = item_logprobs[index]
    merged, _ = _merged(outputs, step.at, ran, step.items_at)
    if not is_cut:
        return merged  # the engine reads the rows' answer in columns (`_token_columns`)
    results = TokenRows(merged)  # a chunk answers no token: no answer in columns
    results.token_ids, results.stop_rows = None, []
    return results


def _tokens(runner: "GpuDecoderRunner", step: _Step) -> tuple[np.ndarray, list[int]]:
    """The sampled tokens of the steady rows (int64, in order) and of the other rows, from the
    step launched here and the step launched ahead."""
    item_tokens = [0] * len(step.items)
    collected: Any = []
    if step.pending is not None:
        collected = runner.executor.collect(step.pending)
        if step.places:  # the other rows' tokens out (last first: each pop leaves the earlier places put)
            values = collected.tolist()
            for index, place in zip(step.fresh_items[::-1], step.places[::-1]):
                item_tokens[index] = values.pop(place)
            collected = values
    if step.claimed is None:  # every steady row launched here
        tokens = np.asarray(collected, dtype=np.int64)
    else:
        tokens = np.empty(len(step.steady.request_ids), dtype=np.int64)
        tokens[step.fresh] = collected
    if step.claimed is not None or step.items_claimed:
        assert step.ahead is not None
        ahead_tokens = step.ahead.collect(runner.executor)
        if step.claimed is not None:
            tokens[step.claimed] = np.asarray(ahead_tokens, dtype=np.int64)[step.there]
        for index, place in step.items_claimed.items():
            item_tokens[index] = ahead_tokens[place]
    return tokens, item_tokens


def _logprobs(runner: "GpuDecoderRunner", step: _Step) -> tuple[dict[int, Any], dict[int, Any]]:
    """The log-probabilities of the rows that asked (`RowResult.logprobs`), by steady row index and
    by index in the other rows, from the step launched here (after `_tokens` collected it) and the
    step launched ahead; two empty dicts when no row asked (neither step computed any)."""
    steady_found: dict[int, Any] = {}
    item_found: dict[int, Any] = {}
    if step.pending is not None:
        launched = runner.executor.collect_logprobs(step.pending)  # by index in the step launched here
        if launched:
            is_item = dict(zip(step.places, step.fresh_items))
            steady_rows = iter(step.fresh if step.fresh is not None else range(len(step.steady.request_ids)))
            for place in range(max(launched) + 1):  # the launched rows in order: the other rows at their places
                index = is_item.get(place)
                if index is not None:
                    if place in launched:
                        item_found[index] = launched[place]
                    continue
                row = next(steady_rows)
                if place in launched:
                    steady_found[row] = launched[place]
    ahead = step.ahead
    if ahead is not None and ahead.logprobs:
        if step.claimed is not None:
            for row, there in zip(np.flatnonzero(step.claimed).tolist(), step.there.tolist()):
                if there in ahead.logprobs:
                    steady_found[row] = ahead.logprobs[there]
        for index, there in step.items_claimed.items():
            if there in ahead.logprobs:
                item_found[index] = ahead.logprobs[there]
    return steady_found, item_found


def _merged(columns: list, columns_at: Sequence[int], others: list, others_at: list[int]) -> tuple[list, list[int]]:
    """The rows of `columns` (at step indices `columns_at`, ascending) and of `others` (at
    `others_at`, ascending; a few) in one list in step order, and the others' places in it."""
    merged = list(columns)
    places = []
    for count, (at, value) in enumerate(zip(others_at, others)):  # ascending: each insert leaves the earlier put
        place = bisect_left(columns_at, at) + count
        merged.insert(place, value)
        places.append(place)
    return merged, places


def _take(steady: SteadyRows, pick: list[bool]) -> SteadyRows:
    """The columns of the kept rows (those the admission policy let run), in step order."""
    return SteadyRows(list(compress(steady.request_ids, pick)), list(compress(steady.requests, pick)), steady.walk,
                      steady.facts, steady.column.take(pick),
                      list(compress(steady.slots, pick)), list(compress(steady.fed, pick)), steady.call,
                      steady.others, None if steady.at is None else list(compress(steady.at, pick)))


def sampling_of(runner: "GpuDecoderRunner", requests: list[RequestState], calls: list[CallInfo],
                num_uncollected: int = 0, pending_slots: Optional[list[int]] = None,
                fed: Optional[list[list[int]]] = None):
    """`runner._sampling`, with the all-greedy answer (None) found without Python work per row
    (calls: each row's, where its logit additions apply; pending_slots: a step launched ahead's
    rows' token table slots, for their penalties; fed: each row's tokens fed this step, which a
    prompt row's repetition penalty counts: a mixed step's prompt rows gave none, so a penalised
    prompt run beside steady decode rows sampled as if its prompt were not there)."""
    if (not any(map(_temperature_of, map(_params_of, requests))) and not any(map(_has_penalty, requests))
            and not any(map(_has_biases, requests)) and not any(map(_wants_logprobs, requests))):
        return None
    return runner._sampling(requests, num_uncollected, fed=fed, calls=calls, pending_slots=pending_slots)


def _token_outputs(runner: "GpuDecoderRunner", steady: SteadyRows, tokens: np.ndarray) -> TokenRows:
    """`_token_outputs` of every row in one pass (no call per row): the fed token joins the
    history, the sampled count and last token move on, the stop check; one `RowResult` a row."""
    node, node_stops = runner.node.name, runner.stop_tokens
    # ignore_eos (vLLM's): the node's stop tokens do not stop a request that asks, where the call
    # sends its token as text (the per-row path's rule)
    is_text = steady.call.sends_text_tokens
    names = [name for name, _ in steady.facts.outputs]
    # one or two outputs (the common cases): a dict literal a row, each output its own list, as before
    width, first, second = len(names), names[0], names[-1]
    token_list = tokens.tolist()
    results = TokenRows()
    stop_rows: list[int] = []
    append, stop = results.append, stop_rows.append
    for index, (request_id, request, fed, token) in enumerate(zip(steady.request_ids, steady.requests, steady.fed,
                                                                    token_list)):
        request.history[node].extend(fed)
        counts, params = request.num_sampled, request.params
        num_sampled = counts[node] = counts.get(node, 0) + 1
        request.last_token[node] = [token]
        # step.row_stop written out (no call a row; the tests compare it with the per-row path's)
        is_stop = token in params.stop_tokens or (token in node_stops and not (is_text and params.ignore_eos))
        is_length = not is_stop and params.max_tokens is not None and num_sampled >= params.max_tokens
        if is_stop or is_length:
            is_stop = True
            stop(index)
        outputs = ({first: [token]} if width == 1 else {first: [token], second: [token]} if width == 2
                   else {name: [token] for name in names})
        append(RowResult(request_id, outputs, is_stop, None, False, is_length))
    if any(map(_has_penalty, steady.requests)):  # `RequestState.count_sampled`'s list, once a step when none has one
        for request, token in zip(steady.requests, token_list):
            if request.has_penalty:
                request.sampled.setdefault(node, []).append(token)
    results.token_ids, results.stop_rows = tokens, stop_rows
    return results


def prelaunch_steady(runner: "GpuDecoderRunner", worker: int,
                     rows: list[tuple[str, str, CallInfo, RequestState]]) -> bool:
    """`GpuDecoderRunner.prelaunch` in columns, for rows of one call whose requests are distinct,
    sampled in the worker's latest step, hold row slots and KV sequences; False (nothing done)
    for other rows, which the per-row path takes. Rows past max_seq_len or whose next page the
    admission policy refuses are left out, as there."""
    if not rows or (runner.offload is not None and _any_on_host(runner.offload, (r[0] for r in rows))):
        return False
    call, walk = rows[0][2], rows[0][1]
    last, row_slots = runner._last_rows.get(worker, set()), runner.held_row_slots
    ids: list[str] = []
    slots: list[int] = []
    for request_id, _, row_call, _ in rows:  # one pass, no call per row
        slot = row_slots.get(request_id)
        if row_call is not call or request_id not in last or slot is None:
            return False
        ids.append(request_id)
        slots.append(slot)
    label = runner.guidance.first
    column = runner.pool.column(list(zip(ids, repeat(label)))) if len(set(ids)) == len(ids) else None
    if column is None:
        return False
    if not runner._facts_of(call).loop_backs:
        return True  # no row loops its token back on the device: nothing runs ahead
    num_cached, num_held = column.num_tokens, column.num_held
    keep = num_cached + 1 <= runner.max_seq_len
    boundary = np.flatnonzero(keep & (num_cached >= num_held)).tolist()  # rows at a page boundary, in order
    if boundary and not _grant_one_page_each(runner, [ids[index] for index in boundary]):
        for index in boundary:
            keep[index] = runner._reserve_tokens(ids[index], (ids[index], label), 1)
    requests = list(map(_fourth, rows))
    if not keep.all():
        pick = keep.tolist()
        ids, slots, requests = (list(compress(values, pick)) for values in (ids, slots, requests))
        if not ids:
            return True
        column = column.take(pick)
    key_glue = runner._key_glue(worker, [walk])
    walk_index = key_glue.constants.walks.index(walk) if key_glue is not None else 0
    specs = list(map(RowSpec, repeat(None), column.num_tokens.tolist(), column.page_tables(), slots, repeat(False),
                     repeat(walk_index)))
    # the step launched last samples first: its sample is not counted yet
    pending = runner.executor.launch(specs, sampling_of(runner, requests, [call] * len(requests), num_uncollected=1,
                                                        pending_slots=slots), glue=key_glue)
    runner._launched_ahead(worker, pending, dict(zip(ids, zip(repeat(walk), range(len(ids))))),
                           dict(zip(ids, slots)), dict(zip(ids, requests)))
    return True
