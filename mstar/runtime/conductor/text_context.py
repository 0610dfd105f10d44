"""An output's text as it reads after the tokens before it.

A decoder that drops the leading space of a text's first token (SentencePiece's Metaspace,
WordPiece's) gives an output's first token without its space when the output is decoded alone:
a prompt and its completion read "hellome", and a stop string starting with a space never
matched there. So output text is decoded after the prompt's last `CONTEXT_TOKENS` tokens (vLLM's
and text-generation-inference's prefix offset) and the context's own text taken off.

A context must start on a character: a byte-fallback decoder (SentencePiece's `<0xF0>` tokens:
Llama-2, Mistral, Gemma) decodes a run of byte tokens at once and gives U+FFFD for every byte of a
run with one invalid byte, so a context starting inside an emoji turned the whole output's bytes
after it into U+FFFD (and its stop strings never matched). So the context reaches back, up to
`MAX_CONTEXT_TOKENS`, to a start whose text has no U+FFFD (vLLM's "safe place to start"), and a
window of output read on its own starts where its text does not begin with U+FFFD
(`character_start`).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

CONTEXT_TOKENS = 5  # tokens before an output decoded with it (enough for a space or a split character)
MAX_CONTEXT_TOKENS = 24  # how far back a context reaches for a start on a character (vLLM's bound)
MAX_CHARACTER_BYTES = 4  # a UTF-8 character's most bytes: a window's start moves back at most 3 tokens
INCOMPLETE = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character


def text_after(decode: Callable[[list[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """The text of `ids` read after `context`; decoded alone where the context's text is not a
    prefix of the whole (a decoder that rewrites across the boundary)."""
    if not context:
        return decode(list(ids))
    found = read_after(decode, context, decode(list(context)), ids)
    return found if found is not None else decode(list(ids))


def read_after(decode: Callable[[list[int]], str], context: Sequence[int], before: str,
               ids: Sequence[int]) -> Optional[str]:
    """What `ids` add to the text after `context`, whose text is `before` (decoded once by a caller
    reading several candidates after one context); None where `before` is not a prefix of the whole."""
    whole = decode([*context, *ids])
    return whole[len(before):] if whole.startswith(before) else None


def prompt_context(prompt: Sequence[int], decode: Optional[Callable[[list[int]], str]] = None) -> list[int]:
    """The tokens an output's first token is read after: the prompt's last `CONTEXT_TOKENS`, or
    with `decode` as many more (up to MAX_CONTEXT_TOKENS) as a start on a character takes; entries
    that are not token ids (a prompt's media) are left out."""
    if decode is None:
        return list(prompt[-CONTEXT_TOKENS:])
    return context_before(prompt, (), 0, decode)


def safe_context(decode: Callable[[list[int]], str], before: Sequence[int]) -> list[int]:
    """The last `CONTEXT_TOKENS` of `before`, or the shortest longer suffix (up to
    MAX_CONTEXT_TOKENS) whose text has no U+FFFD; the last CONTEXT_TOKENS where none is clean
    (text that holds U+FFFD itself)."""
    num = len(before)
    for size in range(min(CONTEXT_TOKENS, num), min(MAX_CONTEXT_TOKENS, num) + 1):
        context = list(before[num - size:])
        if INCOMPLETE not in decode(context):
            return context
    return list(before[-CONTEXT_TOKENS:])


def context_before(prompt: Sequence[int], output: Sequence[int], start: int,
                   decode: Optional[Callable[[list[int]], str]] = None) -> list[int]:
    """The token ids `output[start:]` is read after: the output's own before it, then the prompt's
    (`CONTEXT_TOKENS`, or with `decode` as many as a start on a character takes); entries that are
    not token ids (a prompt's media) are left out."""
    reach = MAX_CONTEXT_TOKENS if decode is not None else CONTEXT_TOKENS
    from_output = list(output[max(0, start - reach):start])
    missing = reach - len(from_output)
    before = [t for t in (list(prompt[-missing:]) if missing else []) + from_output if isinstance(t, int)]
    return safe_context(decode, before) if decode is not None else before


def character_start(decode: Callable[[list[int]], str], tokens: Sequence[int], start: int) -> int:
    """`start`, or the nearest of the 3 tokens before it, where `tokens[start:]` reads without a
    broken first character (a start inside a UTF-8 character: a byte-fallback decoder gives U+FFFD
    for the whole run of bytes after it); `start` where none does (a run still broken at its end,
    a character not yet whole, or text that holds U+FFFD itself)."""
    for at in range(start, max(-1, start - MAX_CHARACTER_BYTES), -1):
        if not decode(list(tokens[at:])).startswith(INCOMPLETE):
            return at
    return start
