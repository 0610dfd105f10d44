"""The Python API: a compiled plan (and weights) in, generated outputs out.

    from mstar import LLM, SamplingParams
    llm = LLM("generated/llama.plan", engine="sim")            # or weights=["./Llama-3.2-1B"]
    outputs = llm.generate([[1, 2, 3], "hello world"], SamplingParams(max_tokens=32))
    outputs[0].token_ids, outputs[1].text, outputs[0].finish_reason
    async for delta in llm.stream([1, 2, 3], SamplingParams(max_tokens=8)):   # serve/online.py Delta
        print(delta.token_ids, delta.text, delta.media, delta.finish_reason)
    llm.close()                                                 # or `with LLM(...) as llm:`

A prompt is token ids, text (through the tokenizer: `tokenizer=DIR`, else the `weights`
directory of the node taking the text prompt when it holds tokenizer.json), text with the values
of the plan's prompt format fields (`{"prompt": "Hello.", "voice": "leo"}`: a plan whose spec
gives the text prompt node a `prompt_format` frames every text prompt by it, as `mstar run`
does, serve/prompt_format.py) or chat messages (`{"messages": [...]}`, through the tokenizer's
chat template; refused by a plan with a prompt format), or a `request(prompt, sampling, media)`
(the way to give a request its media: a plan whose default route takes the request's audio refuses
a prompt without it). `generate` blocks until every prompt has finished, and cancels what it
submitted when it raises; `stream` is an async generator of one request's deltas, as each step
makes them; closing it (`aclose()`, `contextlib.aclosing`, a cancelled task) cancels the request, which
frees its pages; a `break` alone cancels it only once the generator is collected (Python finalizes an
async generator on `aclose()` or collection, nothing else). `generate` feeds its batch to the loop
as room frees (it never refuses its own prompts with `Overloaded`); a single `stream` past the
loop's limit is refused (`Overloaded`). A `Request` runs once on an LLM: given again it is a
`PromptError` (its id is spent in the run loop). An LLM collected without `close()` is closed then.
Both run on one `OnlineLoop` (its own thread), so `generate` and `stream` may be used together
and from several threads. Bad input is a `ValueError` subclass (`PromptError`,
`SamplingError`) with a message, raised before anything runs (values checked against the plan's
vocabulary, routes and guidance labels too, serve/plan_checks.py); `Overloaded` / `Closed` come
from the loop; a bad constructor argument (or a plan, tokenizer or engine that cannot be set up)
is a `SetupError` (a ValueError).

Engines: `engine="torch"` (the models: `dims`, `weights`, `device`, `attention`, `kv_pages`),
`"sim"` (the cost model; `sim_pace` wall seconds per modelled second, serve/paced.py: 1 makes a
simulated server as slow as the GPU it models, 0 as fast as the host goes), or an engine object
(the `mstar.runtime.step.Engine` protocol, e.g. a wrapped one in tests).
"""
from __future__ import annotations

import asyncio
import itertools
import math
import numbers
import operator
import os
import re
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Sequence, Union, cast

from mstar.arg_types import shown
from mstar.plan.rounds import kv_rounds
from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.prompt_limits import round_prompt_problem
from mstar.runtime.serve.engine_setup import SetupError, is_integer, is_real
from mstar.runtime.serve.media_values import MediaError, media_tensors
from mstar.runtime.serve.online import Closed, Delta, Observer, OnlineLoop, Overloaded
from mstar.runtime.serve.plan_checks import PlanChecks
from mstar.runtime.step import sampling_range_problem

Prompt = Union[str, Sequence[int], dict]
__all__ = ["LLM", "SamplingParams", "Output", "PromptError", "SamplingError", "Overloaded", "Closed", "SetupError"]

# Request ids are unique in the process, not per LLM: a request made by one LLM and run on another
# would otherwise reuse an id the other's run loop had spent (its schedulers remember removed ids).
_REQUEST_IDS = itertools.count()
_MADE_ID = re.compile(r"req-\d+")  # the ids `LLM.request` gives
# the requests any LLM's `request` made in this process (weakly, by id()): ids of the form req-N
# are theirs alone (a request made by one LLM runs on another)
_MADE_REQUESTS: "weakref.WeakValueDictionary[int, Request]" = weakref.WeakValueDictionary()
_REQUEST_IDS_LOCK = threading.Lock()
# `generate` waiting for room in a full loop looks again at least this often (the final delta of
# a request of this LLM wakes it sooner; this covers room freed any other way).
_ROOM_WAIT_S = 0.05


