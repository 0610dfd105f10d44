"""The Python API (`from mstar import LLM`): generate and async stream on the CPU torch engine,
with the same tokens as the ordinary run loop (`mstar run`'s Driver) on the same engine; a
stream left early cancels its request; text deltas never show a stop string; the simulated
engine paced to the wall clock takes the cost model's time."""
from __future__ import annotations

import asyncio
import time

import pytest

from mstar import LLM, SamplingParams
from mstar.arg_types import shown
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.api import PromptError, SamplingError
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.text_stream import TextStream
from serve_harness import LLAMA, wait_until, write_tokenizer


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(LLAMA, tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok")))) as llm:
        yield llm


def test_generate_gives_the_tokens_of_the_run_loop(llm):
    prompts = [[1, 9, 10], [1, 11, 12, 13, 14], [1, 15]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=7))
    driver = Driver(llm.plan, llm.engine)  # the loop `mstar run` uses, on the same (idle) engine
    driver.run(Workload([Request(id=f"run-{i}", prompt_tokens=p, max_tokens=7) for i, p in enumerate(prompts)],
                        closed_concurrency=3))
    assert [o.token_ids for o in outputs] == [driver.conductor.records[f"run-{i}"].output_tokens for i in range(3)]
    assert [o.finish_reason for o in outputs] == ["length"] * 3
    decode = llm.tokenizer.decode  # the text a completion adds to its prompt's
    assert outputs[0].text == decode(prompts[0] + outputs[0].token_ids)[len(decode(prompts[0])):]


def test_text_and_chat_prompts(llm):
    text, chat = llm.generate(["hello world", {"messages": [{"role": "user", "content": "hello"}]}],
                              SamplingParams(max_tokens=3))
    assert text.prompt_token_ids == [1, 15, 16]
    assert chat.prompt_token_ids == llm.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert text.num_output_tokens == chat.num_output_tokens == 3


def test_stream_yields_each_step_and_leaving_early_cancels(llm):
    async def whole():
        return [d async for d in llm.stream([1, 9, 10], SamplingParams(max_tokens=7))]

    async def leave_after_two():
        seen = []
        async for delta in llm.stream([1, 9, 10], SamplingParams(max_tokens=2000)):
            seen.append(delta)
            if len(seen) == 2:
                break
        return seen

    deltas = asyncio.run(whole())
    assert len(deltas) == 7 and deltas[-1].finish_reason == "length"
    expected = llm.generate([[1, 9, 10]], SamplingParams(max_tokens=7))[0].token_ids
    assert [t for d in deltas for t in d.token_ids] == expected
    assert len(asyncio.run(leave_after_two())) == 2
    assert wait_until(lambda: llm.loop.num_in_flight == 0)
    assert all(in_use == 0 for in_use, _ in llm.engine.kv_pages().values())


@pytest.mark.parametrize("prompt,sampling,error,words", [
    ([], SamplingParams(), PromptError, "empty"),
    ([1, -2], SamplingParams(), PromptError, "non-negative"),
    ([1, 2], SamplingParams(temperature=-1.0), SamplingError, "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), SamplingError, "top_p"),
    ([1] * 7000, SamplingParams(max_tokens=2000), PromptError, "max_seq_len"),
    ([1, 2], SamplingParams(max_tokens=2050), SamplingError, "at most 2049 output tokens"),  # the loop's 2048 + 1
    ({"messages": "hi"}, SamplingParams(), PromptError, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, SamplingParams(), PromptError,
     "only text content parts"),
    ([[1, 2], [3]], SamplingParams(), PromptError, "one prompt was expected"),  # said "non-negative integers"
])
def test_bad_input_is_a_clear_error(llm, prompt, sampling, error, words):
    with pytest.raises(error, match=words):
        llm.generate([prompt], sampling)


def test_sampling_may_be_a_list_of_one_a_prompt(llm):
    """As vLLM's generate: each prompt runs with its own entry, as it would alone; None takes the
    defaults; a list of another length, or an entry at a request's place, is refused before any
    request runs."""
    prompts = [[1, 9, 10], [1, 11, 12]]
    each = llm.generate(prompts, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5, stop_token_ids=[])])
    alone = [llm.generate([p], s)[0] for p, s in zip(prompts, (SamplingParams(max_tokens=2),
                                                              SamplingParams(max_tokens=5)))]
    assert [o.token_ids for o in each] == [o.token_ids for o in alone]
    assert [o.num_output_tokens for o in each] == [2, 5]
    assert llm.generate([[1, 2]], [None])[0].num_output_tokens == SamplingParams().max_tokens
    assert llm.generate([1, 2], (SamplingParams(max_tokens=3),))[0].num_output_tokens == 3  # one prompt
    with pytest.raises(SamplingError, match="a list of 1 SamplingParams for 2 prompt"):
        llm.generate(prompts, [SamplingParams(max_tokens=2)])
    with pytest.raises(SamplingError, match="carries its own"):
        llm.generate([llm.request([1, 2]), [1, 3]], [SamplingParams(), None])
    mixed = llm.generate([llm.request([1, 2], SamplingParams(max_tokens=4)), [1, 3]],
                         [None, SamplingParams(max_tokens=1)])
    assert [o.num_output_tokens for o in mixed] == [4, 1]
    with pytest.raises(SamplingError, match="temperature"):
        llm.generate(prompts, [SamplingParams(), SamplingParams(temperature=-1.0)])
    with pytest.raises(SamplingError, match="must be a SamplingParams, got dict"):
        llm.generate(prompts, [SamplingParams(), {"max_tokens": 2}])
    assert wait_until(lambda: llm.loop.num_in_flight == 0)


