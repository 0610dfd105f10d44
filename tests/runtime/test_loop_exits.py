"""Where a loop's `outputs` and `accumulate` values go (docs/language.md "Loop"): once, when the
loop ends, along the edge that made them; `accumulate` as one list of every iteration's value."""
from spec_text import plan_of, run

from mstar.runtime.conductor.request import Request

SPEC = """model acc
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
}
walk gen {
    loop gen_loop max=4 {
        LLM(text_inputs) -> text_inputs: LLM -> new_token: client text
    } KEEP new_token
}
partition P = gen
"""
CONFIG = "model: acc\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


def emissions(tmp_path, keep: str):
    plan = plan_of(tmp_path, SPEC.replace("KEEP", keep), CONFIG)
    record = run(plan, [Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=20)])["r"]
    assert record.finish_reason in ("done", "stop", "length"), record.finish_reason
    return [e.value for e in record.emissions if e.modality == "text"]


def test_accumulate_emits_one_list_of_every_iteration(tmp_path):
    values = emissions(tmp_path, "accumulate")
    assert len(values) == 1 and isinstance(values[0], list) and len(values[0]) == 4


def test_outputs_emit_the_last_iteration_once(tmp_path):
    values = emissions(tmp_path, "outputs")
    assert len(values) == 1 and not (isinstance(values[0], list) and len(values[0]) == 4)
