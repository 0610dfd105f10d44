"""Log-probabilities in OpenAI's two answer shapes.

In: a delta's token ids and their `TokenLogprobs` (serve/online.py `Delta.logprobs`: the token's
log-probability, then its request's N most likely alternatives), and the server's tokenizer, which
names each token (`TextTokenizer.token_text`; without one a token reads `token_id:ID`, vLLM's
convention). Out:

    completion_logprobs   a completion choice's `logprobs`: parallel lists `tokens`,
                          `token_logprobs`, `top_logprobs` (a dict of the N alternatives and the
                          sampled token, so up to N + 1 entries, as OpenAI's) and `text_offset`
                          (each token's offset in the choice's text, counted by token texts; a
                          stream carries it on from chunk to chunk: `Offsets`)
    chat_logprobs         a chat choice's `logprobs`: `content`, one entry a token with its
                          `token`, `logprob`, `bytes` (its text's UTF-8) and `top_logprobs` (the N
                          alternatives, most likely first)

A token no engine row gave log-probabilities of (a text emission of several tokens at once) has
`null` for its own and no alternatives. A log-probability of minus infinity is given as -9999.0
(vLLM's), as JSON has no infinity.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


LOWEST = -9999.0


def finite(logprob: Optional[float]) -> Optional[float]:
    return None if logprob is None else max(logprob, LOWEST)


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.token_text(token) if tokenizer is not None else f"token_id:{token}"


class Offsets:
    """A choice's running text offset across its stream's chunks (`completion_logprobs`)."""

    def __init__(self) -> None:
        self.offset = 0


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Optional[Sequence[Any]],
                        offsets: Offsets) -> Optional[dict[str, Any]]:
    """A completion choice's `logprobs` for these tokens (None: the request asked for none)."""
    if logprobs is None:
        return None
    texts = [token_text(tokenizer, token) for token in token_ids]
    top: list[Optional[dict[str, Optional[float]]]] = []
    text_offset = []
    for text, found in zip(texts, logprobs):
        text_offset.append(offsets.offset)
        offsets.offset += len(text)
        if found is None:
            top.append(None)
            continue
        own, alternatives = found
        entry = {token_text(tokenizer, other): finite(value) for other, value in alternatives}
        entry.setdefault(text, finite(own))
        top.append(entry)
    return {"tokens": texts, "token_logprobs": [None if found is None else finite(found[0]) for found in logprobs],
            "top_logprobs": top, "text_offset": text_offset}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int],
                  logprobs: Optional[Sequence[Any]]) -> Optional[dict[str, Any]]:
    """A chat choice's `logprobs` for these tokens (None: the request asked for none)."""
    if logprobs is None:
        return None
    content = []
    for token, found in zip(token_ids, logprobs):
        own, alternatives = found if found is not None else (None, ())
        content.append({**_named(tokenizer, token, own),
                        "top_logprobs": [_named(tokenizer, other, value) for other, value in alternatives]})
    return {"content": content, "refusal": None}


def _named(tokenizer: Any, token: int, logprob: Optional[float]) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}
