"""Request bodies of the OpenAI-style endpoints, and what they become for the Python API.

In: JSON bodies (pydantic models below, strict: a number as a string, a boolean as a number or a
string as a boolean is refused, not coerced; unknown fields are ignored, as OpenAI's server does
for fields it does not know, but on speech, where any other field gives a value to the plan's
prompt format, one the format does not name is refused by name). Out: a prompt (token ids, text
or chat messages) and `SamplingParams` (serve/api.py), or an `ApiError` (status, OpenAI error
type, message, param) for a body the server cannot take: unsupported options (best_of, response
formats other than those documented) are refused rather than ignored, so a
client is never silently given something other than what it asked for. `n` choices (and a
completion's list of prompts) become that many requests (`CompletionBody.prompt_values`,
`_Body.sampling(max_tokens, choice)`; serve/http_app.py and serve/http_stream.py answer them as
one). `presence_penalty`, `frequency_penalty` (in [-2, 2]) and `logit_bias` (token id -> bias in
[-100, 100]) are OpenAI's. Log-probabilities:
a completion's `logprobs: N` and a chat's `logprobs: true` with `top_logprobs: N` (N in 0..20)
become `SamplingParams.logprobs` (`_Body.logprobs_count`); serve/logprobs_format.py answers them.
A completion's `echo` with `logprobs: N` asks the same of the echoed prompt's tokens
(`SamplingParams.prompt_logprobs`, `prompt_logprobs_count`): the choice's `logprobs` then covers
the prompt's tokens, the first with null, then the completion's.

Field names and meanings follow OpenAI's API; extensions (documented in docs/serve.md):
`top_k`, `repetition_penalty`, `stop_token_ids`, `seed` everywhere, vLLM's `ignore_eos` and
`min_tokens` on completions and chat, and `max_tokens` on speech.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable, Literal, Optional, Sequence, Union, cast

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from mstar.arg_types import shown, shown_text
from mstar.runtime.serve.api import PromptError, SamplingParams, flat_message
from mstar.runtime.step import MAX_LOGPROBS, SEED_RANGE

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_SPEECH_TOKENS = 1200  # about 14 s of Orpheus audio (86 tokens a second)
MAX_CHOICES = 128  # choices one text request may ask for (n x prompts): OpenAI's largest n
CANCELLED_MESSAGE = "the request was cancelled (the server is shutting down)"


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 is_counted: bool = False):
        """is_counted: the metrics already counted the request's outcome (an engine refusal ends as
        `refused` in the run loop), so the HTTP layer does not count it again as `invalid`."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.is_counted = is_counted

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# OpenAI request fields this server does not implement: refused by name rather than ignored (a
# client asking for JSON output or tool calls must not get plain text as if it had). Fields of no
# consequence to the answer (`user`, `metadata`, `store`, ...) and unknown ones are ignored.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                      "response_format", "modalities", "audio", "prediction",
                      "web_search_options")
# ... but taken at the value that asks for what this server answers anyway, OpenAI's default (a client
# sending `response_format: {"type": "text"}` on every request got a 400 for asking for plain text).
UNSUPPORTED_FIELDS_TAKEN_AT = {"response_format": {"type": "text"}, "modalities": ["text"]}


# vLLM's fields that shape an answer's text, with the one value this server gives: another value
# is refused by name (each was accepted and ignored: `include_stop_str_in_output: true` still cut
# the stop string off, `skip_special_tokens: false` still dropped the special tokens' text).
TEXT_FIELDS_AS_GIVEN = {"include_stop_str_in_output": False, "skip_special_tokens": True,
                        "spaces_between_special_tokens": True}
# More of vLLM's fields that change an answer, accepted and ignored before (`guided_json` answered
# free text, `min_p` sampled without its floor, chat's `add_generation_prompt: false` still opened
# the assistant's turn): at the value this server gives, taken; another refused by name.
SAMPLING_FIELDS_AS_GIVEN = {"min_p": 0, "use_beam_search": False, "return_tokens_as_token_ids": False}
CHAT_FIELDS_AS_GIVEN = {"add_generation_prompt": True, "continue_final_message": False,
                        "add_special_tokens": False}  # (vLLM's chat default: the template places them)
