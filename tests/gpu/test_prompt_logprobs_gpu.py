"""A prompt's own log-probabilities on the GPU fast path (engine/prompt_logprobs.py): the step that
scores a prompt keeps every position's final hidden state, on the piecewise graphs that keep them
(both plans' prefill#2 family) and eagerly (`StepExecutor.scores_on_pieces` off), on the llama
plans' graphs and glue at spec dims (bf16); llama_chunked's long prompt is scored a 512-token chunk
a step. The oracle is the
CPU tests': a prompt ending in the model's own greedy continuation, whose tokens' prompt
log-probabilities are what the sampler reported when it drew them, here within bf16's noise
(TOLERANCE: the two come from other kernels, the prompt step's attention against the decode
graphs'; an H100 measured 0.062 at a 1,111-token context). Skipped without a GPU."""
from pathlib import Path

import pytest
import torch

from mstar.runtime.engine.gpu import setup
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.serve.api import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"
HEAD = [128000, 791, 6460, 315, 9822, 374]
TOLERANCE = 0.15  # in log-probability, bf16 (module docstring)


@pytest.mark.parametrize("plan", ["llama.plan", "llama_chunked.plan"])
def test_the_greedy_tail_of_a_prompt_has_the_samplers_logprobs_on_the_gpu(plan, monkeypatch):
    monkeypatch.setattr(setup, "KEEP_HIDDEN_ON_PIECES", True)  # (the default; the test holds it)
    long_head = [(7 * i) % 5000 + 100 for i in range(1100)] + HEAD  # past llama_chunked's 512-token chunks
    with LLM(str(GENERATED / plan), device="cuda", dims="spec") as llm:
        executor = next(r for r in llm.engine.runners.values() if isinstance(r, GpuDecoderRunner)).executor
        keeps = executor.piecewise is not None and executor.piecewise.hidden is not None
        assert keeps  # both plans' prefill#2 family is piecewise
        for on_pieces in (True, False):
            executor.scores_on_pieces = on_pieces
            for head in (HEAD, long_head):
                drawn = llm.generate([head], SamplingParams(max_tokens=9, logprobs=1))[0]
                pieces, eager = executor.num_piecewise_steps, executor.num_eager_steps
                out = llm.generate([head + drawn.token_ids[:8]],
                                   SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1))[0]
                more_pieces, more_eager = executor.num_piecewise_steps - pieces, executor.num_eager_steps - eager
                if on_pieces:  # a step a chunk (llama's prompts are one chunk), every one on the pieces
                    assert more_pieces >= 1 and more_eager == 0
                    assert more_pieces == 1 or plan == "llama_chunked.plan"
                else:
                    assert more_pieces == 0 and more_eager >= 1
                _check(out, head, drawn)


def _check(out, head, drawn):
    assert out.finish_reason == "length"
    # The scoring step's own sampled token: the next of the greedy continuation, with its
    # log-probability (the step that kept every position's states sampled from norm(x + 2 delta)).
    assert out.logprobs[0][0] == pytest.approx(drawn.logprobs[8][0], abs=TOLERANCE), len(head)
    found = out.prompt_logprobs
    assert len(found) == len(head) + 8 and found[0] is None
    assert all(entry is not None and entry[0] <= 1e-6 and len(entry[1]) == 1 for entry in found[1:])
    for position, (own, _) in enumerate(drawn.logprobs[:8], start=len(head)):
        got_own, got_top = found[position]
        assert got_own == pytest.approx(own, abs=TOLERANCE), (len(head), position)
        assert got_own >= got_top[0][1] - TOLERANCE  # the drawn token is the argmax, up to bf16's noise
