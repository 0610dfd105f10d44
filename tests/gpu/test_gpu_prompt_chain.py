"""A lone prompt's chunk steps launched ahead on a CUDA GPU (skipped without one): the
llama_chunked plan at spec dims with a 128-token step budget, one long prompt and nothing decoding,
so each chunk step after the first is launched while the one before runs (speculation.py's chain of
prompt chunks alone, on the prefill family's piecewise graphs); the same request with the runner
not running ahead gives the same tokens, and every chunk launched ahead is taken by the step
launched for real."""
import dataclasses
from pathlib import Path

import pytest
import torch

from mstar.plan.io import load_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"


def test_a_lone_prompt_runs_ahead_chunk_by_chunk_with_the_same_tokens():
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.glue_loader import load_plan_glue
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.bench_kv import with_budget
    from mstar.runtime.serve.driver import Driver, Workload

    chunked = load_plan(str(GENERATED / "llama_chunked.plan"))
    plan = with_budget(chunked, 128)
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=512,
                         glue=load_plan_glue(GENERATED / "llama_chunked.plan", chunked))
    runner = engine.runners["LLM"]
    assert runner.can_run_ahead
    prompt = [(7 * i) % 500 + 1 for i in range(900)]
    outputs = {}
    for ahead in (True, False):
        runner.can_run_ahead = ahead
        engine.caps = dataclasses.replace(engine.caps, can_launch_ahead=ahead)
        before = (runner.num_ahead_chunks, runner.num_claimed_chunks)
        driver = Driver(plan, engine)
        request_id = f"long-{ahead}"
        driver.run(Workload([Request(id=request_id, prompt_tokens=list(prompt), max_tokens=4)]))
        record = driver.conductor.records[request_id]
        assert record.finish_reason == "length"
        outputs[ahead] = [int(t) for t in record.output_tokens]
        ahead_chunks = runner.num_ahead_chunks - before[0]
        claimed = runner.num_claimed_chunks - before[1]
        if ahead:
            assert ahead_chunks >= 5 and claimed == ahead_chunks, (ahead_chunks, claimed)
        else:
            assert ahead_chunks == 0
    assert outputs[True] == outputs[False]
