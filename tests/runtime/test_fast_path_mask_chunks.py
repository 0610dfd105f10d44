"""A mask output (a value per position of the call's input) of a prompt cut into chunks covers
the whole prompt on the GPU fast path's runner (built here on the CPU) as on the reference runner:
it covered the last chunk alone before (`GpuDecoderRunner._token_outputs`)."""
from __future__ import annotations


from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine
from spec_text import plan_of

SPEC = """model mk
param max_output_tokens = 64
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=512) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    out llm_mask: mask
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist -> llm_mask: conductor persist
}
walk decode {
    loop decode_loop max=max_output_tokens stop {
        LLM(text_inputs) -> text_inputs: LLM device -> new_token: client text
    }
}
partition LLM = prefill -> decode
"""
CONFIG = """model: mk
max_seq_len: 2048
node_groups:
  - node_names: [LLM]
    ranks: [0]
kv_pool:
  nodes:
    LLM: {max_prefill_chunk_size: 16}
"""


def _mask_lengths(plan, is_fast_path: bool) -> dict[str, int]:
    engine = fast_path_engine(plan, 256)[0] if is_fast_path else TorchEngine(plan, num_pages=256)
    seen: dict[str, int] = {}
    wait = engine.wait

    def watched(handle):
        result = wait(handle)
        seen.update((row.request_id, int(row.outputs["llm_mask"].shape[0])) for row in result.rows
                    if "llm_mask" in row.outputs)
        return result

    engine.wait = watched  # type: ignore[method-assign]
    requests = [Request(id=f"r{n}", prompt_tokens=list(range(10, 10 + n)), max_tokens=3) for n in (5, 40, 70)]
    Driver(plan, engine).run(Workload(requests))
    return seen


def test_a_cut_prompts_mask_covers_every_chunk_on_both_runners(tmp_path):
    plan = plan_of(tmp_path, SPEC, CONFIG)
    expected = {"r5": 5, "r40": 40, "r70": 70}  # prompts of 40 and 70 tokens run in chunks of 16
    assert _mask_lengths(plan, False) == expected
    assert _mask_lengths(plan, True) == expected
