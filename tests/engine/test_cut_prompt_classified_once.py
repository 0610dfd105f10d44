"""A prompt the scheduler cuts into chunks is classified once per request, not at every chunk step
(values.classify_for_row): each chunk step hands the row the whole prompt again, and re-checking every
token cost more host time than a chunk step's kernels on the GPU. The CPU reference runner
classifies it once; the GPU fast path's (run on the CPU) never classifies the whole prompt, since a
flat token list is checked chunk by chunk (`values.token_list_chunk`). For both, the chunked tokens
still equal the whole prompt's."""
from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.runners import decoder, values
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.bench_kv import with_budget
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine

GENERATED = Path(__file__).resolve().parents[2] / "generated"
PROMPT_LEN = 300
BUDGET = 64


def _engine(plan, is_gpu_runner: bool) -> TorchEngine:
    return fast_path_engine(plan, 256)[0] if is_gpu_runner else TorchEngine(plan, num_pages=256)


def _run(plan, is_gpu_runner: bool) -> tuple[list[int], int]:
    """The long request's tokens, and how often its whole prompt was classified."""
    prompt = [(7 * i + 3) % 500 for i in range(PROMPT_LEN)]
    requests = [Request(id="long", prompt_tokens=prompt, max_tokens=4),
                Request(id="short", prompt_tokens=[5] * 8, max_tokens=6)]
    whole_prompt_calls = 0
    real = values.classify

    def counting(name, value):
        nonlocal whole_prompt_calls
        if isinstance(value, list) and len(value) == PROMPT_LEN:
            whole_prompt_calls += 1
        return real(name, value)

    driver = Driver(plan, _engine(plan, is_gpu_runner))
    # Every module that calls it by name (the runners reach it through values.classify_for_row).
    with mock.patch.object(values, "classify", counting), mock.patch.object(decoder, "classify", counting):
        driver.run(Workload(requests))
    return list(driver.conductor.records["long"].output_tokens), whole_prompt_calls


@pytest.mark.parametrize("is_gpu_runner", [False, True], ids=["cpu_runner", "gpu_runner_on_cpu"])
def test_cut_prompt_is_classified_once(is_gpu_runner: bool):
    base = load_plan(GENERATED / "llama_chunked.plan", verify=False)
    chunked_tokens, calls = _run(with_budget(base, BUDGET), is_gpu_runner)
    expected = 0 if is_gpu_runner else 1
    assert calls == expected, f"the cut prompt was classified {calls} times over {-(-PROMPT_LEN // BUDGET)}+ chunks"
    whole_tokens, _ = _run(with_budget(base, None), is_gpu_runner)
    assert chunked_tokens == whole_tokens and len(chunked_tokens) == 4
