"""A penalised prompt row in a step beside steady decode rows (the GPU fast path's decode columns,
`gpu/decode_columns.py`, here on the CPU) counts the tokens it feeds in its repetition penalty, as
the per-row path and the reference runner do: the mixed step launched with no fed tokens, so such a
prompt sampled as if it had none (a greedy token of 131 where both other paths drew 33)."""
from __future__ import annotations

from pathlib import Path

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine

ROOT = Path(__file__).resolve().parents[2]


def _tokens(engine, plan) -> dict[str, list[int]]:
    # `steady` decodes alone for a few steps; `penalised` arrives and prefills beside its decode row
    requests = [Request(id="steady", prompt_tokens=[32], max_tokens=6),
                Request(id="penalised", prompt_tokens=list(range(100, 132)) + [(94 + 7 * j) % 500 for j in range(47)],
                        max_tokens=3, repetition_penalty=1.3, arrival_s=0.003)]
    driver = Driver(plan, engine, clock=_ticks())
    steps = []
    launch = engine.launch

    def launched(step):
        steps.append(sorted((row.request_id, row.walk) for row in step.rows))
        return launch(step)
    engine.launch = launched
    driver.run(Workload(requests))
    assert [("penalised", "prefill"), ("steady", "decode")] in steps  # the mixed step this is about
    return {r: list(x.output_tokens) for r, x in driver.conductor.records.items()}


def _ticks():
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-4
        return now[0]
    return clock


def test_a_penalised_prompt_beside_decode_columns_counts_its_prompt():
    plan = load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False)
    engine, runner = fast_path_engine(plan, 256, max_seq_len=4096)
    assert runner.is_columnar
    assert _tokens(engine, plan) == _tokens(TorchEngine(plan, dims="tiny", num_pages=256), plan)