COMPLETION_FIELDS_AS_GIVEN = {"add_special_tokens": True}
# ... and those of no value this server gives: refused unless null.
VLLM_UNSUPPORTED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
                           "structured_outputs", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
                           "logits_processors")
CHAT_UNSUPPORTED_FIELDS = ("chat_template", "chat_template_kwargs", "documents")


class StreamOptions(BaseModel):
    """`stream_options`: as strict as the body (`"include_usage": "no"` is a 400 naming
    `stream_options.include_usage`; it was read as true). Other keys are ignored, as unknown fields
    of the body are (OpenAI's `include_obfuscation` among them: this server adds no padding)."""
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: Optional[bool] = None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # model_extra: the fields refused by name below
    # this endpoint's fields refused unless null, and those refused at another value than the one given
    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS + VLLM_UNSUPPORTED_FIELDS
    fields_as_given: ClassVar[dict[str, Any]] = {**TEXT_FIELDS_AS_GIVEN, **SAMPLING_FIELDS_AS_GIVEN}

    model: str
    # sampling, shared
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None  # OpenAI's: token id (a JSON key) -> bias in [-100, 100]
    ignore_eos: Optional[bool] = None  # vLLM's extensions (null: the default)
    min_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        """One message for what stop may be (a union's error named the branch tried: `stop.str`);
        an empty string refused as sent (wrapped in a list first, `"stop": ""` read "got ['']")."""
        is_strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if value == "" or (is_strings and "" in value):
            raise ValueError(f"a stop string must not be empty (it would end every answer at once), got {value!r}")
        if value is None or isinstance(value, str) or is_strings:
            return value
        raise ValueError("must be a string or a list of strings")

    @field_validator("stream", mode="before")
    @classmethod
    def _stream(cls, value: Any) -> Any:
        """null is the default (OpenAI's "boolean or null"; it was a 400), a string still refused."""
        return False if value is None else value

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, value: Any) -> Any:
        """A JSON object or null (pydantic's message named the class: "or instance of StreamOptions")."""
        if value is None or isinstance(value, (dict, StreamOptions)):
            return value
        raise ValueError("must be an object (such as {\"include_usage\": true}) or null")

    def common_checks(self) -> None:
        extra = self.model_extra or {}
        for name in self.refused_fields:
            if extra.get(name) is not None and extra[name] != UNSUPPORTED_FIELDS_TAKEN_AT.get(name):
                raise ApiError(400, f"{name} is not supported", param=name)
        for name, given in self.fields_as_given.items():
            if extra.get(name) not in (None, given):
                raise ApiError(400, f"{name} other than {str(given).lower()} is not supported", param=name)
        if self.stream_options is not None and not self.stream:  # (OpenAI's and vLLM's rule; it was ignored)
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be between 1 and {MAX_CHOICES}, got {shown(self.n)}", param="n")
        last = self.num_choices - 1
        if self.seed is not None and last and SEED_RANGE[0] <= self.seed < SEED_RANGE[1] <= self.seed + last:
            # (choice j samples with seed + j: the sampler's range check would name seed + j, a
            # number the client never sent)
            raise ApiError(400, f"seed {self.seed} with n {self.num_choices}: choice j samples with seed + j, and "
                                f"seed + {last} is past a 64-bit integer (at most 2**63 - 1)", param="seed")

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """A fresh SamplingParams (the server sets a chat request's max_tokens on it) for choice
        `choice` of a prompt: with a seed, choice j samples with seed + j, so the n choices differ
        and choice 0 is the answer the same body with n = 1 gets."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=seed, repetition_penalty=self.repetition_penalty,
                              stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logprobs=self.logprobs_count(), prompt_logprobs=self.prompt_logprobs_count(),
                              logit_bias=self.logit_bias, ignore_eos=bool(self.ignore_eos),
                              min_tokens=self.min_tokens or 0)

    def logprobs_count(self) -> Optional[int]:
        """The alternatives a choice asks log-probabilities of beside each token (None: none)."""
        return None

    def prompt_logprobs_count(self) -> Optional[int]:
        """The alternatives a choice asks log-probabilities of beside each prompt token (None: none)."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True


