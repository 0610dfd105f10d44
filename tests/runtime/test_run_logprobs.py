"""`mstar run --prompts` with a line's `logit_bias` (its tokens biased) and `logprobs`: its
outputs.jsonl line carries one `{"token", "logprob", "top"}` per output token, the Python API's
numbers for the same request; a line without gets none; a count out of range is an input error
naming the line; on the simulated engine such a request fails alone, saying why, and the others
run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mstar.cli.mstar import main
from mstar.runtime.serve.api import LLM, SamplingParams

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"
LINES = [{"id": "asks", "prompt_tokens": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "temperature": 0.7, "seed": 3},
         {"id": "plain", "prompt_tokens": [4, 5], "max_tokens": 3}]


def _run(tmp_path, lines, *extra):
    if not PLAN.exists():
        pytest.skip(f"{PLAN} not generated")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    status = main(["run", "--plan", str(PLAN), "--prompts", str(prompts), "--out", str(out), "--no-progress", *extra])
    found = {}
    if (out / "outputs.jsonl").exists():
        found = {r["id"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    return status, found


def test_a_lines_logprobs_reach_its_output_line(tmp_path):
    status, found = _run(tmp_path, LINES)
    assert status == 0
    asks, plain = found["asks"], found["plain"]
    assert "logprobs" not in plain
    with LLM(str(PLAN)) as llm:
        expected = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, logprobs=2, temperature=0.7, seed=3))[0]
    assert asks["output_tokens"] == expected.token_ids
    assert [entry["token"] for entry in asks["logprobs"]] == expected.token_ids
    for entry, (own, top) in zip(asks["logprobs"], expected.logprobs):
        assert entry["logprob"] == pytest.approx(own)
        assert [tuple(pair) for pair in entry["top"]] == pytest.approx(list(top))


def test_a_logprobs_count_out_of_range_is_an_input_error(tmp_path, capsys):
    status, _ = _run(tmp_path, [dict(LINES[0], logprobs=21)])
    assert status == 1
    assert "prompts.jsonl:1: 'logprobs' (the alternatives beside each token) must be in [0, 20], got 21" in \
        capsys.readouterr().err


def test_the_simulated_engine_fails_a_logprobs_request_alone(tmp_path, capsys):
    status, found = _run(tmp_path, LINES, "--engine", "sim")
    assert found["plain"]["finish_reason"] == "length"
    said = "logprobs, prompt_logprobs and logit_bias need a model's logits"
    assert found["asks"]["finish_reason"].startswith(f"error: {said}")
    assert said in capsys.readouterr().err
    assert status == 0  # (a request that fails alone leaves the run's status as it is)


def test_a_lines_logit_bias_biases_its_tokens(tmp_path, capsys):
    status, found = _run(tmp_path, [{"id": "forced", "prompt_tokens": [1, 2, 3], "max_tokens": 3,
                                     "logit_bias": {"42": 100}}])
    assert status == 0 and found["forced"]["output_tokens"] == [42, 42, 42]
    (tmp_path / "bad").mkdir()
    status, _ = _run(tmp_path / "bad", [{"id": "x", "prompt_tokens": [1], "max_tokens": 3, "logit_bias": {"4": 200}}])
    assert status == 1 and "prompts.jsonl:1: logit_bias of token 4 must be a number in [-100, 100]" in \
        capsys.readouterr().err


def test_a_lines_ignore_eos_and_min_tokens_reach_the_request(tmp_path, capsys):
    from mstar.runtime.serve.workload import WorkloadError, parse_prompt_line

    line = '{"id": "a", "prompt_tokens": [1], "max_tokens": 4, "ignore_eos": true, "min_tokens": 3}'
    request = parse_prompt_line(line, "p:1")
    assert request.ignore_eos is True and request.min_tokens == 3
    for bad, words in (('"ignore_eos": 1', "'ignore_eos' must be true or false"),
                       ('"min_tokens": 5', "'min_tokens' must be in [0, max_tokens (4)], got 5")):
        with pytest.raises(WorkloadError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 4, ' + bad + "}", "p:1")


def test_a_lines_prompt_logprobs_reach_its_output_line(tmp_path, capsys):
    line = {"id": "p", "prompt_tokens": [5, 9, 13, 2], "max_tokens": 2, "prompt_logprobs": 1}
    status, found = _run(tmp_path, [line, LINES[1]])
    assert status == 0 and "prompt_logprobs" not in found["plain"]
    with LLM(str(PLAN)) as llm:
        expected = llm.generate([[5, 9, 13, 2]], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    entries = found["p"]["prompt_logprobs"]
    assert [entry["token"] for entry in entries] == [5, 9, 13, 2]
    assert entries[0] == {"token": 5, "logprob": None, "top": []}
    for entry, (own, top) in zip(entries[1:], expected.prompt_logprobs[1:]):
        assert entry["logprob"] == pytest.approx(own)
        assert [tuple(pair) for pair in entry["top"]] == pytest.approx(list(top))
    (tmp_path / "bad").mkdir()
    status, _ = _run(tmp_path / "bad", [dict(line, prompt_logprobs=-1)])
    assert status == 1 and "prompts.jsonl:1: 'prompt_logprobs' (the alternatives beside each prompt token) must be " \
        "in [0, 20], got -1" in capsys.readouterr().err


def test_a_bias_of_hundreds_of_digits_is_refused_naming_it():
    """float() of a 400-digit integer raised OverflowError: `mstar run` ended with an internal error."""
    from mstar.runtime.engine.sampling import SamplingError, logit_bias_pairs

    with pytest.raises(SamplingError, match=r"logit_bias of token 5 must be a number in \[-100, 100\], got 1000.*"
                                            r"\(401 digits\)"):
        logit_bias_pairs({"5": 10 ** 400})
