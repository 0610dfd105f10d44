"""Log-probabilities (SamplingParams.logprobs) are the model's own: at every generated position, the
sampled token's and the N alternatives' equal transformers' log_softmax over the same checkpoint's
logits, whatever the sampling settings that picked the token (temperature, top-k, penalties), on
every conductor path a token takes (the prefill's first token, the decode loop's). Asking for them
changes no token; a request beside one that asks gets none."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.runtime.serve.api import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"
VOCAB = 96
PROMPT = [5, 17, 33, 3, 70, 42, 7]
NUM_NEW = 9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_logprobs")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than HF's init: distributions far from uniform
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[1] ** -0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


@pytest.fixture(scope="module")
def llm(checkpoint):
    if not PLAN.exists():
        pytest.skip(f"{PLAN} not generated")
    with LLM(str(PLAN), weights=[str(checkpoint[0])]) as served:
        yield served


def _hf_logprobs(model, prompt, tokens):
    """transformers' log_softmax at each position that predicted one of `tokens`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("settings", [
    dict(),  # greedy
    dict(temperature=0.9, top_k=20, seed=4),
    dict(temperature=1.1, top_p=0.8, seed=9, repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.3),
])
def test_logprobs_are_transformers_log_softmax(llm, checkpoint, settings):
    _, model = checkpoint
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_NEW, logprobs=5, **settings))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == NUM_NEW
    assert len(out.logprobs) == NUM_NEW
    expected = _hf_logprobs(model, PROMPT, out.token_ids)
    for position, (token, (own, alternatives)) in enumerate(zip(out.token_ids, out.logprobs)):
        row = expected[position]
        assert own == pytest.approx(row[token].item(), abs=1e-4), position
        values, ids = row.topk(5)
        assert [token_id for token_id, _ in alternatives] == ids.tolist(), position
        assert [value for _, value in alternatives] == pytest.approx(values.tolist(), abs=1e-4)
    if not settings:  # greedy: the sampled token is the most likely one
        assert all(own == alternatives[0][1] for own, alternatives in out.logprobs)


def test_asking_for_logprobs_changes_no_token_and_a_neighbour_gets_none(llm):
    settings = dict(max_tokens=NUM_NEW, temperature=1.0, seed=2)
    plain = llm.generate([PROMPT], SamplingParams(**settings))[0]
    asked, beside = llm.generate([PROMPT, PROMPT[:4]], [SamplingParams(logprobs=0, **settings),
                                                        SamplingParams(**settings)])
    assert asked.token_ids == plain.token_ids
    assert [alternatives for _, alternatives in asked.logprobs] == [()] * NUM_NEW
    assert beside.logprobs is None and plain.logprobs is None


@pytest.mark.parametrize("value, words", [(21, "logprobs must be in [0, 20]"), (-1, "logprobs must be in [0, 20]"),
                                          (1.5, "logprobs must be an integer")])
def test_a_logprobs_count_out_of_range_is_refused_before_it_runs(llm, value, words):
    from mstar.runtime.serve.api import SamplingError

    with pytest.raises(SamplingError, match=words.replace("[", r"\[").replace("]", r"\]")):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=value))
