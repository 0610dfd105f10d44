"""A request's greedy tokens are the same alone or in mixed steps beside others (fp32, CPU)."""
from hypothesis import given, settings, strategies as st

from engine_plans import generate, hybrid_plan, llm_plan
from mstar.runtime.engine.torch_engine import TorchEngine

PROMPTS = {
    "a": [3, 14, 15, 92, 65, 35, 89, 79],
    "b": [2, 71, 82],
    "c": [1, 41, 42, 13, 56, 23, 73, 9, 9, 9, 9, 100, 200],
    "d": [7],
}


def test_llama_tokens_alone_equal_tokens_mixed():
    alone = {rid: generate(TorchEngine(llm_plan()), {rid: p}, 10)[rid] for rid, p in PROMPTS.items()}
    # Staggered starts: prompt chunks of newcomers share steps with decode rows of earlier requests.
    mixed = generate(TorchEngine(llm_plan()), PROMPTS, 10, start_every=3)
    assert mixed == alone
    together = generate(TorchEngine(llm_plan()), PROMPTS, 10)
    assert together == alone


def test_hybrid_tokens_alone_equal_tokens_mixed():
    alone = {rid: generate(TorchEngine(hybrid_plan()), {rid: p}, 6)[rid] for rid, p in PROMPTS.items()}
    mixed = generate(TorchEngine(hybrid_plan()), PROMPTS, 6, start_every=2)
    assert mixed == alone


@settings(max_examples=8)
@given(st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=12), min_size=2, max_size=5),
       st.integers(0, 3), st.integers(1, 12))
def test_random_mixes_keep_each_request_invariant(prompts, start_every, num_pages):
    """Any prompts, any stagger, any pool size (holds included): each request's tokens as alone."""
    named = {f"r{i}": p for i, p in enumerate(prompts)}
    alone = {rid: generate(TorchEngine(llm_plan(num_pages=64, page_size=4)), {rid: p}, 5)[rid]
             for rid, p in named.items()}
    engine = TorchEngine(llm_plan(num_pages=max(num_pages, 5), page_size=4))
    assert generate(engine, named, 5, start_every=start_every) == alone
