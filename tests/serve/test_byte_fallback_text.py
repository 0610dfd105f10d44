"""Output text with a byte-fallback tokenizer (SentencePiece's `<0xF0>` byte tokens: Llama-2,
Mistral, Gemma), whose decoder gives U+FFFD for every byte of a run of byte tokens holding one
invalid byte. An output read after a context that starts inside a character (the prompt's last 5
tokens: the last bytes of an emoji) came out as U+FFFD throughout its bytes, in the stream, the
answer and `mstar run`'s outputs file, and its stop strings never matched; the conductor's stop
window inside a long run of emoji started mid-character too, so the request ran to max_tokens
while its text was cut at the stop (text_context.py: `safe_context`, `character_start`)."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.conductor.text_context import CONTEXT_TOKENS, prompt_context, text_after
from mstar.runtime.serve.text_stream import TextStream

BYTE = 10  # id of byte token <0x00>; byte b is BYTE + b
SPACE, HI, END = 3, 4, 5  # "▁", "H", "▁end"
EMOJI = ["😀", "😁", "😂", "😃", "😄", "😅", "😆", "😇", "😈", "😉"]


def _decoder():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": SPACE, "H": HI, "▁end": END}
    vocab.update({f"<0x{b:02X}>": BYTE + b for b in range(256)})
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def _bytes(text: str) -> list[int]:
    return [BYTE + b for b in text.encode()]


def test_an_output_after_a_prompt_ending_in_emoji_reads_as_its_characters():
    decode = _decoder()
    prompt = [1, HI, SPACE, *_bytes("😀😀")]  # its last 5 tokens start inside the first emoji
    output = [*_bytes("😁😂"), END]
    assert decode(prompt[-CONTEXT_TOKENS:]).startswith("\ufffd")  # the context that garbled it
    assert text_after(decode, prompt_context(prompt, decode), output) == "😁😂 end"
    stream = TextStream(decode, context=prompt_context(prompt, decode))
    assert "".join(stream.add([token]) for token in output) + stream.finish() == "😁😂 end"
    stopped = TextStream(decode, stops=["😁"], context=prompt_context(prompt, decode))
    assert "".join(stopped.add([token]) for token in output) + stopped.finish() == "" and stopped.is_stopped


def _has_stop(decode, prompt: list[int], output: list[int], stops: list[str], min_tokens: int = 0) -> bool:
    request = SimpleNamespace(stop_strings=stops, min_tokens=min_tokens, prompt_tokens=prompt)
    record = SimpleNamespace(request=request, output_tokens=output)
    return Conductor.has_stop_string(SimpleNamespace(decode=decode), record)


def test_the_conductor_finds_a_stop_string_deep_in_a_run_of_emoji():
    """The 8th emoji completes at token 32: the request ends there (it ran to its 40 tokens)."""
    decode = _decoder()
    prompt, output = [1, HI], _bytes("".join(EMOJI))
    stops_at = [n for n in range(1, len(output) + 1) if _has_stop(decode, prompt, output[:n], ["😇"])]
    assert stops_at[0] == 32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(EMOJI + ["a", "é", "€", " "]), min_size=1, max_size=24),
       st.lists(st.sampled_from(EMOJI + ["é", "€"]), min_size=1, max_size=3), st.data())
def test_a_stop_string_is_found_at_the_token_that_completes_it(prefix, pieces, data):
    """Every character as byte tokens: the conductor's window finds the stop exactly where the
    output's text first holds it, whatever the prompt's and the window's starts cut."""
    decode = _decoder()
    stop = "".join(pieces)
    prompt = [1, HI, *_bytes(data.draw(st.sampled_from(["😀😀", "€", "a"])))]
    output = _bytes("".join(prefix) + stop)
    first = next(n for n in range(1, len(output) + 1) if stop in decode(output[:n]))
    assert not any(_has_stop(decode, prompt, output[:n], [stop]) for n in range(1, first))
    assert _has_stop(decode, prompt, output[:first], [stop])
