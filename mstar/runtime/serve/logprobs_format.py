"""Log-probabilities in OpenAI's two answer shapes.

In: a delta's token ids and their `TokenLogprobs` (serve/online.py `Delta.logprobs`: the token's
log-probability, then its request's N most likely alternatives), and the server's tokenizer, which
names each token (`TextTokenizer.token_text`; without one a token reads `token_id:ID`, vLLM's
convention). Out:

    completion_logprobs   a completion choice's `logprobs`: parallel lists `tokens`,
                          `token_logprobs`, `top_logprobs` (a dict of the N alternatives and the
                          sampled token, so up to N + 1 entries, as OpenAI's) and `text_offset`
                          (each token's offset in the choice's text, counted by token texts; a
                          stream carries it on from chunk to chunk: `Offsets`). A token's text
                          is what it adds to the text after the tokens before it (`Offsets.names`)
    chat_logprobs         a chat choice's `logprobs`: `content`, one entry a token with its
                          `token`, `logprob`, `bytes` (its text's UTF-8) and `top_logprobs` (the N
                          alternatives, most likely first)

A token no engine row gave log-probabilities of (a text emission of several tokens at once) has
`null` for its own and no alternatives. A log-probability of minus infinity is given as -9999.0
(vLLM's), as JSON has no infinity.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mstar.runtime.conductor.text_context import CONTEXT_TOKENS, read_after


LOWEST = -9999.0


def finite(logprob: Optional[float]) -> Optional[float]:
    return None if logprob is None else max(logprob, LOWEST)


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.token_text(token) if tokenizer is not None else f"token_id:{token}"


class Offsets:
    """A choice's running text offset and its last tokens, across its stream's chunks: each token
    is named as it reads after the tokens before it (`context`: at first the prompt's last ones,
    none where the answer starts with the echoed prompt)."""

    def __init__(self, context: Sequence[int] = ()) -> None:
        self.offset = 0
        self.context = list(context)[-CONTEXT_TOKENS:]

    def names(self, tokenizer: Any, token: int, others: Sequence[int]) -> tuple[str, list[str]]:
        """The token's text and its alternatives' at this place, read after the context
        (text_context.py: a SentencePiece or WordPiece token alone drops its leading space, so
        the tokens did not join to the text); a token that reads as nothing there (a special
        token, skipped in text) by its own name. Then the token joins the context."""
        if tokenizer is None:
            return token_text(None, token), [token_text(None, other) for other in others]
        context = self.context
        before = tokenizer.decode(context)

        def read(candidate: int) -> str:
            return read_after(tokenizer.decode, context, before, [candidate]) or tokenizer.token_text(candidate)

        self.context = [*context, token][-CONTEXT_TOKENS:]
        return read(token), [read(other) for other in others]


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Optional[Sequence[Any]],
                        offsets: Offsets) -> Optional[dict[str, Any]]:
    """A completion choice's `logprobs` for these tokens (None: the request asked for none)."""
    if logprobs is None:
        return None
    texts: list[str] = []
    top: list[Optional[dict[str, Optional[float]]]] = []
    text_offset = []
    for token, found in zip(token_ids, logprobs):
        own, alternatives = found if found is not None else (None, ())
        text, names = offsets.names(tokenizer, token, [other for other, _ in alternatives])
        texts.append(text)
        text_offset.append(offsets.offset)
        offsets.offset += len(text)
        if found is None:
            top.append(None)
            continue
        entry = {name: finite(value) for name, (_, value) in zip(names, alternatives)}
        entry.setdefault(text, finite(own))
        top.append(entry)
    return {"tokens": texts, "token_logprobs": [None if found is None else finite(found[0]) for found in logprobs],
            "top_logprobs": top, "text_offset": text_offset}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Optional[Sequence[Any]],
                  offsets: Offsets) -> Optional[dict[str, Any]]:
    """A chat choice's `logprobs` for these tokens (None: the request asked for none)."""
    if logprobs is None:
        return None
    content = []
    for token, found in zip(token_ids, logprobs):
        own, alternatives = found if found is not None else (None, ())
        text, names = offsets.names(tokenizer, token, [other for other, _ in alternatives])
        content.append({**_named(text, own),
                        "top_logprobs": [_named(name, value) for name, (_, value) in zip(names, alternatives)]})
    return {"content": content, "refusal": None}


def _named(text: str, logprob: Optional[float]) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}
