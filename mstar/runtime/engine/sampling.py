"""Token sampling, batched over a step's rows: greedy, temperature, top-k, top-p, repetition,
presence and frequency penalties, logit biases.

In: the logits of the step's sampling rows `[R, vocab]` and per row its request's `SamplingParams`,
the token ids it has seen (the repetition penalty's), the tokens it sampled on the node so far (the
presence and frequency penalties', OpenAI's rule: a logit less presence_penalty once its token is
among them and frequency_penalty a time), and its draw coordinates (`stream`: `draw_stream(seed, node position)`,
fixed per request and node; `step`: how many tokens that request sampled there before), and the
logit biases that apply to it (OpenAI's `logit_bias`: added to the logits after the penalties, where
the row's call sends its token to the client as text). Out: one token
id per row, from one batched pass (`sample_tokens`). `token_logprobs` gives the sampled tokens'
log-probabilities for the rows whose requests ask for them (of the logits before any of the rules
below: the model's own distribution, as vLLM's default and OpenAI's).

Each row's random draw is a counter-based hash of (stream, step), so it depends only on its own
seed and step, never on which rows share the step or in what order (batch invariance on the CPU).
Every other operation is row-wise. `temperature` None or 0 means greedy (argmax after the
penalties, the repetition penalty first), and so does one below MIN_TEMPERATURE; `top_k` 0 and
`top_p` 1 keep every token, and every row keeps its most likely token whatever its `top_p`. With
both, `top_k` applies first and `top_p` to the top k's renormalised distribution (vLLM's and
transformers' order: the nucleus is the top k tokens whose more probable ones among them weigh less
than top_p of the top k's mass).
"""
from __future__ import annotations

import math
import numbers
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mstar.arg_types import shown
from mstar.runtime.step import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, TokenLogprobs, sampling_range_problem

# Below this a temperature samples as greedy (vLLM's convention too): logits / t overflows fp32 long
# before t reaches 0 (a temperature of 1e-38 made every probability NaN, and 1e-320 rounds to 0 in
# fp32), and a row that close to greedy draws its argmax anyway.
MIN_TEMPERATURE = 1e-5

MASK32 = 0xFFFFFFFF
# A top_k past any vocabulary keeps every token; larger ones are taken as this (a top_k of 10**30
# reached the step's top-k tensor and failed every row of the step with an overflow).
TOP_K_LIMIT = 2**31 - 1


