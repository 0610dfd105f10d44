"""An output's text reads after its prompt (mstar/runtime/conductor/text_context.py): with a
decoder that drops a text's first leading space (SentencePiece's Metaspace), the streamed text, the stop
strings the conductor ends a request on and `mstar run`'s outputs file keep the space the first
output token has after the prompt. Decoded alone, "hello" + "▁me" read "hellome" and a stop
string " me" never matched at the output's first token."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from mstar import LLM, SamplingParams
from mstar.cli.mstar import main
from mstar.runtime.serve.text_stream import TextStream
from mstar.runtime.conductor.text_context import CONTEXT_TOKENS, context_before, text_after
from serve_harness import LLAMA

VOCAB = 512  # the tiny dims' vocabulary: every generated id decodes to a piece
SPECIALS = ["<unk>", "<s>", "</s>"]
PIECES = ["▁hello", "▁me", "me", "▁world", "s", "▁a"]


def _write_metaspace_tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = SPECIALS + PIECES
    pieces += [f"▁w{i}" if i % 2 else f"x{i}" for i in range(VOCAB - len(pieces))]
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()  # drops the first piece's leading space, as Llama 2's
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return directory, tokenizer


def _decode_with(tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


ME = len(SPECIALS) + PIECES.index("▁me")
ME_JOINED = len(SPECIALS) + PIECES.index("me")
HELLO = len(SPECIALS) + PIECES.index("▁hello")


def test_the_first_output_token_keeps_its_space_after_the_prompt(tmp_path):
    _, tokenizer = _write_metaspace_tokenizer(tmp_path / "tok")
    decode = _decode_with(tokenizer)
    assert decode([ME, ME]) == "me me"  # alone, the first space is dropped
    stream = TextStream(decode, context=[1, HELLO])
    shown = stream.add([ME]) + stream.add([ME_JOINED, ME]) + stream.finish()
    assert shown == " meme me" and decode([1, HELLO]) + shown == decode([1, HELLO, ME, ME_JOINED, ME])
    # a stop string starting with a space matches at the first output token
    stopped = TextStream(decode, stops=[" me"], context=[HELLO])
    assert stopped.add([ME]) + stopped.finish() == "" and stopped.is_stopped


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(3, 30), min_size=1, max_size=12), st.lists(st.integers(3, 30), max_size=30),
       st.lists(st.integers(1, 4), min_size=1, max_size=10))
def test_the_streamed_text_is_what_the_output_adds_to_the_whole_prompts(prompt, ids, chunk_sizes):
    """Whatever the chunking, the deltas join to decode(prompt + output) less decode(prompt), with
    the prompt's last CONTEXT_TOKENS tokens as context (ordinary pieces: a context of special
    tokens alone decodes to nothing, and the output reads as a text's start, as vLLM's does)."""
    from tokenizers import Tokenizer, decoders, models

    pieces = SPECIALS + PIECES + [f"▁w{i}" if i % 2 else f"x{i}" for i in range(22)]
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace()
    decode = _decode_with(tokenizer)
    stream = TextStream(decode, context=prompt[-CONTEXT_TOKENS:])
    shown, at, index = [], 0, 0
    while at < len(ids):
        size = chunk_sizes[index % len(chunk_sizes)]
        shown.append(stream.add(ids[at:at + size]))
        at, index = at + size, index + 1
    shown.append(stream.finish())
    assert "".join(shown) == decode(prompt + ids)[len(decode(prompt)):]
    assert text_after(decode, prompt[-CONTEXT_TOKENS:], ids) == "".join(shown)


def test_the_context_before_a_tail_comes_from_the_output_then_the_prompt():
    prompt, output = [1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]
    assert context_before(prompt, output, 0) == [2, 3, 4, 5, 6]
    assert context_before(prompt, output, 2) == [4, 5, 6, 10, 11]
    assert context_before(prompt, output, 7) == [12, 13, 14, 15, 16]
    assert context_before([], output, 1) == [10]


def test_a_stop_string_with_a_leading_space_ends_the_request_at_its_first_token(tmp_path):
    """The conductor's stop check reads the output after the prompt: " me" as the first token ends
    the request there ("stop", no text); decoded alone it matched only at the second " me",
    one step later, with "me" shown."""
    directory, tokenizer = _write_metaspace_tokenizer(tmp_path / "tok")
    with LLM(LLAMA, tokenizer=str(directory)) as llm:
        forced = SamplingParams(max_tokens=4, logit_bias={str(ME): 100.0})
        plain = llm.generate(["hello"], forced)[0]
        assert plain.token_ids == [ME] * 4 and plain.text == " me me me me"
        stopped = llm.generate(["hello"], SamplingParams(max_tokens=4, logit_bias={str(ME): 100.0}, stop=[" me"]))[0]
        assert (stopped.token_ids, stopped.text, stopped.finish_reason) == ([ME], "", "stop")


def test_the_outputs_file_text_reads_after_the_prompt(tmp_path, capsys):
    directory, _ = _write_metaspace_tokenizer(tmp_path / "tok")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello", "max_tokens": 3,
                                   "logit_bias": {str(ME): 100.0}}) + "\n")
    out = tmp_path / "out"
    status = main(["run", "--plan", LLAMA, "--prompts", str(prompts), "--tokenizer", str(directory),
                   "--out", str(out), "--no-progress"])
    assert status == 0, capsys.readouterr().err
    line = json.loads((out / "outputs.jsonl").read_text())
    assert (line["output_tokens"], line["text"]) == ([ME] * 3, " me me me")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(3, 12), min_size=1, max_size=6), st.lists(st.integers(3, 12), max_size=30),
       st.lists(st.sampled_from([" me", "me", "s ", " a", "mes", " hello me"]), max_size=3),
       st.lists(st.integers(1, 4), min_size=1, max_size=8), st.integers(0, 8))
def test_stops_and_min_tokens_are_read_in_the_text_after_the_prompt(prompt, ids, stops, chunk_sizes, min_tokens):
    """With a context, the stream still cuts where a search of the whole text so far (read after
    the prompt) cuts, a stop string counting only past the first min_tokens tokens' text."""
    from tokenizers import Tokenizer, decoders, models

    from mstar.runtime.serve.tokenizer import stop_text_index

    pieces = SPECIALS + PIECES + [f"▁w{i}" if i % 2 else f"x{i}" for i in range(4)]
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace()
    decode = _decode_with(tokenizer)
    context = prompt[-CONTEXT_TOKENS:]
    stream = TextStream(decode, stops, min_tokens, context=context)
    after = len(text_after(decode, context, ids[:min_tokens]))
    shown, at, index, expected = [], 0, 0, None
    while at < len(ids):
        size = chunk_sizes[index % len(chunk_sizes)]
        shown.append(stream.add(ids[at:at + size]))
        at, index = at + size, index + 1
        so_far = text_after(decode, context, ids[:at])
        cut = stop_text_index(so_far, stops, after=after) if stops and at >= min_tokens else None
        if expected is None and cut is not None:
            expected = so_far[:cut]
    shown.append(stream.finish())
    assert "".join(shown) == (text_after(decode, context, ids) if expected is None else expected)
