"""The requests `mstar bench serve` sends: generated like `mstar run`'s, or read from a JSONL dataset.

In: the workload flags (count, prompt and output length ranges, seed, prompt kind, endpoint) or a
dataset path. Out: a list of `HttpRequest` (the URL path, the JSON body less `model` and `stream`,
the prompt length when it is known, the arrival offset for Poisson arrivals).

Generated requests come from `workload.generate` with the same arguments `mstar run` passes it, so
one seed gives both commands the same prompt token ids and the same max_tokens per request (the
way to compare a server with `mstar run` on one workload). Token-id prompts go to /v1/completions
as a list of ints; text prompts are one word per generated token id (`WORDS[id % len(WORDS)]`, a
word being about one token for common tokenizers: the server's tokenizer decides the real count),
to /v1/completions or, as one user message, /v1/chat/completions.

A dataset line is `mstar run --prompts`'s format (docs/runtime.md) as far as an OpenAI endpoint
can carry it: exactly one of "prompt_tokens" ([int]), "prompt" (text) or "messages" (chat), a
"max_tokens", optional "id", "temperature", "top_p", "top_k", "seed", "stop",
"repetition_penalty", "presence_penalty", "frequency_penalty" and "stop_tokens" (sent as vLLM's
"stop_token_ids"). "route" and "guidance"
are mstar plan fields that no OpenAI request has: refused, as is any other unknown field.
`BenchInputError` names the file, the line and what is wrong.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from mstar.arg_types import shown_path
from mstar.files import MAX_PROMPTS_BYTES, InputFileError, read_bytes_bounded

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT_KINDS = ("tokens", "text")
ENDPOINTS = ("completions", "chat")
# Short common English words: each is one token in the usual BPE vocabularies.
WORDS = tuple(
    "the of and to in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part".split()
)
SAMPLING_FIELDS = {"temperature": (int, float), "top_p": (int, float), "top_k": (int,), "seed": (int,),
                   "repetition_penalty": (int, float), "presence_penalty": (int, float),
                   "frequency_penalty": (int, float), "min_tokens": (int,)}
# A prompts line's fields that `mstar run` reads and an OpenAI body carries under the same name or
# another shape (`_carried_fields`)
CARRIED_FIELDS = ("logprobs", "logit_bias", "ignore_eos")


class BenchInputError(Exception):
    """A bad workload flag or dataset line."""


@dataclass
class HttpRequest:
    """One request to send: `path` under the base URL, `body` without model and stream."""

    id: str
    path: str
    body: dict[str, Any]
    num_prompt_tokens: Optional[int] = None  # known for token-id prompts; else the server's usage says
    arrival_s: float = 0.0


def generated_requests(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], *,
                       seed: int, prompt_kind: str, endpoint: str, rate: Optional[float]) -> list[HttpRequest]:
    """`mstar run`'s generated workload (same seed, same ids and lengths) as HTTP requests; with a
    finite `rate` the arrivals are its Poisson arrivals, else every request is ready at time 0."""
    from mstar.runtime.serve.workload import WorkloadError, generate

    if endpoint == "chat" and prompt_kind == "tokens":
        raise BenchInputError("--endpoint chat sends text messages: add --prompt-kind text")
    poisson_rate = rate if rate is not None and math.isfinite(rate) else None
    is_poisson = poisson_rate is not None
    try:
        workload = generate(num_requests, prompt_len=prompt_len, output_len=output_len,
                            arrival="poisson" if poisson_rate is not None else "closed",
                            rate=poisson_rate if poisson_rate is not None else 100.0, seed=seed)
    except WorkloadError as error:  # the generator speaks of mstar run's --rate
        raise BenchInputError(str(error).replace("--rate", "--request-rate")) from None
    requests = []
    for request in workload.requests:
        body: dict[str, Any] = {"max_tokens": request.max_tokens}
        if prompt_kind == "tokens":
            body["prompt"] = list(request.prompt_tokens)
        else:
            text = " ".join(WORDS[t % len(WORDS)] for t in request.prompt_tokens)
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
        known = len(request.prompt_tokens) if prompt_kind == "tokens" else None
        requests.append(HttpRequest(request.id, CHAT if endpoint == "chat" else COMPLETIONS, body, known,
                                    request.arrival_s if is_poisson else 0.0))
    return requests


def _checked(obj: dict, name: str, kinds: tuple, where: str) -> Any:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = {str: "a string", int: "an integer", float: "a number"}[kinds[-1]]
        raise BenchInputError(f"{where}: field {name!r} must be {what}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BenchInputError(f"{where}: field {name!r} must be finite, got {value}")
    return value


def _prompt(obj: dict, where: str) -> tuple[str, dict[str, Any], Optional[int]]:
    """(path, prompt part of the body, known prompt length) of one dataset line."""
    given = [name for name in ("prompt_tokens", "prompt", "messages") if name in obj]
    if len(given) != 1:
        raise BenchInputError(f"{where}: give the prompt as exactly one of 'prompt_tokens', 'prompt' (text) or "
                              f"'messages' (chat), got {given or 'none'}")
    value = obj[given[0]]
    if given[0] == "prompt_tokens":
        if not isinstance(value, list) or not value or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise BenchInputError(f"{where}: 'prompt_tokens' must be a non-empty list of non-negative integers")
        return COMPLETIONS, {"prompt": value}, len(value)
    if given[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise BenchInputError(f"{where}: 'prompt' must be non-empty text")
        return COMPLETIONS, {"prompt": value}, None
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise BenchInputError(f"{where}: 'messages' must be a non-empty list of objects with a 'role' and a "
                              "'content' string each")
    return CHAT, {"messages": value}, None


def _optional_fields(obj: dict, where: str) -> dict[str, Any]:
    body = {name: _checked(obj, name, kinds, where) for name, kinds in SAMPLING_FIELDS.items() if name in obj}
    if "stop" in obj:
        stop = obj["stop"]
        if not (isinstance(stop, str) and stop) and not (
                isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BenchInputError(f"{where}: 'stop' must be a non-empty string or a list of non-empty strings")
        body["stop"] = stop
    if "stop_tokens" in obj:
        ids = obj["stop_tokens"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise BenchInputError(f"{where}: 'stop_tokens' must be a list of non-negative integers")
        body["stop_token_ids"] = ids
    return body


def _carried_fields(obj: dict, where: str, path: str) -> dict[str, Any]:
    """logprobs (a completion's `logprobs: N`, a chat's `logprobs: true, top_logprobs: N`),
    logit_bias and ignore_eos of a dataset line, as the body carries them (the server checks
    their values, as for any client)."""
    body: dict[str, Any] = {}
    if "logprobs" in obj:
        count = _checked(obj, "logprobs", (int,), where)
        body.update({"logprobs": True, "top_logprobs": count} if path == CHAT else {"logprobs": count})
    if "logit_bias" in obj:
        biases = obj["logit_bias"]
        if not isinstance(biases, dict):
            raise BenchInputError(f"{where}: 'logit_bias' must map token ids to biases")
        body["logit_bias"] = biases
    if "ignore_eos" in obj:
        if not isinstance(obj["ignore_eos"], bool):
            raise BenchInputError(f"{where}: 'ignore_eos' must be true or false")
        body["ignore_eos"] = obj["ignore_eos"]
    return body


def parse_dataset_line(line: str, where: str, index: int) -> HttpRequest:
    try:
        obj = json.loads(line)
    except ValueError as error:
        raise BenchInputError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(obj, dict):
        raise BenchInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in ("route", "guidance"):
        if name in obj:
            raise BenchInputError(f"{where}: {name!r} is an mstar plan field that an OpenAI request cannot carry; "
                                  "remove it to benchmark over HTTP")
    known = {"id", "prompt_tokens", "prompt", "messages", "max_tokens", "stop", "stop_tokens", *SAMPLING_FIELDS,
             *CARRIED_FIELDS}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise BenchInputError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")
    if "max_tokens" not in obj:
        raise BenchInputError(f"{where}: missing required field 'max_tokens'")
    max_tokens = _checked(obj, "max_tokens", (int,), where)
    if max_tokens < 1:
        raise BenchInputError(f"{where}: 'max_tokens' must be >= 1, got {max_tokens}")
    request_id = _checked(obj, "id", (str,), where) if "id" in obj else f"line-{index:06d}"
    path, body, num_prompt = _prompt(obj, where)
    body.update(max_tokens=max_tokens, **_optional_fields(obj, where), **_carried_fields(obj, where, path))
    return HttpRequest(request_id, path, body, num_prompt)


def read_dataset(path: str) -> list[HttpRequest]:
    """Every non-blank line of a JSONL dataset as a request (all ready at time 0)."""
    named = shown_path(path)  # as messages name it
    try:
        text = read_bytes_bounded(path, max_bytes=MAX_PROMPTS_BYTES, what="dataset").decode("utf-8-sig")
    except InputFileError as error:
        raise BenchInputError(f"cannot read {error}") from None
    except UnicodeDecodeError as error:
        raise BenchInputError(f"cannot read dataset {named}: not UTF-8 text (offset {error.start}); it must be "
                              "JSON lines") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    requests = [parse_dataset_line(line, f"{named}:{number}", number)
                for number, line in enumerate(lines, start=1) if line.strip()]
    if not requests:
        raise BenchInputError(f"{named}: no requests in the file")
    return requests
