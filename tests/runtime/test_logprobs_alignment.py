"""Property test: every one-token text emission of a request that asked for log-probabilities
carries the log-probabilities of that very token, and no other emission carries any, over random
workloads on the CPU engine and the GPU fast path's runner (on the CPU, run ahead or not): prompts
whole or cut into chunks (llama_chunked), requests of several partitions whose nodes send text and
audio codes (Qwen3-Omni's Thinker and Talker), stop tokens, requests beside ones that ask for none.
The engine's numbers are replaced by the token itself (`_tagged`), so an answer attached to the
wrong emission, or lost on a conductor path, shows."""
from __future__ import annotations

from hypothesis import given, strategies as st

from fast_path_cpu import fast_path_engine
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from runtime_plans import generated

PLANS = ["llama", "llama_chunked", "qwen3_omni"]
_LOADED: dict = {}


def _plan(name):
    if name not in _LOADED:
        _LOADED[name] = generated(name)
    return _LOADED[name]


def _tagged(engine):
    """The engine, its answers' log-probabilities replaced by (the row's token, ((token, 0.0),))."""
    wait = engine.wait

    def tagged(handle):
        result = wait(handle)
        for row in result.rows:
            if row.logprobs is not None:
                token = next(v[0] for v in row.outputs.values() if type(v) is list and len(v) == 1)
                row.logprobs = (float(token), ((token, 0.0),))
        return result
    engine.wait = tagged
    return engine


request_st = st.tuples(st.integers(1, 40), st.integers(1, 6), st.booleans(), st.integers(0, 2))


@given(st.sampled_from(PLANS), st.sampled_from(["reference", "fast", "fast ahead"]),
       st.lists(request_st, min_size=1, max_size=5))
def test_each_text_token_carries_its_own_logprobs(name, engine_kind, specs):
    plan = _plan(name)
    if engine_kind == "reference" or name == "qwen3_omni":  # (the fast path takes one kv node of a plan)
        engine = TorchEngine(plan, num_pages=96)
    else:
        engine = fast_path_engine(plan, 96, max_seq_len=4096, can_run_ahead=engine_kind == "fast ahead")[0]
    requests = [Request(id=f"r{i}", prompt_tokens=[(7 * i + 3 * j) % 50 + 1 for j in range(length)],
                        max_tokens=max_tokens, logprobs=1 if asks else None, stop_tokens=[5 + i] if stop == 1 else [])
                for i, (length, max_tokens, asks, stop) in enumerate(specs)]
    driver = Driver(plan, _tagged(engine))
    driver.run(Workload(requests))
    for request in requests:
        record = driver.conductor.records[request.id]
        assert record.finish_reason in ("stop", "length", "done"), record.finish_reason
        texts = [index for index, (kind, is_token) in enumerate(zip(record.emission_kinds, record.emission_is_token))
                 if kind[1] == "text" and is_token]
        if request.logprobs is None:
            assert not record.emission_logprobs
            continue
        assert texts and sorted(record.emission_logprobs) == texts
        for index in texts:
            assert record.emission_logprobs[index][0] == float(record.emission_values[index])
