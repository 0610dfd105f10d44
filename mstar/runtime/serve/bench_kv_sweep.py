"""`mstar bench kv --scenario chunk --budgets 224,192 --chunk-rounds 3`: the chunk scenario's two
ratios at several step token budgets, each budget run in every round, in one process.

Why: on a GPU the two ratios move from run to run by more than a budget step changes them (on the
H200 at budget 192 the TTFT ratio read 1.35x, 1.52x, 1.55x and 1.40x in four runs of one session),
so which budget meets both targets is a count over runs, and the runs of the budgets compared must
be interleaved in time: round r runs the budgets in the order given, the next round in the reverse
order, so a drift of the machine's speed over the call lands on every budget alike. One process
also spares each run the interpreter's and the device's start.

Before the rounds, each budget runs once uncounted: a fresh process compiles its kernels in its
first runs. Each run is the chunk scenario's chunked variant alone (`bench_kv.chunk_scenario` on the plan with
that budget and chunk size, `bench_kv.with_budget`; the plan's own, or `--budget`, with
`--chunk-rounds` alone): the decode rows alone, with the long prompt, and the long prompt alone.
Out: per budget, each run's decode ITL p99 ratio and TTFT ratio and how many runs met both targets
(ITL within `ITL_TARGET`, TTFT within `TTFT_TARGET`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

ITL_TARGET = 2.0  # the decode rows' inter-token p99 during the prefill over steady state
TTFT_TARGET = 1.5  # the long prompt's TTFT beside the decode rows over alone
# What each run keeps of `chunk_scenario`'s figures.
KEPT = ("itl_p99_ratio", "ttft_ratio", "itl_p99_during_ms", "itl_p99_steady_ms", "ttft_mixed_ms", "ttft_alone_ms",
        "num_decode_ended_in_window")
Budget = Optional[int]  # a step token budget (and chunk size); None: the plan's own


def meets_both(run: dict[str, Any]) -> bool:
    itl, ttft = run.get("itl_p99_ratio"), run.get("ttft_ratio")
    return itl is not None and ttft is not None and itl <= ITL_TARGET and ttft <= TTFT_TARGET


def round_order(budgets: list[Budget], round_index: int) -> list[Budget]:
    """The budgets in the order given on even rounds, reversed on odd ones."""
    return budgets if round_index % 2 == 0 else budgets[::-1]


def label(budget: Budget) -> str:
    return "plan" if budget is None else str(budget)


def sweep(budgets: list[Budget], rounds: int, run_at: Callable[[Budget], dict[str, Any]]) -> dict[str, Any]:
    """Every budget once a round (`round_order`), after one run of each not counted (the warm-up);
    `run_at(budget)` runs the chunk scenario at that budget (None: the plan's own)."""
    # A fresh process compiles kernels in its first runs (a budget's chunk sizes their own shapes):
    # on an H100 the first counted run at budget 224 once read a TTFT ratio of 0.90 and no ITL
    # ratio at all, its 40 decode rows ended before the long prompt's first token; the next two
    # runs 1.28 and 1.30 with ITL ratios 1.44 and 1.42.
    for budget in budgets:
        run_at(budget)
    runs: dict[Budget, list[dict[str, Any]]] = {budget: [] for budget in budgets}
    order: list[str] = []
    for round_index in range(rounds):
        for budget in round_order(budgets, round_index):
            figures = run_at(budget)
            runs[budget].append({key: figures.get(key) for key in KEPT} | {"round": round_index})
            order.append(label(budget))
    return {"rounds": rounds, "order": order, "itl_target": ITL_TARGET, "ttft_target": TTFT_TARGET,
            "budgets": {label(budget): {"runs": budget_runs, "num_met": sum(map(meets_both, budget_runs))}
                        for budget, budget_runs in runs.items()}}


def _ratios(runs: list[dict[str, Any]], key: str) -> str:
    return ", ".join("-" if run[key] is None else f"{run[key]:.2f}" for run in runs)


def render(result: dict[str, Any]) -> str:
    lines = [f"budget sweep: the chunked variant, {result['rounds']} round(s) after a warm-up run of each budget "
             f"(not counted), each round every budget (order reversed every other round); targets: ITL p99 "
             f"ratio <= {result['itl_target']:g}x, TTFT ratio <= {result['ttft_target']:g}x"]
    for budget, entry in result["budgets"].items():
        runs = entry["runs"]
        lines.append(f"budget {budget:>6}: ITL p99 ratio {_ratios(runs, 'itl_p99_ratio')}; "
                     f"TTFT ratio {_ratios(runs, 'ttft_ratio')}; both met in {entry['num_met']} of {len(runs)}")
        ended = sum(run["num_decode_ended_in_window"] or 0 for run in runs)
        if ended:
            lines.append(f"budget {budget:>6}: WARNING {ended} decode rows ended before the long prompt's first "
                         f"token (over its runs): those runs' ratios cover part of the prefill only")
    return "\n".join(lines)
