"""`mstar bench engine --host-pack`: the host's share of packing a step, numpy against the glue.

In: a plan, its first kv node, its generated glue module, the iterations. Out: per bench step
(decode 1, 8 and 64 rows at context 1024; 63 decode rows beside a 512-token prompt; 16 x 1024-token
prefill; a cached request's 16-token tail unrolled into 16 decode rows of one new slot), the
microseconds of the host work each packer does before its one copy to the device: `packing.pack`
(numpy: every token's id, position and write slot, every page index, the CSR arrays; a decode
graph's step also lays them out again for the wrapper's buffers, not counted here) against
`GluePacker.host_step` (the row list, the pages granted since a row was last packed, the new token
ids, the three small CSR arrays; steady state, so no page is granted, except the prefix tail's
new slot), and their ratio (the best of five means of `--iters` calls each). Runs on any machine:
no device, no kernel launch (the glue's `pack_step` launch and the numpy path's `fed_ids` are
device-side work that `mstar bench engine` times on a GPU).
"""
from __future__ import annotations

import timeit
from functools import partial
from typing import Callable

import torch

from mstar.runtime.engine.gpu.glue_packing import GluePacker
from mstar.runtime.engine.gpu.packing import RowSpec, pack

CONTEXT = 1024
MAX_POSITIONS = 8192


def _best_us(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    """The best of `repeats` means over `iters` calls: on a shared host the slowest runs measure
    the neighbours, the best ones the code."""
    fn()
    return min(timeit.repeat(fn, number=iters, repeat=repeats)) / iters * 1e6


def _specs(rows: list[tuple[int, int]], page_size: int, loop_walk: int, prompt_walk: int) -> list[RowSpec]:
    specs, next_page = [], 0
    for index, (new, cached) in enumerate(rows):
        num_pages = -(-(new + cached) // page_size)
        tokens = None if new == 1 and cached else [(7 * index + t) % 1000 for t in range(new)]
        specs.append(RowSpec(tokens, cached, list(range(next_page, next_page + num_pages)), index + 1,
                             tokens is None, loop_walk if tokens is None else prompt_walk))
        next_page += num_pages
    return specs


def host_pack(glue, iters: int) -> dict:
    """glue: the KeyGlue the steps are packed with (`bench.bench_glue`)."""
    constants = glue.constants
    page_size = constants.page_size
    mask, num_walks = constants.device_loop_mask, len(constants.walks)
    loop_walk = next((w for w in range(num_walks) if mask >> w & 1), 0)
    prompt_walk = next((w for w in range(num_walks) if not mask >> w & 1), 0)
    batches = sorted(constants.batch_sizes)
    buckets = sorted(constants.token_buckets)
    cases = {f"decode_{r}": ([(1, CONTEXT)] * r, True) for r in (1, 8, 64)}
    cases["mixed_63_1"] = ([(1, CONTEXT)] * 63 + [(512, 0)], False)
    cases["prefill_16x1024"] = ([(1024, 0)] * 16, False)
    out: dict = {"plan_key": constants.key, "page_size": page_size}
    for name, (rows, is_decode) in cases.items():
        specs = _specs(rows, page_size, loop_walk, prompt_walk)
        num_rows, num_tokens = len(rows), sum(new for new, _ in rows)
        padded = next((b for b in batches if b >= num_rows), 0) if is_decode else 0
        bucket = padded or next((t for t in buckets if t >= num_tokens), 0)
        packer = GluePacker(page_size, num_rows + 2, MAX_POSITIONS // page_size, 0, torch.device("cpu"))
        numpy_us = _best_us(partial(pack, specs, page_size, 0, padded_rows=padded, padded_tokens=bucket), iters)
        glue_us = _best_us(partial(packer.host_step, glue, specs, padded or num_rows), iters)
        out[name] = _figures(numpy_us, glue_us)
    out["prefix_tail_16"] = _prefix_tail(glue, page_size, loop_walk, iters)
    return out


def _prefix_tail(glue, page_size: int, loop_walk: int, iters: int) -> dict:
    """A cached request's first step (`mstar bench kv --scenario prefix`): 16 prompt tokens after
    1024 cached, unrolled into 16 decode-graph rows on the request's one slot and page table, whose
    slot the packer has not mirrored yet (a new request), so the step sends its page table."""
    num_pages = -(-(CONTEXT + 16) // page_size)
    table = list(range(num_pages))
    specs = [RowSpec([(7 * i) % 1000], CONTEXT + i, table, 1, True, loop_walk) for i in range(16)]
    packer = GluePacker(page_size, 4, MAX_POSITIONS // page_size, 0, torch.device("cpu"))

    def fresh_step():
        packer.forget(1)
        return packer.host_step(glue, specs, 16)
    numpy_us = _best_us(partial(pack, specs, page_size, 0, padded_rows=16, padded_tokens=16), iters)
    return _figures(numpy_us, _best_us(fresh_step, iters))


def _figures(numpy_us: float, glue_us: float) -> dict:
    return {"numpy_us": round(numpy_us, 1), "glue_host_us": round(glue_us, 1),
            "glue_over_numpy": round(glue_us / numpy_us, 3)}


def table(result: dict) -> str:
    lines = [f"host work to pack a step ({result['plan_key']}, page size {result['page_size']}); best-of-5 us",
             f"{'step':<18}{'numpy':>10}{'glue host':>11}{'ratio':>8}"]
    for name, value in result.items():
        if isinstance(value, dict):
            lines.append(f"{name:<18}{value['numpy_us']:>10.1f}{value['glue_host_us']:>11.1f}"
                         f"{value['glue_over_numpy']:>8.3f}")
    return "\n".join(lines)