class CompletionBody(_Body):
    fields_as_given: ClassVar[dict[str, Any]] = {**_Body.fields_as_given, **COMPLETION_FIELDS_AS_GIVEN}

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = DEFAULT_COMPLETION_TOKENS
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("echo", mode="before")
    @classmethod
    def _echo(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        """One message for what a prompt may be (a union's error named the branch tried:
        `prompt.str` for a list holding a string among ids)."""
        if isinstance(value, str) or _is_token_ids(value):
            return value
        if isinstance(value, list) and (all(isinstance(v, str) for v in value) or all(map(_is_token_ids, value))):
            return value
        raise ValueError("must be a string, a list of token ids (integers), or a list of one of those")

    def prompt_values(self) -> list[Union[str, list[int]]]:
        """The prompts, in order (a list of texts or of token-id lists is one prompt each; OpenAI's
        choices come prompt by prompt, n each); 400 for an unsupported option, an empty list or more
        than MAX_CHOICES choices in all."""
        self.common_checks()
        if (self.model_extra or {}).get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs is a chat completion field: a completion asks for `logprobs: N`",
                           param="top_logprobs")
        if (self.model_extra or {}).get("prompt_logprobs") is not None:  # (vLLM's; it was ignored)
            raise ApiError(400, "prompt_logprobs is not supported: a completion's prompt log-probabilities come "
                           "with `echo: true` and `logprobs: N` (OpenAI's), in the choice's logprobs",
                           param="prompt_logprobs")
        _check_logprobs_count("logprobs", self.logprobs)
        for name, value, ok in (("best_of", self.best_of, 1), ("suffix", self.suffix, None)):
            if value is not None and value != ok:
                raise ApiError(400, f"{name} is not supported", param=name)
        if self.best_of is not None and self.best_of < self.num_choices:  # (OpenAI's and vLLM's rule)
            raise ApiError(400, f"best_of must be at least n, got n={self.num_choices} and best_of={self.best_of}",
                           param="best_of")
        prompt = self.prompt
        is_list = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = cast(list[Union[str, list[int]]], list(prompt) if is_list else [prompt])
        if len(prompts) * self.num_choices > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n {self.num_choices} is {len(prompts) * self.num_choices} "
                           f"choices, more than the {MAX_CHOICES} one request may ask for", param="prompt")
        return prompts

    def logprobs_count(self) -> Optional[int]:
        return self.logprobs

    def prompt_logprobs_count(self) -> Optional[int]:
        """echo with logprobs: the echoed prompt's tokens carry log-probabilities too (OpenAI's)."""
        return self.logprobs if self.echo else None


