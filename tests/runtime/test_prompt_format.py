"""A plan's prompt format (spec `prompt_format`) framing text prompts: the Orpheus plan's, and
refusals. The tokenizer here is a stand-in that spells each word as its length, so the framed
tokens can be written out by hand."""
import json
from pathlib import Path

import pytest

from mstar.plan.io import load_plan
from mstar.plan.schema import PromptFormatPlan
from mstar.runtime.serve.prompt_format import PromptFormatError, format_prompt, prompt_format_of
from mstar.runtime.serve.workload import WorkloadError, read_prompts

GENERATED = Path(__file__).resolve().parents[2] / "generated"


class WordLengths:
    """encode(text): a BOS (1) then the length of each space-separated word."""

    def encode(self, text):
        return [1] + [len(word) for word in text.split()]


def _prompts(tmp_path, *lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_orpheus_plan_frames_voice_and_text():
    form = prompt_format_of(load_plan(str(GENERATED / "orpheus.plan")))
    assert form is not None and form.fields == ["voice"] and form.defaults == {"voice": "tara"}
    assert format_prompt(form, WordLengths(), "hello there", {"voice": "leo"}) == [
        128259, 1, 4, 5, 5, 128009, 128260, 128261, 128257]  # "leo:" "hello" "there"
    assert format_prompt(form, WordLengths(), "hi", {}) == [128259, 1, 5, 2, 128009, 128260, 128261, 128257]


def test_plan_without_prompt_format_reads_text_as_written():
    assert prompt_format_of(load_plan(str(GENERATED / "llama.plan"))) is None


def test_prompts_file_fields_fill_the_template(tmp_path):
    form = prompt_format_of(load_plan(str(GENERATED / "orpheus.plan")))
    path = _prompts(tmp_path, {"id": "a", "prompt": "good day", "voice": "zac", "max_tokens": 8},
                    {"id": "b", "prompt": "good day", "max_tokens": 8})
    requests = read_prompts(path, tokenizer=WordLengths(), form=form).requests
    assert requests[0].prompt_tokens[1:4] == [1, 4, 4] and requests[1].prompt_tokens[1:4] == [1, 5, 4]


def test_field_without_value_or_default_is_refused():
    form = PromptFormatPlan(template="<{speaker}> {prompt}", fields=["speaker"])
    with pytest.raises(PromptFormatError, match="needs 'speaker'"):
        format_prompt(form, WordLengths(), "hi", {})
    with pytest.raises(PromptFormatError, match="non-empty text"):
        format_prompt(form, WordLengths(), "hi", {"speaker": 3})


def test_messages_and_unknown_fields_are_refused_with_the_line(tmp_path):
    form = prompt_format_of(load_plan(str(GENERATED / "orpheus.plan")))
    chat = _prompts(tmp_path, {"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    with pytest.raises(WorkloadError, match=r"prompts.jsonl:1: .*takes no chat 'messages'"):
        read_prompts(chat, tokenizer=WordLengths(), form=form)
    typo = _prompts(tmp_path, {"id": "a", "prompt": "hi", "vocie": "leo", "max_tokens": 8})
    with pytest.raises(WorkloadError, match="unknown field"):
        read_prompts(typo, tokenizer=WordLengths(), form=form)
    # a format field beside token ids frames nothing: it was ignored, whatever its value (`"voice": 5` ran)
    for voice in ("leo", 5):
        ids = _prompts(tmp_path, {"id": "a", "prompt_tokens": [1, 2], "voice": voice, "max_tokens": 8})
        with pytest.raises(WorkloadError, match=r"prompts.jsonl:1: 'voice' is a field of the plan's prompt format"):
            read_prompts(ids, tokenizer=WordLengths(), form=form)


def test_a_lone_surrogate_is_placed_in_what_the_client_sent():
    """The position counts from the client's text or field, not from the framed text ("leo: " first)."""
    form = prompt_format_of(load_plan(str(GENERATED / "orpheus.plan")))
    with pytest.raises(PromptFormatError, match=r"^the text is not valid Unicode: .* at character 3$"):
        format_prompt(form, WordLengths(), "hi \ud800", {"voice": "leo"})
    with pytest.raises(PromptFormatError, match=r"^'voice' is not valid Unicode: .* at character 1$"):
        format_prompt(form, WordLengths(), "hi", {"voice": "l\udc00o"})
