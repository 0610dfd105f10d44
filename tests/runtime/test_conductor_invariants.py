"""Conductor behaviour that tests comparing its two paths (columnar, row by row) could not see, as
both share the code: each test here kills a mutant that survived the suite (a mutation audit)."""
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.workload import generate

from runtime_plans import generated
from test_chunked_prefill import with_chunking


def _letters(tokens):
    """One character a token: a text position is a token's place."""
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def _run(plan, **request_fields):
    driver = Driver(plan, SimEngine(plan), decode=_letters)
    driver.run(Workload([Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=40, **request_fields)]))
    return driver.conductor.records["r"]


def test_a_stop_string_that_ends_past_min_tokens_stops_there():
    """A stop string starting inside the first min_tokens tokens' text and ending after it stops the
    request at its end (a search starting after min_tokens' text missed it: the request ran to
    max_tokens)."""
    plan = generated("llama")
    text = _letters(_run(plan).output_tokens)
    record = _run(plan, stop_strings=[text[5:7]], min_tokens=6)
    assert (record.num_output_tokens, record.finish_reason) == (7, "stop"), text


def test_a_stop_string_longer_than_the_search_window_is_found():
    """A 20-character stop string (up to 1,024 are taken) ends the request at its 20th token; a search
    window fixed at 16 tokens' text never found it."""
    plan = generated("llama")
    text = _letters(_run(plan).output_tokens)
    record = _run(plan, stop_strings=[text[:20]])
    assert (record.num_output_tokens, record.finish_reason) == (20, "stop"), text


def test_a_stop_string_split_by_many_tokens_without_text_is_found():
    """Tokens that decode to nothing (special tokens, skipped) between a stop string's characters:
    with more of them than the 16-token window, the text shown was cut at the stop string while the
    request ran on to max_tokens, finishing `length`. The window doubles until its text holds it."""
    plan = generated("llama")
    output = _run(plan).output_tokens
    assert len(set(output[:30])) == 30  # (the sim's tokens: each decodes to its own text below)
    spoken = {output[2]: "x", output[25]: "y"}  # 22 tokens of no text between them

    def decode(tokens):
        return "".join(spoken.get(t, "") for t in tokens)

    driver = Driver(plan, SimEngine(plan), decode=decode)
    driver.run(Workload([Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=40, stop_strings=["xy"])]))
    record = driver.conductor.records["r"]
    assert (record.num_output_tokens, record.finish_reason) == (26, "stop")


def test_a_prompts_last_chunk_leaves_the_rest_of_the_budget_to_the_next_prompt():
    """Two 600-token prompts, a budget and chunk of 512: the third step holds both prompts' last
    chunks (88 + 88); a cut row made ready again with the whole prompt's tokens, not those left,
    was charged a full chunk and the step ran under-filled."""
    plan = with_chunking(generated("llama"), 512, 512)
    driver = Driver(plan, SimEngine(plan))
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[7] * 600, max_tokens=2) for i in range(2)],
                        closed_concurrency=2))
    assert driver.log.num_tokens[:3] == [512, 512, 176]


def test_ended_requests_leave_no_ready_call_in_the_conductor():
    """The conductor's ready-call tables hold no request that ended (finished or cancelled): a
    server would keep every ended request's last call, with its inputs, for ever."""
    plan = generated("orpheus")
    workload = generate(20, prompt_len=(4, 40), output_len=(1, 40), arrival="poisson", concurrency=6, rate=400.0,
                        seed=0)
    workload.cancellations = [(workload.requests[1].arrival_s + 0.001, workload.requests[1].id)]
    driver = Driver(plan, SimEngine(plan))
    driver.run(workload)
    assert all(record.is_finished for record in driver.conductor.records.values())
    assert sum(len(calls) for calls in driver.conductor.ready_calls.values()) == 0