class ChatBody(_Body):
    refused_fields: ClassVar[tuple[str, ...]] = _Body.refused_fields + CHAT_UNSUPPORTED_FIELDS
    fields_as_given: ClassVar[dict[str, Any]] = {**_Body.fields_as_given, **CHAT_FIELDS_AS_GIVEN}

    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    def prompt_value(self) -> dict[str, Any]:
        self.common_checks()
        for name in ("echo", "prompt_logprobs"):  # (vLLM's; each was ignored)
            if (self.model_extra or {}).get(name) not in (None, False):
                raise ApiError(400, f"{name} is not supported on chat completions (a completion's `echo` with "
                               "`logprobs: N` gives a prompt's text and log-probabilities)", param=name)
        best_of = (self.model_extra or {}).get("best_of")
        if best_of not in (None, 1):  # (vLLM's; it was accepted and ignored: one sample, n answers)
            raise ApiError(400, "best_of is not supported", param="best_of")
        _check_logprobs_count("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:  # (0 asks for nothing: some clients send it always)
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return {"messages": [_flat_message(m) for m in self.messages]}

    def logprobs_count(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limit_field(self) -> str:
        """The field `token_limit` comes from, which its errors name (they said `max_tokens` to a
        client that sent `max_completion_tokens`)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def _check_logprobs_count(name: str, value: Optional[int]) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be between 0 and {MAX_LOGPROBS}, got {shown(value)}", param=name)


def _flat_message(message: dict[str, Any]) -> dict[str, Any]:
    """The API's `flat_message` (text content parts joined), its PromptError a 400."""
    try:
        return flat_message(message)
    except PromptError as error:
        raise ApiError(400, str(error), param=error.param) from None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt as /v1/completions takes it (`prompt` text), or chat `messages`;
    beside `prompt`, values for the plan's prompt format fields, as speech takes them (Orpheus's
    `voice`). Other fields are refused by name: a misspelt `vocie` was ignored, and the count was
    the default voice's."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: Optional[bool] = None  # vLLM's; only true (the ids a request sends)

    def prompt_value(self, format_fields: Sequence[str]) -> Union[str, dict[str, Any]]:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
        if self.add_special_tokens is False:
            raise ApiError(400, "add_special_tokens false is not supported: /tokenize gives the ids a request sends, "
                                "special tokens included", param="add_special_tokens")
        fields = dict(self.model_extra or {})
        takes = format_fields if self.prompt is not None else []
        _refuse_other_fields(fields, takes, "/tokenize takes " + (f"{', '.join(takes)} beside prompt" if takes
                                                                 else "no field beside prompt or messages"))
        if self.messages is not None:
            return {"messages": [_flat_message(m) for m in self.messages]}
        return {**fields, "prompt": self.prompt} if fields else cast(str, self.prompt)


def _refuse_other_fields(fields: Iterable[str], takes: Sequence[str], says: str) -> None:
    """A 400 naming (in `param`) the first of a body's `fields` that is not one of the plan's
    prompt format fields it `takes`; `says`: what the endpoint takes instead."""
    for name in fields:
        if name not in takes:
            raise ApiError(400, f"{shown_text(name, 100)} is not supported: {says}", param=shown_text(name, 100))


class DetokenizeBody(BaseModel):
    """vLLM's /detokenize: token ids to their text."""
    model_config = ConfigDict(strict=True)

    model: str
    tokens: list[int]


class SpeechBody(BaseModel):
    # Other fields are kept: they may give values to fields of the plan's prompt format.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    input: str
    voice: str = ""
    response_format: str = "wav"
    speed: Optional[float] = None
    stream_format: Optional[Literal["audio", "sse"]] = None
    instructions: Optional[str] = None
    # extensions
    max_tokens: int = DEFAULT_SPEECH_TOKENS
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None

    @field_validator("voice", "response_format", "max_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """null asks for the default, as on the text endpoints (it was a 400 here)."""
        return cls.model_fields[info.field_name or ""].default if value is None else value

    def checks(self) -> None:
        self._check_stream()
        if self.response_format not in ("wav", "pcm"):
            raise ApiError(400, f"response_format {shown(self.response_format)} is not supported: wav or pcm",
                           param="response_format")
        if self.speed not in (None, 1, 1.0):
            raise ApiError(400, "speed other than 1.0 is not supported", param="speed")
        if not self.input:
            raise ApiError(400, "input must not be empty", param="input")

    def _check_stream(self) -> None:
        """OpenAI's speech API has no `stream` (the chat one's): `"stream": true` was taken for a prompt
        format field, "the prompt names 'stream'" with `param: null`. Now a 400 saying how speech
        streams; false and null, which ask for what speech gives anyway, are dropped."""
        extra = self.model_extra or {}
        if "stream" in extra and (extra["stream"] is None or extra["stream"] is False):  # not 0: strict
            del extra["stream"]
        elif "stream" in extra:
            raise ApiError(400, 'speech takes no "stream" field: it streams by its formats, "response_format": '
                           '"pcm" (raw samples as they are made) or "stream_format": "sse" (audio delta events)',
                           param="stream")

    def prompt(self, format_fields: Sequence[str]) -> dict[str, Any]:
        """The text and the values for the plan's prompt format fields (`format_fields`): `voice`
        and `instructions` (when given) and any other field of the body, by name. A field the format
        does not name is a 400 naming it in `param` (`instructions` and extra fields such as `"n": 2`
        were accepted and ignored; then the Python API's "the prompt names 'n', which it does not
        take" came with `param: null`, and an extra `prompt` was dropped for `input`)."""
        fields = dict(self.model_extra or {})
        if self.voice:
            fields["voice"] = self.voice
        if self.instructions:
            fields["instructions"] = self.instructions
        says = "this model's speech " + (
            f"takes {', '.join(format_fields)} beside input (its prompt format's fields)" if format_fields
            else "takes no field beside input (it has no prompt format)")
        if "voice" not in format_fields:
            # OpenAI's client requires a voice (`audio.speech.create(voice=...)`): say how to send none
            says += '; a client that must name a voice may send "voice": ""'
        _refuse_other_fields(fields, format_fields, says)
        return {**fields, "prompt": self.input}

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, repetition_penalty=self.repetition_penalty)


# Image fields that choose among kinds of answer: the values taken (those asking for the one image
# this server makes anyway: absent, OpenAI's defaults) and why others are refused. Each was
# ignored, so a client asking for a transparent, JPEG, hd or vivid image got this opaque PNG as if
# it were that one. Moderation: the server filters no prompt or image, which `auto` and `low` (less
# filtering) ask no more than.
IMAGE_CHOICES = (("background", ("auto", "opaque"), "the image has no alpha channel"),
                 ("output_format", ("png",), "the only format this server encodes"),
                 ("quality", ("auto", "standard"), "the plan makes every image the one way, by its own steps"),
                 ("style", (), "this server has no styles: the image is the plan's model's own"),
                 ("moderation", ("auto", "low"), "this server filters no prompt or image"))


class ImageBody(BaseModel):
    # extra fields kept to be refused by name (`checks`): a `temperature` or `tools` was ignored
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    prompt: str
    n: Optional[int] = None
    response_format: Optional[str] = None
    size: Optional[str] = None
    seed: Optional[int] = None
    # the answer is one whole opaque image: a stream of partial images is refused (it was ignored;
    # a streaming client could not read the JSON answer), and so are the IMAGE_CHOICES' other values
    stream: Optional[bool] = None
    partial_images: Optional[int] = None
    background: Optional[str] = None
    output_format: Optional[str] = None
    quality: Optional[str] = None
    style: Optional[str] = None
    moderation: Optional[str] = None
    # lossy encoders' quality (jpeg, webp): the PNG this server makes has none
    output_compression: Optional[int] = None
    user: Optional[str] = None  # the end user, for the provider's abuse monitoring: this server keeps no such log

    def checks(self) -> None:
        extra = next(iter(self.model_extra or {}), None)
        if extra is not None:
            raise ApiError(400, f"{shown(extra)} is not supported: the images endpoint takes the fields of OpenAI's "
                           f"image generation API, and seed", param=shown_text(extra, 100))
        if self.output_compression is not None:
            raise ApiError(400, "output_compression is not supported: it sets jpeg and webp compression, and this "
                           "server encodes png (lossless)", param="output_compression")
        if self.stream or self.partial_images:
            field = "stream" if self.stream else "partial_images"
            raise ApiError(400, f"{field}: this server answers an image whole, not as a stream of partial images",
                           param=field)
        if self.n not in (None, 1):
            raise ApiError(400, f"n must be 1, got {shown(self.n)}", param="n")
        if self.response_format not in (None, "b64_json"):
            raise ApiError(400, "response_format must be b64_json (this server keeps no files to link to)",
                           param="response_format")
        for name, taken, why in IMAGE_CHOICES:
            value = getattr(self, name)
            if value is not None and value not in taken:
                # the value clipped: a 10,000-character one was echoed whole
                raise ApiError(400, f"{name} {shown(value)} is not supported: {' or '.join(taken) or 'leave it out'} "
                               f"({why})", param=name)
        if not self.prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
