"""A request's greedy tokens are the same alone or in mixed steps beside others (fp32, CPU)."""
from engine_plans import generate, hybrid_plan, llm_plan
from mstar.runtime.engines.torch_engine import TorchEngine

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