def test_output_penalties_are_batch_invariant(llm):
    """A penalised request gives the tokens it gives alone beside requests without penalties (each
    row counts its own outputs), and a penalty of 0 is none."""
    prompts = [[1, 9, 10], [1, 11, 12], [1, 13]]
    penalised = SamplingParams(max_tokens=12, presence_penalty=1.5, frequency_penalty=-0.5)
    alone = llm.generate([prompts[1]], penalised)[0].token_ids
    batch = llm.generate(prompts, [SamplingParams(max_tokens=12), penalised, SamplingParams(max_tokens=12)])
    assert batch[1].token_ids == alone
    zero = SamplingParams(max_tokens=12, presence_penalty=0.0, frequency_penalty=0)
    assert llm.generate([prompts[0]], zero)[0].token_ids == batch[0].token_ids
    with pytest.raises(SamplingError, match=r"presence_penalty must be in \[-2, 2\]") as refused:
        llm.generate([prompts[0]], SamplingParams(presence_penalty=3))
    assert refused.value.param == "presence_penalty"
    with pytest.raises(SamplingError, match="frequency_penalty must be a number"):
        llm.generate([prompts[0]], SamplingParams(frequency_penalty="1"))


def test_chat_content_parts_are_joined_as_the_server_joins_them(llm):
    """OpenAI's text content parts: the API refused them while the server joined them."""
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}]
    (joined,), (plain,) = (llm.generate([{"messages": [{"role": "user", "content": content}]}],
                                        SamplingParams(max_tokens=3)) for content in (parts, "hello world"))
    assert joined.prompt_token_ids == plain.prompt_token_ids and joined.token_ids == plain.token_ids


def test_text_stream_never_shows_a_stop_string(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("the cat sat on the mat a dog ran")[1:]
    stream = TextStream(tokenizer.decode, ["on the"])
    shown = "".join(stream.add([t]) for t in ids) + stream.finish()
    full = tokenizer.decode(ids)
    assert shown == full[:full.index("on the")] and "on" not in shown.split()
    plain = TextStream(tokenizer.decode)
    assert "".join(plain.add([t]) for t in ids) + plain.finish() == full


def test_the_simulated_engine_takes_its_modelled_time_when_paced():
    from mstar.runtime.engine.sim import SimEngine

    with LLM(LLAMA, engine="sim", sim_pace=20) as paced:
        started = time.monotonic()
        paced.generate([[1, 2, 3]], SamplingParams(max_tokens=20))
        paced_s = time.monotonic() - started
        sim = SimEngine(paced.plan)
        Driver(paced.plan, sim).run(Workload([Request(id="a", prompt_tokens=[1, 2, 3], max_tokens=20)]))
    assert sim.clock() > 0 and paced_s >= 20 * sim.clock()  # the modelled seconds, slept 20x over


@pytest.mark.parametrize("values", [{"temperature": 10**400}, {"repetition_penalty": float("inf")},
                                    {"top_p": float("nan")}])
def test_a_sampling_number_past_floats_is_refused_before_it_runs(values):
    """`temperature=10**400` passed the check and failed in the torch engine (the sim ran it): the
    API's and the engines' one range check (runtime/step.py `sampling_range_problem`) refuses it."""
    from mstar.runtime.step import sampling_range_problem

    (name, _), = values.items()
    with pytest.raises(SamplingError, match=f"{name} must be a finite number") as error:
        SamplingParams(**values).check()
    assert error.value.param == name
    fields = {"temperature": None, "top_k": None, "top_p": None, "seed": None, "repetition_penalty": None}
    assert sampling_range_problem(**{**fields, **values}, show=shown).startswith(f"{name} must be a finite number")


def test_requests_without_a_seed_draw_apart_and_repeat_with_the_llms_seed():
    """An unseeded request samples with seed x 1000003 + i (i counting the LLM's unseeded
    requests): two of one prompt differ, and a second LLM of the same seed repeats the first's
    draws in order; a request's own seed is kept."""
    sampled = SamplingParams(max_tokens=6, temperature=1.0)
    found = []
    for _ in range(2):
        with LLM(LLAMA, seed=5) as llm:
            found.append([o.token_ids for o in llm.generate([[1, 9, 10]] * 3, sampled)])
            seeded = llm.generate([[1, 9, 10]] * 2, SamplingParams(max_tokens=6, temperature=1.0, seed=11))
            assert seeded[0].token_ids == seeded[1].token_ids
            assert llm.request([1, 9, 10], sampled).seed == 5 * 1_000_003 + 3
    assert len({tuple(ids) for ids in found[0]}) == 3
    assert found[0] == found[1]
