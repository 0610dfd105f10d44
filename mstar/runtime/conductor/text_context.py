"""An output's text as it reads after the tokens before it.

A decoder that drops the leading space of a text's first token (SentencePiece's Metaspace,
WordPiece's) gives an output's first token without its space when the output is decoded alone:
a prompt and its completion read "hellome", and a stop string starting with a space never
matched there. So output text is decoded after the prompt's last `CONTEXT_TOKENS` tokens (vLLM's
and text-generation-inference's prefix offset) and the context's own text taken off.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

CONTEXT_TOKENS = 5  # tokens before an output decoded with it (enough for a space or a split character)


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


def prompt_context(prompt: Sequence[int]) -> list[int]:
    """The tokens an output's first token is read after: the prompt's last `CONTEXT_TOKENS`."""
    return list(prompt[-CONTEXT_TOKENS:])


def context_before(prompt: Sequence[int], output: Sequence[int], start: int) -> list[int]:
    """The `CONTEXT_TOKENS` tokens before `output[start:]`: the output's own, then the prompt's."""
    from_output = list(output[max(0, start - CONTEXT_TOKENS):start])
    missing = CONTEXT_TOKENS - len(from_output)
    return (prompt_context(prompt)[-missing:] if missing else []) + from_output
