"""Stop strings in the streamed text (serve/text_stream.py): each step looks only where a stop
string could start in the new text, and shows what a search of the whole text shows; the number
and length of stop strings are bounded (serve/tokenizer.py), on the API, the server's 400 and a
prompts file's line alike."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from mstar.runtime.serve.api import SamplingError, SamplingParams
from mstar.runtime.serve.text_stream import TextStream
from mstar.runtime.serve.tokenizer import MAX_STOP_CHARS, MAX_STOP_STRINGS, stop_text_index
from mstar.runtime.serve.workload import WorkloadError, read_prompts

ALPHABET = "abc "


def _decode(ids: list[int]) -> str:
    return "".join(ALPHABET[i % len(ALPHABET)] for i in ids)


@settings(max_examples=300)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=4),
       st.lists(st.integers(1, 4), min_size=1, max_size=20), st.integers(0, 12))
def test_the_stream_cuts_where_a_whole_text_search_cuts(ids, stops, chunk_sizes, min_tokens):
    """The text ends where a search of the whole text so far cuts, after the first batch of tokens
    that completes a stop string (a longer stop string that began earlier but completes later does
    not count: generation ends at the first, as the conductor ends the request). With min_tokens
    (vLLM's) only a stop string that ends past the first min_tokens tokens' text counts (one
    character a token here), searched once that many tokens have come."""
    stream = TextStream(_decode, stops, min_tokens)
    shown, at, index, expected = [], 0, 0, None
    while at < len(ids):
        size = chunk_sizes[index % len(chunk_sizes)]
        shown.append(stream.add(ids[at:at + size]))
        at, index = at + size, index + 1
        is_searched = stops and at >= min_tokens
        cut = stop_text_index(_decode(ids[:at]), stops, after=min_tokens) if is_searched else None
        if expected is None and cut is not None:
            expected = _decode(ids[:at])[:cut]
    shown.append(stream.finish())
    assert "".join(shown) == (_decode(ids) if expected is None else expected)


def test_too_many_or_too_long_stop_strings_are_refused():
    with pytest.raises(SamplingError, match=f"at most {MAX_STOP_STRINGS} strings") as error:
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]).check()
    assert error.value.param == "stop"
    with pytest.raises(SamplingError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)]).check()
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).check()


def test_a_prompts_file_line_with_too_many_stop_strings_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    line = {"id": "a", "prompt_tokens": [1, 2], "max_tokens": 4, "stop": ["a"] * (MAX_STOP_STRINGS + 1)}
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(WorkloadError, match=r"prompts.jsonl:1: stop takes at most"):
        read_prompts(str(path), tokenizer=object())

