"""Send `mstar bench serve`'s requests to an OpenAI-compatible endpoint and time their streams.

In: `HttpRequest`s (bench_serve_requests.py), the base URL, the model name, the in-flight limit.
Out: one `RequestResult` per request, with times taken on this process's monotonic clock.

Each request is a streaming POST (`"stream": true`, and `stream_options.include_usage` so the
server's own token count comes back in the last event). The response is read as server-sent
events: every `data:` line is one JSON chunk until `data: [DONE]`. A chunk whose choice carries
text (`text` for completions, `delta.content` for chat) or token ids (`token_ids`, the extension
that mstar serve and vLLM use; mstar serve without a tokenizer sends ids and no text) is an
output event: the first one gives
the TTFT, the gaps between successive ones the inter-token latencies (a chunk that carries several
tokens is one gap, as vLLM's benchmark counts them). Output tokens are the usage's
`completion_tokens` when the server sends usage, else the number of output events. A request
fails on a non-2xx status (the OpenAI error message is kept), an `error` chunk, a stream that
ends before `[DONE]`, a connection error or the per-request timeout.

Arrivals: requests start at their `arrival_s` (Poisson) or all at once; with `concurrency` at
most that many are in flight, the next starting as one finishes (with every arrival at 0 this is
the closed loop of `concurrency` clients).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import aiohttp

from mstar.runtime.serve.bench_serve_requests import HttpRequest

MAX_ERROR_BODY = 4096  # bytes of an error response kept for its message
log = logging.getLogger(__name__)


@dataclass
class RequestResult:
    """What one request measured; times are seconds from its send."""

    id: str
    start_s: float  # when it was sent (time.perf_counter)
    end_s: float = 0.0
    ttft_s: Optional[float] = None
    gaps_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s


class StreamError(Exception):
    """A response that breaks the streaming protocol or reports an error (or, from `first_model`,
    a server that lists no model)."""


class _Stream:
    """The state of one response stream while its events arrive."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.num_events = 0
        self.last_event_s: Optional[float] = None
        self.num_usage_tokens: Optional[int] = None
        self.is_done = False

    def on_data(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self.is_done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise StreamError(f"an event that is not JSON: {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"an event that is not a JSON object: {payload[:80]!r}")
        if chunk.get("error"):
            raise StreamError(f"error event: {_message(chunk)}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.num_usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.result.num_prompt_tokens = usage["prompt_tokens"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            if choice.get("text") or delta.get("content") or choice.get("token_ids"):
                self._output_event(now)
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]

    def _output_event(self, now: float) -> None:
        if self.last_event_s is None:
            self.result.ttft_s = now - self.result.start_s
        else:
            self.result.gaps_s.append(now - self.last_event_s)
        self.last_event_s = now
        self.num_events += 1

    def finish(self) -> None:
        if not self.is_done:
            raise StreamError("the stream ended before data: [DONE]")
        self.result.num_output_tokens = self.num_usage_tokens if self.num_usage_tokens is not None \
            else self.num_events


def _message(body: Any) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
    return " ".join(str(body).split())[:200]


async def _error_of(response: aiohttp.ClientResponse) -> str:
    raw = await response.content.read(MAX_ERROR_BODY)
    try:
        message = _message(json.loads(raw))
    except ValueError:
        message = " ".join(raw.decode("utf-8", "replace").split())[:200]
    return f"HTTP {response.status}: {message}"


async def _read_events(response: aiohttp.ClientResponse, stream: _Stream) -> None:
    """Feed every `data:` line of an SSE body to `stream`, timing each as its bytes arrive."""
    pending = b""
    async for piece in response.content.iter_any():
        now = time.perf_counter()
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace").strip()
            if text.startswith("data:"):
                stream.on_data(text[5:].strip(), now)
                if stream.is_done:
                    return


async def send(session: aiohttp.ClientSession, url: str, model: str, request: HttpRequest,
               extra_body: dict[str, Any]) -> RequestResult:
    """POST one streaming request and time it; never raises for what the server or network does."""
    body = {**request.body, **extra_body, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(request.id, time.perf_counter(), num_prompt_tokens=request.num_prompt_tokens)
    stream = _Stream(result)
    try:
        async with session.post(url + request.path, json=body) as response:
            if response.status >= 300:
                result.error = await _error_of(response)
            else:
                await _read_events(response, stream)
                stream.finish()
    except StreamError as error:
        result.error = str(error)
    except asyncio.TimeoutError:
        result.error = "timed out"
    except aiohttp.ClientError as error:
        result.error = f"{type(error).__name__}: {error}"
    result.end_s = time.perf_counter()
    if result.error is not None:
        log.debug("request %s failed: %s", request.id, result.error)
    return result


async def run_requests(requests: list[HttpRequest], base_url: str, model: str, *, concurrency: Optional[int],
                       timeout_s: float, extra_body: dict[str, Any],
                       on_done: Callable[[RequestResult], None] = lambda result: None) -> list[RequestResult]:
    """Send every request at its arrival time, at most `concurrency` in flight (None: no limit)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    url = base_url.rstrip("/")
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(request: HttpRequest) -> RequestResult:
            try:
                result = await send(session, url, model, request, extra_body)
            finally:
                if limit is not None:
                    limit.release()
            on_done(result)
            return result

        started = time.perf_counter()
        tasks = []
        for request in sorted(requests, key=lambda r: r.arrival_s):
            delay = started + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None:
                await limit.acquire()
            tasks.append(asyncio.create_task(one(request)))
        return list(await asyncio.gather(*tasks))


async def first_model(base_url: str, timeout_s: float) -> str:
    """The first model id that GET /v1/models lists (what to send when --model is not given)."""
    url = base_url.rstrip("/") + "/v1/models"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(url) as response:
            if response.status >= 300:
                raise StreamError(f"GET {url}: {await _error_of(response)}")
            try:
                listing = await response.json(content_type=None)
            except ValueError:
                raise StreamError(f"GET {url} did not answer JSON; is this an OpenAI-compatible server?") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
        raise StreamError(f"GET {url} listed no model; pass --model")
    return models[0]["id"]