class SamplingError(ValueError):
    """A request's sampling settings are out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: Optional[float] = None
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    max_tokens: Optional[int] = None
    logprobs: Optional[int] = None  # Request.logprobs: alternatives beside the sampled token, None: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # Request.logit_bias: (token id, bias) pairs
    ignore_eos: bool = False  # Request.ignore_eos: the node's stop tokens do not stop it
    min_tokens: int = 0  # Request.min_tokens: no stop token is sampled before this many tokens
    # Request.prompt_logprobs: each prompt token's log-probability and this many alternatives, None: none
    prompt_logprobs: Optional[int] = None

    @property
    def is_greedy(self) -> bool:
        return not self.temperature or self.temperature < MIN_TEMPERATURE

    @classmethod
    def from_request(cls, request: Any) -> "SamplingParams":
        """Read the fields of a conductor request (an object or a dict); absent fields keep defaults."""
        def get(*names: str, default: Any = None) -> Any:
            for name in names:
                value = request.get(name) if isinstance(request, dict) else getattr(request, name, None)
                if value is not None:
                    return value
            return default

        stop = get("stop_tokens", "stop_token_ids", "stop", default=())
        try:
            temperature = get("temperature")
            params = cls(
                temperature=None if temperature is None else float(temperature),
                top_k=min(_integer("top_k", get("top_k", default=0)), TOP_K_LIMIT),
                top_p=float(get("top_p", default=1.0)),
                repetition_penalty=float(get("repetition_penalty", default=1.0)),
                presence_penalty=float(get("presence_penalty", default=0.0)),
                frequency_penalty=float(get("frequency_penalty", default=0.0)),
                seed=_integer("seed", get("seed", default=0)),
                stop_tokens=frozenset(int(t) for t in ([stop] if isinstance(stop, int) else stop)),
                max_tokens=get("max_tokens"),
                logprobs=None if get("logprobs") is None else _integer("logprobs", get("logprobs")),
                logit_bias=logit_bias_pairs(get("logit_bias", default=())),
                ignore_eos=_flag("ignore_eos", get("ignore_eos", default=False)),
                min_tokens=_integer("min_tokens", get("min_tokens", default=0)),
                prompt_logprobs=(None if get("prompt_logprobs") is None
                                 else _integer("prompt_logprobs", get("prompt_logprobs"))),
            )
        except SamplingError:
            raise
        except (TypeError, ValueError, OverflowError) as error:  # a value of the wrong kind: this request alone
            raise SamplingError(f"a sampling setting is not a number of its kind ({error})") from None
        problem = sampling_range_problem(params.temperature, params.top_k, params.top_p, params.seed,
                                         params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
                                         params.logprobs, params.min_tokens, params.max_tokens,
                                         params.prompt_logprobs, show=shown)
        if problem is not None:
            raise SamplingError(problem)
        return params


MAX_TOKEN_ID_DIGITS = 19  # a token id as a decimal string: int64's digits


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """A request's logit_bias as (token id, bias) pairs, in token order: from a dict (token ids as
    ints or as the decimal strings OpenAI's JSON keys are) or from pairs; SamplingError for a token
    id that is not a non-negative integer, a bias outside LOGIT_BIAS_RANGE, a token named twice
    ("7" and "07": the later bias replaced the earlier, so a ban by -100 was lifted silently) or
    too many entries."""
    items = value.items() if isinstance(value, dict) else value
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise SamplingError(f"logit_bias must map token ids to biases, got an entry {item!r}")
        token, bias = item
        if isinstance(token, str) and token.isascii() and token.isdecimal():
            if len(token) > MAX_TOKEN_ID_DIGITS:  # (past 4,300 digits int() raised ValueError: an internal error)
                raise SamplingError(f"logit_bias token id {token[:MAX_TOKEN_ID_DIGITS]}... ({len(token)} digits) "
                                    "is outside every vocabulary")
            token = int(token)
        token = _integer("logit_bias token id", token)
        if token < 0:
            raise SamplingError(f"logit_bias token id must be >= 0, got {token}")
        if token in pairs:
            raise SamplingError(f"logit_bias names token {token} twice")
        # an int compared as it is: float() of a 400-digit one raised OverflowError
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not (
                LOGIT_BIAS_RANGE[0] <= (bias if isinstance(bias, int) else float(bias)) <= LOGIT_BIAS_RANGE[1]):
            raise SamplingError(f"logit_bias of token {token} must be a number in [-100, 100], got {shown(bias)}")
        pairs[token] = float(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingError(f"logit_bias has {len(pairs)} entries, more than the {MAX_LOGIT_BIAS} a request may carry")
    return tuple(sorted(pairs.items()))


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingError(f"{name} must be true or false, got {value!r}")
    return value


def stop_masks(params: SamplingParams, num_sampled: int, node_stops: Any) -> tuple[tuple[int, float], ...]:
    """The (token, -inf) pairs that keep a row from sampling a stop token (its request's, and the
    node's unless ignore_eos) while it has sampled fewer than min_tokens there; () otherwise."""
    if num_sampled >= params.min_tokens:
        return ()
    stops = set(params.stop_tokens) if params.ignore_eos else set(params.stop_tokens) | set(node_stops)
    return tuple((token, -math.inf) for token in sorted(stops))


def row_biases(params: SamplingParams, num_sampled: int, node_stops: Any) -> tuple[tuple[int, float], ...]:
    """Everything added to a row's logits before it samples on a call that sends text tokens: its
    logit_bias, and the stop-token masks of min_tokens."""
    masks = stop_masks(params, num_sampled, node_stops) if params.min_tokens else ()
    return params.logit_bias + masks if masks else params.logit_bias


def _integer(name: str, value: Any) -> int:
    """An integer setting as an int (a float that is a whole number too); SamplingError otherwise."""
    is_whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not is_whole:
        raise SamplingError(f"{name} must be an integer, got {value!r}")
    return int(value)


def draw_stream(seed: int, position: int) -> int:
    """The draw stream of a request on a node: fixed by its seed, different per node (by the node's
    position in the plan, not its name: a renaming changes no sample)."""
    return zlib.crc32(f"{seed}/{position}".encode())


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values below 2^32, row-wise. int64 products wrap
    modulo 2^64, which keeps the low 32 bits the hash needs."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniforms(streams: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row from its (stream, step), float64 `[R]`."""
    high = _hash32((_hash32(streams & MASK32) + steps) & MASK32)
    low = _hash32(high ^ 0x9E3779B9)
    return (high.double() * 2.0 ** 21 + (low >> 11).double()) / 2.0 ** 53


def apply_repetition_penalty(logits: torch.Tensor, histories: list[torch.Tensor],
                             penalties: torch.Tensor) -> torch.Tensor:
    """HF's rule, per row: a seen token's positive logit is divided by its row's penalty, a
    negative one multiplied. logits `[R, V]`, penalties `[R]`."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for row, history in enumerate(histories):
        if history.numel():
            seen[row, history.long() % logits.shape[1]] = True
    return repetition_rule(logits, seen, penalties)


def repetition_rule(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """`apply_repetition_penalty`'s rule over a `[R, V]` mask of the tokens each row has seen (the
    GPU fast path builds its mask on the device: gpu/penalties.py)."""
    penalty = penalties.unsqueeze(1).to(logits.dtype)
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def apply_output_penalties(logits: torch.Tensor, outputs: list[torch.Tensor], presence: torch.Tensor,
                           frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's rule, per row: each token's logit less presence (once the token is among the row's
    outputs) and frequency times its count there. logits `[R, V]`, presence and frequency `[R]`."""
    vocab = logits.shape[1]
    counts = torch.stack([torch.bincount(out.long() % vocab, minlength=vocab) if out.numel()
                          else torch.zeros(vocab, dtype=torch.long) for out in outputs]).to(logits.dtype)
    return output_rule(logits, counts, presence, frequency)


