"""Step token budgets, chunk sizes, caps and token buckets (check_chunking.py, MW421 and MW422)
beyond their golden fixtures: each case is one a mutation of the checks passed every other test
with (the equality clause of MW421, a walk's widest rows, a combined walk's cap, a walk that runs
the node both outside and inside a loop; MW422 without a budget or without chunking, and for a
combined walk none of whose walks is cut)."""
from pathlib import Path

import pytest

from checks_golden import check_texts

BASE = (Path(__file__).parent / "fixtures" / "base.mw").read_text()
ONE_RANK = "model: base\nmax_seq_len: 2048\nnode_groups:\n  - node_names: [LLM, codec]\n    ranks: [0]\n"


def _found(spec: str, config: str) -> list[tuple[str, str, int]]:
    return [(d.code, d.span.file, d.span.line) for d in check_texts(spec, config).sorted()]


def _edit(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new)


@pytest.mark.parametrize("spec, deployment, found", [
    # MW421 with prompts cut: 16 decode rows must leave a token of the budget for a chunk
    (BASE, "max_step_tokens: 16\nscheduler_owns_chunking: true\n", [("MW421", "m.yaml", 6)]),
    (BASE, "max_step_tokens: 17\nscheduler_owns_chunking: true\n", []),
    # the walk's widest batched family counts: 16 rows x 4 tokens, past 32
    (_edit("    capture decode batched batch=[1, 2, 4, 8, 16]\n",
           "    capture decode batched batch=[1, 2, 4, 8, 16]\n"
           "    capture decode batched batch=[1, 2, 4] tokens_per_row=4\n"),
     "max_step_tokens: 32\n", [("MW421", "m.yaml", 6)]),
    # the combined walk's cap of 16 counts when it is above decode's own 8
    (_edit("    cap decode 16\n    capture decode batched batch=[1, 2, 4, 8, 16]\n",
           "    cap decode 8\n    capture decode batched batch=[1, 2, 4, 8]\n"),
     "max_step_tokens: 12\n", [("MW421", "m.yaml", 6)]),
    # ... as its cap less the one row of another walk that makes a step mixed: 15 decode rows and a
    # token of a chunk fit 16 (the combine's 16 rows were counted, and 16 refused)
    (_edit("    cap decode 16\n    capture decode batched batch=[1, 2, 4, 8, 16]\n",
           "    cap decode 8\n    capture decode batched batch=[1, 2, 4, 8]\n"),
     "max_step_tokens: 16\nscheduler_owns_chunking: true\n", []),
    (_edit("    cap decode 16\n    capture decode batched batch=[1, 2, 4, 8, 16]\n",
           "    cap decode 8\n    capture decode batched batch=[1, 2, 4, 8]\n"),
     "max_step_tokens: 15\nscheduler_owns_chunking: true\n", [("MW421", "m.yaml", 6)]),
    # a budget without chunking cuts no prompt: the packed captures need no bucket of it
    (BASE, "max_step_tokens: 512\n", []),
    # chunking without a budget: the packed captures need a bucket of one chunk
    (BASE, "scheduler_owns_chunking: true\nmax_prefill_chunk_size: 512\n",
     [("MW422", "m.mw", 13), ("MW422", "m.mw", 17)]),
])
def test_budgets_and_captures_of_the_base_spec(spec, deployment, found):
    assert _found(spec, ONE_RANK + deployment) == found


CONFIG = "model: m\nmax_seq_len: 2048\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\nmax_step_tokens: %d\n"

PROMPT_THEN_LOOP = """model m
param max_output_tokens = 64
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    in tok: tokens
    out tok: tokens
    out new_token: tokens
    cap gen 32
}
walk gen {
    LLM(text_inputs) -> tok: LLM
    loop decode_loop max=max_output_tokens stop {
        LLM(tok) -> tok: LLM device
                 -> new_token: client text
    }
}
partition P = gen
"""


def test_a_walk_that_runs_the_node_in_a_loop_after_its_prompt_has_fixed_rows():
    """MW421 judges a walk with any call of the node in a loop, not only one whose every call is."""
    assert _found(PROMPT_THEN_LOOP, CONFIG % 16) == [("MW421", "m.yaml", 6)]
    assert _found(PROMPT_THEN_LOOP, CONFIG % 32) == []


TWO_DECODES = """model m
param max_output_tokens = 64
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    capture prefill packed batch=[1, 2] tokens=[64]
    combine decodes = %s {
        capture packed batch=[1, 4] tokens=[8]
    }
}
walk prefill {
    LLM(text_inputs) -> new_token: conductor persist
}
walk decode {
    loop decode_loop max=max_output_tokens stop {
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }
}
walk decode_b {
    loop decode_loop max=max_output_tokens stop {
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }
}
partition P = prefill -> (decode | decode_b)
"""


def test_a_combined_walk_whose_walks_are_never_cut_needs_no_bucket_of_the_budget():
    config = CONFIG % 64 + "scheduler_owns_chunking: true\n"
    assert _found(TWO_DECODES % "decode + decode_b", config) == []
    assert _found(TWO_DECODES % "prefill + decode_b", config) == [("MW422", "m.mw", 9)]


def test_without_a_budget_mw422_points_at_the_chunk_size():
    found = check_texts(BASE, ONE_RANK + "scheduler_owns_chunking: true\nmax_prefill_chunk_size: 512\n").sorted()
    assert {d.code for d in found} == {"MW422"}
    for diagnostic in found:
        assert "holds one prefill chunk (512 tokens" in diagnostic.message
        assert diagnostic.message.endswith("or lower the chunk size")
        assert [(n.message, n.span.line) for n in diagnostic.notes] == [("the chunk size is set here", 7)]
