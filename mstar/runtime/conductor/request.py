"""A request as the runtime sees it, and what the runtime records about it while it runs.

`Request` is what a client sends (prompt, sampling settings, which stage alternatives to take,
opaque media). `RequestRecord` is the conductor's bookkeeping for one admitted request: times,
tokens counted, client emissions, how it finished. Both are plain data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional


@dataclass
class Request:
    """One client request.

    route: partition name -> the walks this request takes in that partition, one per stage it
    takes, in stage order (an optional stage may be left out; an empty list leaves the partition
    out entirely, as for the audio partitions of a text-only request). A partition absent from
    route takes the first alternative of every stage that is not optional.
    media: the request's media by modality (`image`, `audio`): the input the spec marks `prompt
    image` (or `audio`) receives it; opaque to the runtime (absent lets the engine synthesise it).
    guidance: scales by guidance label (the spec's `guidance LABEL ...`; a label left out keeps its
    default scale).
    """

    id: str
    prompt_tokens: list[int]
    max_tokens: int
    temperature: Optional[float] = None  # None: greedy
    top_k: Optional[int] = None  # None or 0: no limit
    top_p: Optional[float] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None  # None: no penalty (HF's rule, read by the engine)
    # OpenAI's: a logit less presence_penalty once its token is in the node's output so far and
    # frequency_penalty a time it is there (None: 0, no penalty)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop_tokens: list[int] = field(default_factory=list)  # token ids that end the request's loops
    # vLLM's extensions: ignore_eos samples on past the model's own stop tokens (the node's; the
    # request's stop_tokens still stop it); min_tokens keeps every stop token from being sampled
    # until the request has sampled that many on a node
    ignore_eos: bool = False
    min_tokens: int = 0
    # (token id, bias): added to the logit of that token before sampling, on the calls that send
    # their tokens to the client as text (OpenAI's logit_bias, each in [-100, 100])
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    # log-probabilities of each text token sent to the client and of this many alternatives beside
    # it (0 to step.MAX_LOGPROBS; None: none, nothing is computed)
    logprobs: Optional[int] = None
    # each prompt token's log-probability given the tokens before it, and this many alternatives
    # (0 to step.MAX_LOGPROBS; None: none): from the plan's first node that takes the text prompt
    # outside loops and sends text tokens (engine/prompt_logprobs.py); such a request claims no
    # cached prefix (its tokens would have no logits)
    prompt_logprobs: Optional[int] = None
    # text that ends the request's counted output once its decoded text holds one (needs the
    # conductor's `decode`; the output's text is then cut before it)
    stop_strings: list[str] = field(default_factory=list)
    guidance: dict[str, float] = field(default_factory=dict)  # image-flow guidance (runners/guidance.py)
    # iterations of the loops whose spec says `count=PARAM`, by that param's name (within each
    # loop's max; a param left out keeps its default)
    loop_counts: dict[str, int] = field(default_factory=dict)
    route: dict[str, list[str]] = field(default_factory=dict)
    media: dict[str, Any] = field(default_factory=dict)
    arrival_s: float = 0.0  # when the client sends it (workload time, seconds from the start)


class Emission(NamedTuple):
    """A value the request sent to the client."""

    time_s: float
    edge: str
    modality: Optional[str]
    value: Any


@dataclass
class RequestRecord:
    """The conductor's record of one request; finish_reason is set exactly once."""

    request: Request
    arrival_s: float
    admit_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    finish_reason: Optional[str] = None  # "stop", "length", "done", "error: ...", "cancelled"
    num_output_tokens: int = 0
    is_refused: bool = False  # ended at admission: its route or the engine refused it (nothing ran)
    is_input_fault: bool = False  # failed mid-run on its own input (a node could not take its audio, ...)
    # prefix cache: prompts looked up (one per kv node with the cache) and prompt tokens found
    num_prefix_lookups: int = 0
    num_cached_tokens: int = 0
    output_tokens: list[Any] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # one per token event (for ITL)
    # Client emissions as parallel columns (`emissions` reads them as Emission tuples): a decode
    # step appends its time, a shared (edge, modality) pair and the value, making no new object
    # per row (an object per token made post-process allocation-bound). A one-token list (a decode
    # step's token) is kept as its int, flagged 1 in `emission_is_token` (`emission_value` gives
    # the list back): a list per token is an object the cyclic collector scans in every middle
    # pass for as long as the request lives (on the H200 such passes took 1.4 ms and stalled the
    # decode rows beside a long prompt's chunks, docs/runtime.md); an int is never scanned.
    emission_times_s: list[float] = field(default_factory=list)
    emission_kinds: list[tuple[str, Optional[str]]] = field(default_factory=list)  # (edge, modality)
    emission_values: list[Any] = field(default_factory=list)
    emission_is_token: bytearray = field(default_factory=bytearray)
    # emission index -> the log-probabilities of its token (RowResult.logprobs), for a request that
    # asked for them (Request.logprobs): only one-token text emissions have any
    emission_logprobs: dict[int, Any] = field(default_factory=dict)
    # the prompt's log-probabilities (RowResult.prompt_logprobs), one entry a prompt token, where
    # the request asked for them (Request.prompt_logprobs)
    prompt_logprobs: list[Any] = field(default_factory=list)

    def attach_logprobs(self, logprobs: Any, since: int) -> None:
        """A row's log-probabilities go to the first one-token text emission it made: the first
        at index `since` or after (the emissions before the row was applied), if any."""
        kinds, is_token = self.emission_kinds, self.emission_is_token
        for index in range(since, len(is_token)):
            if is_token[index] and kinds[index][1] == "text":
                self.emission_logprobs[index] = logprobs
                return

    def prompt_token_logprobs(self) -> list[Any]:
        """One entry per prompt token: what `prompt_logprobs` holds for it, else None."""
        found = self.prompt_logprobs
        return [found[index] if index < len(found) else None for index in range(len(self.request.prompt_tokens))]

    def text_token_logprobs(self, start: int, end: int) -> list[tuple[int, Any]]:
        """(token id, its log-probabilities or None) for every text token of emissions [start, end),
        in order: a one-token emission's with what `attach_logprobs` gave it, the tokens of a longer
        text emission with None."""
        found, kinds, values, is_token = (self.emission_logprobs, self.emission_kinds, self.emission_values,
                                          self.emission_is_token)
        out: list[tuple[int, Any]] = []
        for index in range(start, end):
            if kinds[index][1] != "text":
                continue
            if is_token[index]:
                out.append((values[index], found.get(index)))
            else:
                out.extend((token, None) for token in token_ids_of(values[index]))
        return out

    def emit(self, time_s: float, kind: tuple[str, Optional[str]], value: Any) -> None:
        """Record a value sent to the client: kind is (edge name, modality)."""
        self.add_emission(time_s, kind, value)
        if self.first_token_s is None:
            self.first_token_s = time_s

    def add_emission(self, time_s: float, kind: tuple[str, Optional[str]], value: Any) -> None:
        """Append one emission to the columns (a one-token list as its int)."""
        self.emission_times_s.append(time_s)
        self.emission_kinds.append(kind)
        if type(value) is list and len(value) == 1 and type(value[0]) is int:
            self.emission_values.append(value[0])
            self.emission_is_token.append(1)
        else:
            self.emission_values.append(value)
            self.emission_is_token.append(0)

    def emission_value(self, index: int) -> Any:
        """The value of emission `index` as it was emitted."""
        value = self.emission_values[index]
        return [value] if self.emission_is_token[index] else value

    @property
    def emissions(self) -> list[Emission]:
        """Every client emission so far, in order (made on each read)."""
        return [Emission(time_s, kind[0], kind[1], [value] if is_token else value) for time_s, kind, value, is_token
                in zip(self.emission_times_s, self.emission_kinds, self.emission_values, self.emission_is_token)]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_failed(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.startswith(("error", "cancelled"))


def count_elements(value: Any) -> int:
    """Output tokens a value stands for: len of a list/tuple, numel of a tensor/array, else 1."""
    if isinstance(value, (list, tuple)):
        return len(value)
    numel = getattr(value, "numel", None)
    if callable(numel):
        return int(numel())
    size = getattr(value, "size", None)
    if isinstance(size, int):  # numpy arrays
        return size
    return 1


def num_tokens_of(value: Any) -> int:
    """Tokens a row input feeds: len of a list, shape[0] of a tensor, else 1."""
    if isinstance(value, (list, tuple)):
        return len(value)
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return 1


def token_ids_of(value: Any) -> list[int]:
    """A text emission's token ids: a list of ids, one id, or a tensor of ids."""
    if isinstance(value, list):
        return [int(v) for v in value]
    to_list = getattr(value, "tolist", None)
    if callable(to_list):
        items = to_list()
        return [int(v) for v in items] if isinstance(items, list) else [int(items)]
    return [int(value)]