def output_rule(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                frequency: torch.Tensor) -> torch.Tensor:
    """`apply_output_penalties`' rule over `[R, V]` counts of each row's outputs (in the logits'
    dtype; the GPU fast path counts on the device: gpu/penalties.py)."""
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def bias_pairs(biases: list[tuple[tuple[int, float], ...]]) -> Optional[tuple[list[int], list[int], list[float]]]:
    """The rows' logit biases as (row, token, bias) columns; None when no row has one."""
    rows = [row for row, pairs in enumerate(biases) for _ in pairs]
    if not rows:
        return None
    return rows, [token for pairs in biases for token, _ in pairs], [bias for pairs in biases for _, bias in pairs]


def bias_rule(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`logits` `[R, V]` with `values` added at (rows, tokens) (a new tensor): OpenAI's logit_bias,
    after the penalties. A token id past a stand-in's smaller vocabulary folds into it, as prompt
    ids do (prompt_limits.py); the plan's vocabulary bounds the ids at admission."""
    return logits.index_put((rows, tokens % logits.shape[1]), values.to(logits.dtype), accumulate=True)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], histories: list[torch.Tensor],
                  streams: list[int], steps: list[int], outputs: Optional[list[torch.Tensor]] = None,
                  biases: Optional[list[tuple[tuple[int, float], ...]]] = None) -> list[int]:
    """One token id per row of `logits` `[R, V]` (see the module docstring). outputs: per row the
    tokens its request sampled on the node so far (None: none, as for a depth model's inner
    tokens). biases: per row the logit biases that apply to it there (None: none)."""
    logits = logits.float()
    penalties = torch.tensor([p.repetition_penalty for p in params])
    if bool((penalties != 1.0).any()):
        logits = apply_repetition_penalty(logits, histories, penalties)
    if outputs is not None:  # (the runners give outputs only for a step with such a penalty)
        presence = torch.tensor([p.presence_penalty for p in params])
        frequency = torch.tensor([p.frequency_penalty for p in params])
        if bool(((presence != 0) | (frequency != 0)).any()):
            logits = apply_output_penalties(logits, outputs, presence, frequency)
    found = bias_pairs(biases) if biases is not None else None
    if found is not None:
        rows, tokens, values = found
        logits = bias_rule(logits, torch.tensor(rows), torch.tensor(tokens), torch.tensor(values))
    greedy = logits.argmax(dim=1)
    is_greedy = torch.tensor([p.is_greedy for p in params])
    if bool(is_greedy.all()):
        return greedy.tolist()
    temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params]).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=1)
    sorted_probs, order = torch.sort(probs, dim=1, descending=True, stable=True)
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k or vocab for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=sorted_probs.dtype).unsqueeze(1)
    # Keep the top_k most likely and, of those, the smallest prefix whose mass reaches top_p of the
    # top k's own mass (top_k first, then top_p over its renormalised distribution, as vLLM and
    # transformers); always the top token (a top_p of 1e-300 is 0 in fp32: nothing was kept, and
    # the gather below failed the whole step).
    rank = torch.arange(vocab).unsqueeze(0)
    in_top_k = rank < top_k
    # (a row without a top_k keeps its mass 1, not the sum's rounding of it: as before)
    top_k_mass = torch.where(top_k < vocab, (sorted_probs * in_top_k).sum(dim=1, keepdim=True), 1.0)
    heavier = torch.cumsum(sorted_probs, dim=1) - sorted_probs
    is_kept = (in_top_k & (heavier < top_p * top_k_mass)) | (rank == 0)
    kept = sorted_probs * is_kept
    cdf = torch.cumsum(kept / kept.sum(dim=1, keepdim=True), dim=1)
    draw = uniforms(torch.tensor(streams, dtype=torch.long), torch.tensor(steps, dtype=torch.long))
    index = torch.searchsorted(cdf.double(), draw.unsqueeze(1)).squeeze(1)
    index = torch.minimum(index, is_kept.sum(dim=1) - 1)
    sampled = order.gather(1, index.unsqueeze(1)).squeeze(1)
    return torch.where(is_greedy, greedy, sampled).tolist()


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, most: int,
                    is_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' sampled-token log-probabilities `[R]` under log_softmax(logits) and the `most` most
    likely tokens' `[R, most]` (values, then ids; most likely first), on the logits' device (the GPU
    fast path copies them to the host with its tokens). logits `[R, V]`, tokens `[R]`;
    is_logprobs: `logits` are log-probabilities already (fp32)."""
    logprobs = logits if is_logprobs else torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.reshape(-1, 1).long()).squeeze(1)
    values, ids = logprobs.topk(min(most, logprobs.shape[1]), dim=-1)
    return chosen, values, ids


def as_token_logprobs(chosen: list[float], values: list[list[float]], ids: list[list[int]],
                      counts: list[int]) -> list[TokenLogprobs]:
    """`logprob_tensors`' host values as one TokenLogprobs (step.py) a row, row r keeping its
    `counts[r]` alternatives."""
    return [(chosen[row], tuple(zip(ids[row][:count], values[row][:count]))) for row, count in enumerate(counts)]


def token_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int]) -> list[TokenLogprobs]:
    """Each row's TokenLogprobs: its sampled token `tokens[r]` and `counts[r]` alternatives."""
    chosen, values, ids = logprob_tensors(logits, torch.tensor(tokens), max(counts, default=0))
    return as_token_logprobs(chosen.tolist(), values.tolist(), ids.tolist(), counts)