class PromptError(ValueError):
    """A prompt this LLM cannot take (text without a tokenizer, an empty or bad prompt, a token id
    outside the vocabulary, one too long for the plan). `param`: the sampling field the refusal is
    also about (max_tokens, for a prompt + max_tokens past the plan's max_seq_len; prompt, for a
    prompt that alone leaves no room), else None: the prompt itself."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class SamplingError(ValueError):
    """A sampling value out of range (the message names it, first)."""

    @property
    def param(self) -> Optional[str]:
        """The field the message is about: every message starts with its name."""
        name = str(self).split(" ", 1)[0]
        return name if name in SamplingParams.__dataclass_fields__ else None


@dataclass
class SamplingParams:
    """How one request samples and when it ends (the `Request` fields the engines read).
    temperature None or 0: greedy; top_k 0: no limit; stop: strings that end the text (needs a
    tokenizer); stop_token_ids: ids that end it beside the model's own."""

    max_tokens: int = 16
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    route: dict[str, list[str]] = field(default_factory=dict)  # partition -> walks (docs/runtime.md)
    guidance: dict[str, float] = field(default_factory=dict)
    presence_penalty: Optional[float] = None  # OpenAI's, in [-2, 2]: on the node's output tokens so far
    frequency_penalty: Optional[float] = None
    # log-probabilities of each output text token and of this many alternatives beside it (0 to
    # 20; None: none): Output.logprobs
    logprobs: Optional[int] = None
    # log-probabilities of each prompt token given the tokens before it, and of this many
    # alternatives (0 to 20; None: none): Output.prompt_logprobs (no cached prefix is claimed)
    prompt_logprobs: Optional[int] = None
    # token id -> bias in [-100, 100], added to that token's logit before sampling on the calls that
    # send their tokens as text (OpenAI's logit_bias; ids as ints or decimal strings)
    logit_bias: Optional[dict[Any, float]] = None
    # vLLM's extensions: sample on past the model's own end-of-text tokens (stop_token_ids still
    # stop); sample no stop token before this many tokens
    ignore_eos: bool = False
    min_tokens: int = 0

    def check(self) -> None:
        """Raise SamplingError naming the first value of the wrong kind or out of range (a value
        of the wrong kind once reached the run loop and stopped it for every request). Values are
        echoed by `shown`: a route's 10,000-character name was echoed whole, and any max_tokens
        past 4,300 digits, even a valid one, raised Python's ValueError of int -> str instead."""
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be true or false, got {shown(self.ignore_eos)}")
        for name in ("max_tokens", "top_k", "seed", "logprobs", "min_tokens", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_integer(value):
                raise SamplingError(f"{name} must be an integer, got {shown(value)}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not is_real(value):
                raise SamplingError(f"{name} must be a number, got {shown(value)}")
        problems = [
            (self.max_tokens is None or self.max_tokens < 1, f"max_tokens must be >= 1, got {shown(self.max_tokens)}"),
            (self.min_tokens is None, "min_tokens must be an integer, got None"),
            (not _is_list_of(self.stop_token_ids, lambda t: is_integer(t) and t >= 0),
             f"stop_token_ids must be a list of non-negative token ids, got {shown(self.stop_token_ids)}"),
            (not _is_list_of(self.stop, lambda t: isinstance(t, str) and bool(t)),
             f"stop must be a list of non-empty strings, got {shown(self.stop)}"),
            (not isinstance(self.route, dict) or not all(
                isinstance(k, str) and _is_list_of(v, lambda w: isinstance(w, str)) for k, v in self.route.items()),
             f"route must map partition names to lists of walk names, got {shown(self.route)}"),
            (not isinstance(self.guidance, dict) or not all(
                isinstance(k, str) and is_real(v) and math.isfinite(v) and v >= 0 for k, v in self.guidance.items()),
             f"guidance must map guidance labels to finite scales >= 0, got {shown(self.guidance)}"),
        ]
        for is_bad, message in problems:
            if is_bad:
                raise SamplingError(message)
        from mstar.runtime.serve.tokenizer import stop_strings_problem

        problem = stop_strings_problem(self.stop)
        if problem is not None:
            raise SamplingError(problem)
        out_of_range = sampling_range_problem(self.temperature, self.top_k, self.top_p, self.seed,
                                              self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                                              self.logprobs, self.min_tokens, self.max_tokens,
                                              self.prompt_logprobs, show=shown)
        if out_of_range is not None:
            raise SamplingError(out_of_range)
        self.bias_pairs()

    def bias_pairs(self) -> list[tuple[int, float]]:
        """logit_bias as checked (token id, bias) pairs (SamplingError for a bad one)."""
        if self.logit_bias is None or self.logit_bias == {}:  # (the sampling module imports torch: a sim
            return []                                         # LLM loaded it on its first request, 0.9 s)
        from mstar.runtime.engine.sampling import SamplingError as EngineSamplingError, logit_bias_pairs

        if not isinstance(self.logit_bias, dict):
            raise SamplingError(f"logit_bias must map token ids to biases, got {shown(self.logit_bias)}")
        try:
            return list(logit_bias_pairs(self.logit_bias or {}))
        except EngineSamplingError as error:
            raise SamplingError(str(error)) from None


def _is_list_of(value: Any, is_item: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(is_item(item) for item in value)


@dataclass
class Output:
    """One finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # the client text emissions' token ids
    text: Optional[str]  # None without a tokenizer
    finish_reason: str  # stop, length, cancelled, error: ...
    media: list[tuple[str, Any]]  # (modality, value) of audio and image emissions, in order
    num_output_tokens: int  # counted output tokens (audio codes included)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # with SamplingParams.logprobs: one TokenLogprobs a token of token_ids, (the token's
    # log-probability, ((alternative id, its log-probability), ...) most likely first), None for a
    # token no engine row answered them of; None without
    logprobs: Optional[list[Any]] = None
    # with SamplingParams.prompt_logprobs: one TokenLogprobs a token of prompt_token_ids, given the
    # tokens before it (None for the first); None without
    prompt_logprobs: Optional[list[Any]] = None


class LLM:
    """A plan served in this process (module docstring)."""

    def __init__(self, plan: Union[str, Plan], *, engine: Union[str, Any] = "torch",
                 weights: Optional[list[str]] = None, tokenizer: Optional[str] = None, dims: str = "tiny",
                 kv_pages: Optional[int] = None, device: str = "cpu", attention: str = "auto", seed: int = 0,
                 sim_pace: float = 0.0, max_waiting: int = 256, observer: Optional[Observer] = None):
        from mstar.runtime.serve.audio_input import takes_waveform
        from mstar.runtime.serve.endpoints import default_route_media, prompt_modalities
        from mstar.runtime.serve.engine_setup import audio_layout, build_engine, build_tokenizer, load, prompt_format

        _check_arguments(plan, engine, max_waiting, observer)
        # A request without a seed samples with the next of seed x 1000003 + i (i counting this LLM's
        # unseeded requests, `mstar run`'s rule for request i): each its own draws, reproducible from
        # the LLM's seed and the order of requests. With one seed for all (the sampler's 0), n
        # choices of a body and every repeat of a prompt came out the same.
        self._unseeded = itertools.count(seed * 1_000_003 if is_integer(seed) else 0)
        self._unseeded_lock = threading.Lock()
        if isinstance(plan, os.PathLike):
            plan = os.fspath(plan)
        self.plan = load(plan) if isinstance(plan, str) else plan
        # A partition that repeats (`repeat while VALUE max=N`, Whisper's windows) starts a new
        # sequence each round, so a request's tokens may reach N sequences' worth: the rounds of
        # the partitions holding the kv nodes' walks (max_seq_len bounds their sequences).
        self.max_rounds = kv_rounds(self.plan)
        self.tokenizer = build_tokenizer(self.plan, weights, tokenizer)
        self.prompt_format = prompt_format(self.plan)
        self.audio_layout = audio_layout(self.plan)
        self.checks = PlanChecks(self.plan)  # vocabulary, routes, guidance labels (request() checks them)
        self.engine = engine if not isinstance(engine, str) else build_engine(
            self.plan, engine, weights=weights, dims=dims, kv_pages=kv_pages, device=device, attention=attention,
            seed=seed, sim_pace=sim_pace, plan_path=plan if isinstance(plan, str) else None)
        self.loop = OnlineLoop(self.plan, self.engine, decode=self.tokenizer.decode if self.tokenizer else None,
                               max_waiting=max_waiting, observer=observer)
        self._used: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()  # by id()
        self._used_lock = threading.Lock()
        self._room = threading.Condition()  # notified when a request of this LLM ends (generate waits on it)
        self._handoffs: dict[asyncio.AbstractEventLoop, _Handoff] = {}
        # streams of several threads, each on its own event loop, register their loops at once (one
        # thread's sweep of closed loops raised "dictionary changed size during iteration")
        self._handoffs_lock = threading.Lock()
        # The prompt media the default route takes (a request without them is refused, _check_media).
        self.default_media = default_route_media(self.plan)
        # The prompt media any route takes, and whether its audio is a waveform (media_values.py)
        self.media_modalities = prompt_modalities(self.plan) - {"text"}
        self.takes_waveform = takes_waveform(self.plan)
        self.loop.start()
        # An LLM never closed is closed when it is collected or at the interpreter's exit, whichever
        # comes first (its thread ran on, holding the engine; at exit, running in torch while the
        # interpreter shut down aborted the process). The finalizer holds the loop, not the LLM,
        # and nothing the loop's thread holds refers to the LLM, so a dropped LLM is collected.
        self._finalizer = weakref.finalize(self, _close_dropped, self.loop)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, timeout_s: Optional[float] = None) -> None:
        """No new requests; those in flight finish (at most timeout_s seconds; None waits for them),
        then the loop stops. A timeout that is not a number >= 0 is a ValueError, before anything
        is closed (nan, "5" and inf raised from the thread join after the LLM had stopped taking
        requests, its run loop left running)."""
        self.loop.close(_close_timeout(timeout_s))
        self._finalizer.detach()

    # ------------------------------------------------------------ requests

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (module docstring); PromptError when it cannot be tokenized."""
        from mstar.runtime.serve.prompt_format import PromptFormatError
        from mstar.runtime.serve.tokenizer import HOW_TO_ADD, TokenizerError

        if isinstance(prompt, (str, dict)) and self.tokenizer is None:
            raise PromptError(f"a text or chat prompt needs a tokenizer, and none is loaded: {HOW_TO_ADD} (in "
                              "Python: LLM(..., weights=[DIR]) or LLM(..., tokenizer=DIR)); or send the prompt as "
                              "token ids")
        if isinstance(prompt, dict):
            self._check_prompt_keys(prompt)
        try:
            if isinstance(prompt, str):
                ids = self._text_tokens(prompt, {})
            elif isinstance(prompt, dict) and "prompt" in prompt:
                ids = self._text_tokens(prompt["prompt"], prompt)
            elif isinstance(prompt, dict):
                if self.prompt_format is not None:
                    raise PromptError(f"this model frames a text prompt by its prompt format "
                                      f"({self.prompt_format.template!r}); it takes no chat messages")
                ids = self.tokenizer.encode_chat(_messages(prompt.get("messages")))
            else:
                ids = _token_ids(prompt)
        except TokenizerError as error:
            raise PromptError(str(error)) from None
        except PromptFormatError as error:  # (a format field's own fault names it: Orpheus's voice)
            raise PromptError(str(error), param=error.field) from None
        if not ids:
            raise PromptError("the prompt is empty")
        if not all(t >= 0 for t in ids):
            raise PromptError("prompt token ids must be non-negative integers")
        return ids

    def _check_prompt_keys(self, prompt: dict) -> None:
        """PromptError for a key a prompt dict cannot mean: a misspelt format field (Orpheus's
        `"vocie"`) silently took the default voice. A text prompt takes `prompt` and the plan's
        prompt format fields; a chat prompt `messages`."""
        fields = self.prompt_format.fields if self.prompt_format is not None else []
        if "prompt" not in prompt and "messages" not in prompt:  # (a misspelt "promt" was told it takes messages)
            raise PromptError(f"a prompt dict needs 'prompt' (text{', with ' + ', '.join(fields) if fields else ''}) "
                              f"or 'messages' (chat), got {sorted(str(key) for key in prompt) or 'neither'}")
        known = ["prompt", *fields] if "prompt" in prompt else ["messages"]
        unknown = sorted(str(key) for key in prompt if key not in known)
        if unknown:
            raise PromptError(f"the prompt names {', '.join(map(repr, unknown))}, which it does not take (it takes: "
                              f"{', '.join(known)})")

    def _text_tokens(self, text: Any, fields: dict[str, Any]) -> list[int]:
        """Text through the plan's prompt format (its other fields from `fields`, else the spec's
        defaults) when the plan declares one, else straight through the tokenizer."""
        from mstar.runtime.serve.prompt_format import format_prompt

        if not isinstance(text, str):
            raise PromptError("a text prompt must be a string")
        if not text:
            return []
        if self.prompt_format is None:
            return self.tokenizer.encode(text)
        return format_prompt(self.prompt_format, self.tokenizer, text, fields)

    def laid_out_audio(self, ids: list[int], num_samples: int) -> list[int]:
        """The prompt around the audio's states (serve/audio_prompt.py): an empty one framed by the
        plan's prompt format around empty text first, as `mstar run` frames a line with only audio."""
        from mstar.runtime.serve.audio_prompt import AudioPromptError, expand
        from mstar.runtime.serve.prompt_format import PromptFormatError, format_prompt

        try:
            if not ids and self.prompt_format is not None and self.tokenizer is not None:
                ids = format_prompt(self.prompt_format, self.tokenizer, "", {})
            return expand(self.audio_layout, ids, num_samples)
        except (AudioPromptError, PromptFormatError) as error:
            raise PromptError(str(error)) from None

    def request(self, prompt: Prompt, sampling: Optional[SamplingParams] = None,
                media: Optional[dict[str, Any]] = None) -> Request:
        """The runtime Request for a prompt (checked; PromptError / SamplingError). `media`: the
        request's media by modality (`{"audio": samples}`); with media the prompt may be empty
        token ids (Whisper's decoder then starts its own sequence, as a prompts line with audio; a
        plan with an audio layout frames it and repeats its placeholder once per audio state)."""
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise SamplingError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.check()
        self._check_against_plan(sampling)
        if media is not None and not isinstance(media, dict):
            raise PromptError(f"media must map modalities to values ({{'audio': samples}}), got {type(media).__name__}")
        try:
            media = media_tensors(media, self.media_modalities, self.takes_waveform) if media else {}
        except MediaError as error:
            raise PromptError(str(error), param="media") from None
        self._check_media(media, sampling.route)
        if sampling.stop and self.tokenizer is None:
            raise SamplingError("stop strings need a tokenizer, and none is loaded; use stop_token_ids")
        is_empty = isinstance(prompt, (list, tuple)) and not prompt
        ids = [] if media and is_empty else self.prompt_tokens(prompt)
        audio = (media or {}).get("audio")
        if audio is not None and self.audio_layout is not None:
            ids = self.laid_out_audio(ids, int(audio.shape[0]))
        self._check_room(ids, sampling.max_tokens)
        with _REQUEST_IDS_LOCK:
            request_id = f"req-{next(_REQUEST_IDS)}"
        seed = sampling.seed if sampling.seed is not None else self._next_unseeded()
        request = Request(id=request_id, prompt_tokens=ids, max_tokens=sampling.max_tokens,
                          temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          seed=seed, repetition_penalty=sampling.repetition_penalty,
                          presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                          logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs,
                          logit_bias=sampling.bias_pairs(), ignore_eos=sampling.ignore_eos,
                          min_tokens=sampling.min_tokens,
                          stop_tokens=list(sampling.stop_token_ids),
                          stop_strings=list(sampling.stop),
                          route={k: list(v) for k, v in sampling.route.items()}, guidance=dict(sampling.guidance),
                          media=dict(media or {}))
        with _REQUEST_IDS_LOCK:
            _MADE_REQUESTS[id(request)] = request
        return request

    def _check_room(self, ids: list[int], max_tokens: int) -> None:
        """PromptError for a prompt id outside the vocabulary, a prompt and max_tokens past the
        plan's max_seq_len (its rounds'), or a prompt that alone fills one round's max_seq_len where a
        partition repeats (the torch engine's Whisper decoder refused it at admission; the simulated
        engine ran it)."""
        outside = self.checks.prompt_problem(ids)
        if outside is not None:
            raise PromptError(outside)
        fills_round = round_prompt_problem(ids, self.plan.deployment.max_seq_len) if self.max_rounds > 1 else None
        if fills_round is not None:  # (the engines' rule: each round's new sequence holds the prompt)
            raise PromptError(fills_round, param="prompt")
        limit, bound = self.token_limit()
        if len(ids) + min(max_tokens, 1) > limit:  # no max_tokens would do: the prompt is what to change
            raise PromptError(f"the prompt is {len(ids)} tokens, which leaves no room to generate within the plan's "
                              f"{bound}; shorten the prompt", param="prompt")
        if len(ids) + max_tokens > limit:
            raise PromptError(f"the prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) is "
                              f"{len(ids) + max_tokens} tokens, more than the plan's {bound}", param="max_tokens")

    def _check_given(self, request: Request) -> None:
        """A Request built by hand (not by `request`), checked as `request` checks what it makes
        (PromptError / SamplingError before anything runs): a bad field failed in the run loop,
        which then failed every request in flight (`route=None`) or left the batch waiting for ever
        (`prompt_tokens=None`)."""
        if not isinstance(request.id, str) or not request.id:
            raise PromptError(f"a request's id must be a non-empty string, got {shown(request.id)}")
        ids = request.prompt_tokens
        if not _is_list_of(ids, lambda t: is_integer(t) and t >= 0) or not (ids or request.media):
            raise PromptError(f"request {shown(request.id)}: prompt_tokens must be a non-empty list of token ids "
                              f"(integers >= 0), got {shown(ids)}")
        if not _is_list_of(request.logit_bias, lambda pair: isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise SamplingError(f"logit_bias must be (token id, bias) pairs, got {shown(request.logit_bias)}")
        sampling = SamplingParams(
            max_tokens=request.max_tokens, temperature=request.temperature, top_k=request.top_k,
            top_p=request.top_p, seed=request.seed, repetition_penalty=request.repetition_penalty,
            stop=request.stop_strings, stop_token_ids=request.stop_tokens, route=request.route,
            guidance=request.guidance, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, ignore_eos=request.ignore_eos, min_tokens=request.min_tokens,
            logit_bias=dict(request.logit_bias) or None, logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs)
        sampling.check()
        # the shapes `request` makes: a tuple of walks never matched a stage's list (the route was
        # refused on arrival as not taking a stage it named), numpy ints were not token ids there
        request.route = sampling.route = {part: list(walks) for part, walks in request.route.items()}
        request.prompt_tokens = ids = [int(token) for token in ids]
        self._check_against_plan(sampling)
        if sampling.stop and self.tokenizer is None:
            raise SamplingError("stop strings need a tokenizer, and none is loaded; use stop_token_ids")
        self._check_room(ids, sampling.max_tokens)
        counts = self.checks.loop_counts.problem(request.loop_counts)  # (None failed the run loop, every request)
        if counts is not None:
            raise SamplingError(counts)
        self._check_given_media(request)
        self._check_audio_layout(request)

    def _check_given_media(self, request: Request) -> None:
        """A hand-built request's media checked as `request` checks them (PromptError, param media),
        and made the float32 tensors `request` makes of them: a file name failed in its step with
        the engine's TypeError, NaN, int16 or 1e20 samples, `None` and a modality the plan takes none
        of ran without a word (on noise, or on nothing), and a route's missing media too."""
        media = request.media
        if not isinstance(media, dict):
            raise PromptError(f"request {shown(request.id)}: media must map modalities to values "
                              f"({{'audio': samples}}), got {shown(media)}", param="media")
        try:
            checked = media_tensors(media, self.media_modalities, self.takes_waveform) if media else {}
        except MediaError as error:
            raise PromptError(f"request {shown(request.id)}: {error}", param="media") from None
        self._check_media(checked, request.route)
        request.media = checked

    def _check_audio_layout(self, request: Request) -> None:
        """A hand-built request's prompt must hold its clip's placeholders already (`request` lays
        them out): the engine refused it only when it arrived in the loop, as a failed output."""
        shape = getattr((request.media or {}).get("audio"), "shape", None)
        if self.audio_layout is None or shape is None or len(shape) != 1:
            return
        num_states = self.audio_layout.num_states(int(shape[0]))
        num_held = request.prompt_tokens.count(self.audio_layout.placeholder)
        if num_held != num_states:
            raise PromptError(f"request {shown(request.id)}: the prompt holds the audio placeholder (token "
                              f"{self.audio_layout.placeholder}) {num_held} times, and the clip makes {num_states} "
                              "states: give it once per state, or build the request with llm.request(prompt, "
                              "sampling, media), which lays the prompt out", param="prompt")

    def _next_unseeded(self) -> int:
        with self._unseeded_lock:
            return next(self._unseeded)

    def token_limit(self) -> tuple[int, str]:
        """The most tokens a request's prompt and output may hold together, and how messages name
        that bound: the plan's max_seq_len, times its rounds where each round starts a sequence."""
        length, rounds = self.plan.deployment.max_seq_len, self.max_rounds
        bound = f"max_seq_len {length}" if rounds == 1 else f"max_seq_len {length} x {rounds} rounds"
        return length * rounds, bound

    def _check_against_plan(self, sampling: SamplingParams) -> None:
        """SamplingError for max_tokens past what the plan's walks make (the request ended at that
        count, `length`), a stop token id no node of the plan samples, a biased token id outside
        the vocabulary of a node taking the text prompt, output or prompt log-probabilities of a plan
        that gives none (no call sends the client text tokens: Orpheus's), a logit_bias or ignore_eos
        such a plan would ignore (engine/text_offer.py), a route the plan's
        partitions and stages do not take, a guidance label the plan does not declare (these once
        ran and ended `error: ...`, and the simulated engine ignored an unknown guidance label)."""
        bias = sampling.bias_pairs()
        for problem in (self.checks.max_tokens_problem(sampling.max_tokens),
                        self.checks.stop_problem(list(sampling.stop_token_ids)),
                        self.checks.logit_bias_problem(bias),
                        self.checks.text.logprobs_problem(sampling.logprobs),
                        self.checks.text.prompt_logprobs_problem(sampling.prompt_logprobs),
                        self.checks.text.text_only_problem(bias, sampling.ignore_eos),
                        self.checks.route_problem(sampling.route),
                        self.checks.guidance_problem(sampling.guidance)):
            if problem is not None:
                raise SamplingError(problem)

    def _check_media(self, media: dict[str, Any], route: dict[str, list[str]]) -> None:
        """PromptError when the request's route (the plan's default where it names none) takes prompt
        media the request lacks (Whisper's and Qwen3-ASR's audio; Qwen3-Omni's through its audio or
        vision walk): without them the encoder ran on seeded noise, a default route's check once
        skipped when a route was given; and when it takes none of media the request brings
        (Qwen3-Omni's default route ignored an audio clip without a word)."""
        from mstar.runtime.serve.endpoints import route_media

        taken = set(self.default_media) if not route else route_media(self.plan, route)
        which = "default route" if not route else "route"
        missing = sorted(taken - set(media))
        if missing:
            raise PromptError(f"this plan's {which} takes the request's {' and '.join(missing)}: pass it as "
                              f"llm.request(prompt, sampling, media={{{missing[0]!r}: ...}}) and give that request to "
                              "generate or stream", param="media")
        unused = sorted(set(media) - taken)
        if unused:
            raise PromptError(f"the request's {which} takes no {' or '.join(unused)}, which it brings: give a route "
                              f"through a walk that takes it (SamplingParams(route=...)), or leave it out",
                              param="media")

    def generate(self, prompts: Union[Prompt, Request, Sequence[Union[Prompt, Request]]],
                 sampling: Union[None, SamplingParams, Sequence[Optional[SamplingParams]]] = None) -> list[Output]:
        """Run the prompts (one prompt, or a list of them; a prompt may be a `request(...)`) to
        the end; outputs in prompt order. `sampling` is the prompts': one SamplingParams for all,
        or a list of one a prompt, in prompt order (None where a prompt takes the defaults); a
        request carries its own (sampling with only requests, or a list's entry at a request's
        place, is a SamplingError). Every request is made (and checked)
        before any is submitted: one bad prompt refuses the batch. A batch larger than the loop
        queues is fed to it as its requests end (never refused with Overloaded). An exception here
        (Closed, Ctrl-C) cancels the requests it already submitted, so none keeps running with
        nobody to collect it."""
        if hasattr(prompts, "tolist") and not isinstance(prompts, (str, dict)):  # a numpy array or a tensor
            prompts = prompts.tolist()
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, (Iterable, Request)):
            raise PromptError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if isinstance(prompts, (set, frozenset)):  # outputs come in prompt order, and a set has none
            raise PromptError(f"prompts must be a list (outputs come in prompt order), got a {type(prompts).__name__}")
        batch: list[Any] = [prompts] if _is_one_prompt(prompts) else list(cast(Iterable[Any], prompts))
        each = _sampling_each(batch, sampling)
        requests = [p if isinstance(p, Request) else self.request(p, s) for p, s in zip(batch, each)]
        for given in (p for p in batch if isinstance(p, Request)):
            self._check_given(given)
        self._claim([p for p in batch if isinstance(p, Request)])
        collectors = [_Collector(r, self.tokenizer is not None) for r in requests]
        num_submitted = 0
        try:
            for request, collector in zip(requests, collectors):
                self._submit_when_room(request, _notifying(self._room, collector.deliver))
                num_submitted += 1
            for collector in collectors:
                collector.done.wait()
        except BaseException:
            for request, collector in zip(requests[:num_submitted], collectors):
                if not collector.done.is_set():
                    self.loop.cancel(request.id)
            self._unclaim(requests[num_submitted:])  # never ran: they may be given again
            raise
        return [c.output() for c in collectors]

    def _submit_when_room(self, request: Request, deliver: Any) -> None:
        """Submit, waiting while the loop is full (Overloaded) for a request to end. The lock is
        held from the refusal to the wait, so an end notified in between is not missed."""
        with self._room:
            while True:
                try:
                    self.loop.submit(request, deliver)
                    return
                except Overloaded:
                    self._room.wait(_ROOM_WAIT_S)

    def _claim(self, requests: list[Request]) -> None:
        """PromptError for a `Request` given to this LLM before (or twice in one batch): the run
        loop spends its id (a second run stalled: `error: stalled: no row of the request can run`).
        Remembered weakly, by object, for as long as the caller keeps it."""
        with self._used_lock:
            seen: set[int] = set()
            for request in requests:
                if self._used.get(id(request)) is request or id(request) in seen:
                    raise PromptError(f"request id {request.id!r} was already given to this LLM, and a request "
                                      "runs once: make a new one with llm.request(...)")
                if _MADE_ID.fullmatch(request.id) and _MADE_REQUESTS.get(id(request)) is not request:
                    # (a copy of one, or a hand-built id that llm.request() hands out later: its
                    # second run stalled, or a later plain generate() did)
                    raise PromptError(f"request id {request.id!r} is of the form llm.request(...) gives its own "
                                      "requests (req-N); a copy or a hand-built request takes another id")
                seen.add(id(request))
            for request in requests:
                self._used[id(request)] = request

    def _unclaim(self, requests: list[Request]) -> None:
        with self._used_lock:
            for request in requests:
                self._used.pop(id(request), None)

    def _handoff(self, event_loop: asyncio.AbstractEventLoop) -> _Handoff:
        with self._handoffs_lock:
            handoff = self._handoffs.get(event_loop)
            if handoff is None:
                for closed in [loop for loop in self._handoffs if loop.is_closed()]:
                    self._handoffs.pop(closed, None)
                handoff = self._handoffs[event_loop] = _Handoff(event_loop)
            return handoff

    async def stream(self, prompt: Union[Prompt, Request],
                     sampling: Optional[SamplingParams] = None) -> AsyncIterator[Delta]:
        """One request's deltas as its steps finish; the last has `finish_reason`. Closing the
        generator early (aclose(), contextlib.aclosing, a cancelled task; a `break` only once the
        generator is collected) cancels the request. Overloaded when the loop is full."""
        if isinstance(prompt, Request) and sampling is not None:
            raise _sampling_beside_request()
        request = prompt if isinstance(prompt, Request) else self.request(prompt, sampling)
        if prompt is request:
            self._check_given(request)
            self._claim([request])
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        handoff = self._handoff(asyncio.get_running_loop())
        try:
            self.loop.submit(request, _notifying(self._room, lambda delta: handoff.put(queue, delta)))
        except BaseException:  # Overloaded, Closed: it never ran, and may be given again
            self._unclaim([request])
            raise
        is_finished = False
        try:
            while not is_finished:
                delta = await queue.get()
                is_finished = delta.is_final
                yield delta
        finally:
            if not is_finished:
                self.loop.cancel(request.id)


class _Handoff:
    """Deltas from the driver's thread to one asyncio event loop, with one wake-up of that loop
    per batch (a step's deltas for many streams) rather than one per delta: each wake-up is a
    write to the loop's self-pipe, a system call."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop):
        self.event_loop = event_loop
        self.pending: deque[tuple[asyncio.Queue, Delta]] = deque()
        self.is_scheduled = False

    def put(self, queue: asyncio.Queue, delta: Delta) -> None:
        """Driver thread. Append first, then look at the flag: `drain` clears the flag before it
        empties the deque, so a delta appended after the flag was seen set is drained by the
        wake-up already scheduled, and one appended after the drain finds the flag cleared."""
        self.pending.append((queue, delta))
        if not self.is_scheduled:
            self.is_scheduled = True
            try:
                self.event_loop.call_soon_threadsafe(self.drain)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                self.pending.clear()

    def drain(self) -> None:
        """Event loop thread."""
        self.is_scheduled = False
        pending = self.pending
        while pending:
            queue, delta = pending.popleft()
            queue.put_nowait(delta)


class _Collector:
    """Gathers one request's deltas for `generate` (deliver runs on the driver thread)."""

    def __init__(self, request: Request, has_text: bool):
        self.request = request
        self.has_text = has_text
        self.deltas: list[Delta] = []
        self.done = threading.Event()

    def deliver(self, delta: Delta) -> None:
        self.deltas.append(delta)
        if delta.is_final:
            self.done.set()

    def output(self) -> Output:
        last = self.deltas[-1]
        return Output(self.request.id, list(self.request.prompt_tokens),
                      [t for d in self.deltas for t in d.token_ids],
                      "".join(d.text for d in self.deltas) if self.has_text else None,
                      last.finish_reason or "error", [m for d in self.deltas for m in d.media],
                      last.num_output_tokens, last.num_cached_tokens,
                      None if self.request.logprobs is None else [e for d in self.deltas for e in d.logprobs or []],
                      self.deltas[0].prompt_logprobs)


def _check_arguments(plan: Any, engine: Any, max_waiting: Any, observer: Any) -> None:
    """SetupError for a constructor argument of the wrong kind or out of range (None for the plan
    or engine was an AttributeError deep inside; max_waiting=-1 silently queued 255; observer=5
    raised on the run loop's thread and the first generate never returned)."""
    from mstar.runtime.serve.online import OBSERVER_HOOKS

    if observer is not None and not all(callable(getattr(observer, hook, None)) for hook in OBSERVER_HOOKS):
        raise SetupError(f"observer must be an mstar.runtime.serve.online.Observer (hooks "
                         f"{', '.join(OBSERVER_HOOKS)}), got {type(observer).__name__}")
    if not isinstance(plan, (str, os.PathLike, Plan)):
        raise SetupError(f"plan must be a plan file path or a Plan, got {type(plan).__name__}")
    if not isinstance(engine, str) and not hasattr(engine, "caps"):
        raise SetupError(f"engine must be 'torch', 'sim' or an engine object (mstar.runtime.step.Engine), "
                         f"got {shown(engine)}")
    if not is_integer(max_waiting) or max_waiting < 0:
        raise SetupError(f"max_waiting must be an integer >= 0, got {shown(max_waiting)}")


def _close_timeout(timeout_s: Any) -> Optional[float]:
    """`close`'s timeout as a thread join takes it: None for None or one past the longest a join
    waits (inf, 1e300: they overflowed it; either is "wait for them"); ValueError for anything but a
    number >= 0."""
    if timeout_s is None:
        return None
    if not is_real(timeout_s) or math.isnan(timeout_s) or timeout_s < 0:
        raise ValueError(f"timeout_s must be None or a number of seconds >= 0, got {shown(timeout_s)}")
    return None if timeout_s > threading.TIMEOUT_MAX else float(timeout_s)


def _sampling_each(batch: list[Any], sampling: Any) -> list[Optional[SamplingParams]]:
    """`generate`'s sampling a prompt: one SamplingParams (or None) for every prompt, or a list or
    tuple of one a prompt, as vLLM's `generate` takes. SamplingError for a list of another length
    (zip would drop prompts or settings without a word) and for sampling given for a request."""
    if not isinstance(sampling, (list, tuple)):
        if sampling is not None and batch and all(isinstance(p, Request) for p in batch):
            raise _sampling_beside_request()
        return [sampling] * len(batch)
    if len(sampling) != len(batch):
        raise SamplingError(f"sampling is a list of {len(sampling)} SamplingParams for {len(batch)} prompt(s): "
                            "give one a prompt, in prompt order, or one SamplingParams for all")
    if any(s is not None and isinstance(p, Request) for p, s in zip(batch, sampling)):
        raise _sampling_beside_request()
    return list(sampling)


def _sampling_beside_request() -> SamplingError:
    return SamplingError("sampling was given with a Request, which carries its own (it would be ignored): "
                         "pass the sampling to llm.request(prompt, sampling, media) instead")


def _notifying(room: threading.Condition, deliver: Any) -> Any:
    """`deliver`, then wake the callers waiting for room when the delta is a request's last (on
    the driver's thread). Holds the condition, never the LLM: the loop's thread must not keep a
    dropped LLM alive."""
    def deliver_and_notify(delta: Delta) -> None:
        deliver(delta)
        if delta.is_final:
            with room:
                room.notify_all()
    return deliver_and_notify


def _close_dropped(loop: OnlineLoop) -> None:
    """An LLM collected, or open at the interpreter's exit, without close(): cut what is in flight
    (nobody waits for it: a waiting caller holds the LLM) and stop the loop's thread. A collection
    may run on a run loop's thread, which cannot join itself: there the closing gets its own thread."""
    if loop.is_closed:
        return
    if threading.current_thread().name == "mstar-run-loop":
        threading.Thread(target=loop.close, args=(0.0,), name="mstar-close", daemon=True).start()
    else:
        loop.close(0.0)


def _is_one_prompt(prompts: Any) -> bool:
    """Text, chat messages, a request or token ids (a list of integers) rather than a list of prompts."""
    return isinstance(prompts, (str, dict, Request)) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                                           and isinstance(prompts[0], numbers.Integral))


def _token_ids(prompt: Any) -> list[int]:
    """A token-id prompt as ints (numpy and torch integers too); PromptError for anything else."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise PromptError(f"a prompt is text, chat messages or a list of token ids, got {type(prompt).__name__}")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        if any(isinstance(t, (str, dict, list, tuple)) or hasattr(t, "tolist") for t in prompt):
            # several prompts, or a 2-D array, where one was wanted (`stream` and `request` take one)
            raise PromptError("one prompt was expected, got a list of prompts: give each its own call, or "
                              "the list to generate()")
        raise PromptError("prompt token ids must be non-negative integers")
    return [operator.index(t) for t in prompt]


def _messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages: a non-empty list of {"role": str, "content": str}, a content of text parts
    joined into one string (`flat_message`, as the server takes them)."""
    if not isinstance(value, list) or not value:
        raise PromptError("messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    messages = [flat_message(message) for message in value]
    for message in messages:
        if not isinstance(message.get("content"), str):
            raise PromptError("each message must be an object with a string 'role' and a string 'content'",
                              param="messages")
    return messages


def flat_message(message: Any) -> Any:
    """A message whose content is a list of text parts (OpenAI's `[{"type": "text", "text": ...}]`)
    with them joined into one string (other parts refused); a message needs a `role` string, and a
    user, system or developer message its content; a missing content of another role (an
    assistant's tool call) is empty."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise PromptError("messages: each message needs a 'role' string", param="messages")
    content = message.get("content")
    if content is None and message["role"] in ("user", "system", "developer"):
        raise PromptError(f"messages: a {message['role']} message needs its 'content'", param="messages")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise PromptError("only text content parts are supported in messages", param="messages")
            if not isinstance(part.get("text"), str):
                raise PromptError("messages: a text content part needs a 'text' string", param="messages")
            texts.append(part["text"])
        return {**message, "content": "".join(texts)}
    return {**message, "content": ""} if content is None else message
