"""A prompt's own log-probabilities: each prompt token's under the model, given the tokens before it.

In: a request's `prompt_logprobs` (the alternatives it wants beside each prompt token), and a row
of it that feeds the prompt or a chunk of one: the row's final hidden states (one a fed token),
its fed token ids and the model's LM head. Out: one `TokenLogprobs` (step.py) a fed token, in
order, for `RowResult.prompt_logprobs`; the first prompt token's entry is None (nothing precedes
it). What OpenAI's completions answer for `echo` with `logprobs`, and what a loglikelihood
evaluation reads.

Position p's logits predict token p + 1, so a chunk's last position predicts the next chunk's first
token: that row of log-probabilities (the "tail", one vocabulary's floats) waits on the request
between its chunks, and the last chunk's tail, which predicts the sampled token, is dropped.

Which calls give them (models/kinds.py `prompt_logprob_calls`): the calls of the plan's first node, in plan order,
that take the text prompt (an input whose role says `prompt text`), outside any loop (so what they
feed is the prompt itself), and send text tokens to the client. A plan without one refuses such
requests. Cached prefix pages have no logits, so such a request claims none (conductor.py).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mstar.runtime.engine.sampling import as_token_logprobs, logprob_tensors
from mstar.runtime.step import TokenLogprobs

# Positions whose logits are made at once: [positions, vocab] floats (an 8,192-token chunk of a
# 128k vocabulary whole would be 4 GB).
POSITIONS_AT_ONCE = 256


def score_row(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: list[int],
              request: Any, node: str, is_partial: bool) -> list[Optional[TokenLogprobs]]:
    """A row's entries (`chunk_logprobs`) with the request's (a `RequestState`) alternatives,
    from its tail on `node` so far; a chunk before the last leaves its own tail there."""
    tails = request.prompt_tails
    entries, tail = chunk_logprobs(logits_of, hidden, tokens, tails.pop(node, None), request.params.prompt_logprobs)
    if is_partial:
        tails[node] = tail
    return entries


def chunk_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: list[int],
                   tail: Optional[torch.Tensor], count: int
                   ) -> tuple[list[Optional[TokenLogprobs]], torch.Tensor]:
    """The entries of a chunk's fed `tokens` (hidden `[T, H]`, one row a token), each with `count`
    alternatives, and the chunk's tail; `tail`: the previous chunk's (None for the prompt's first).
    The figures stay on the logits' device until the chunk's last slice of positions, then come to
    the host at once (a copy a slice would make the host wait on the device each time)."""
    ids = torch.tensor(tokens, dtype=torch.long, device=hidden.device)
    parts = [] if tail is None else [logprob_tensors(tail[None], ids[:1], count, is_logprobs=True)]
    last = tail
    for start in range(0, len(tokens), POSITIONS_AT_ONCE):
        logprobs = torch.log_softmax(logits_of(hidden[start:start + POSITIONS_AT_ONCE]), dim=-1, dtype=torch.float32)
        targets = ids[start + 1:start + 1 + logprobs.shape[0]]  # the next token of each position, in the chunk
        if targets.shape[0]:
            parts.append(logprob_tensors(logprobs[:targets.shape[0]], targets, count, is_logprobs=True))
        last = logprobs[-1]
    assert last is not None, "a chunk feeds at least one token"
    entries: list[Optional[TokenLogprobs]] = [None] if tail is None else []
    if parts:
        chosen, values, alternatives = (torch.cat(column).tolist() for column in zip(*parts))
        entries += as_token_logprobs(chosen, values, alternatives, [count] * len(chosen))
    # a copy: the slice's view would keep its whole [positions, vocab] block alive on the request
    return entries, last.clone()
