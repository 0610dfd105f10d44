"""The OpenAI-compatible HTTP app (FastAPI) over the Python API (serve/api.py `LLM`).

In: an `LLM` (plan, engine, tokenizer, online loop), the model name clients must send and the
metrics (serve/prom.py). Out: `build_app(...) -> FastAPI` with

    GET  /health                      200 {"status": "ok"}; 503 once the run loop failed or closed
    GET  /v1/models                   the one model, with the request kinds its plan serves
    GET  /v1/models/{model}           that model's card; 404 for another name
    POST /v1/completions              prompt as text or token ids; `stream` as server-sent events
    POST /v1/chat/completions         messages through the tokenizer's chat template
    POST /v1/audio/speech             plans with a text prompt and audio emissions: WAV, or PCM
                                      streamed window by window (`response_format: pcm`), or SSE
    POST /v1/images/generations       plans with a text prompt and image emissions: base64 PNG
    POST /v1/audio/transcriptions     plans with a waveform audio prompt and text emissions: a WAV
                                      file (multipart form) to its transcript (serve/http_transcribe.py)
    POST /tokenize, /detokenize       vLLM's: a prompt (text or messages) to its token ids as a
                                      completion or chat request sends them, and ids to text
    GET  /metrics                     Prometheus text format

Which of them a plan serves comes from its roles (serve/endpoints.py); the others answer 404
with a message naming what the plan serves. Streams carry one event per delta the run loop
delivers (one per step that produced output for the request), then the finish reason and usage,
then `data: [DONE]`. A client that disconnects cancels its request at the next step boundary,
whether it streams (the async generator of `LLM.stream` is closed) or waits for the whole answer
or for its first output (`cancelled_when_gone`); its pages go back to the pool. A text prompt is
tokenized on a worker thread, so a long one does not hold the other clients up. Errors are
OpenAI-style JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad body or
values, 404 for an unknown model or an endpoint the plan does not serve, 429 when the admission
queue is full, 503 while shutting down, 500 for a failure inside the server; never a traceback.
With `Service.cors_origins` (`mstar serve --cors-origin`) the answers carry CORS headers for
those origins, preflight requests included, so a web page there can call the API.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import re
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar.arg_types import shown, shown_error
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.api import LLM, PromptError, SamplingError, SamplingParams
from mstar.runtime.serve.endpoints import endpoints_of, image_size_problem, load_media_encoders
from mstar.runtime.serve.http_schema import (
    CANCELLED_MESSAGE, DEFAULT_COMPLETION_TOKENS, ApiError, ChatBody, CompletionBody, DetokenizeBody, ImageBody,
    SpeechBody, TokenizeBody,
)
from mstar.runtime.serve.online import Closed, Delta, Overloaded
from mstar.runtime.serve.prom import CONTENT_TYPE, ServerMetrics
from mstar.runtime.serve.upload_cut import UploadCut, Uploads
from mstar.runtime.serve import http_stream as sse

DEFAULT_IMAGE_TOKENS = 1024
# The read-only routes answer HEAD as GET without the body (HTTP requires it of a GET route; a load
# balancer's `HEAD /health` was a 405)
READ_METHODS = ["GET", "HEAD"]


class Service:
    """What the handlers share: the LLM, the model name, what the plan serves, the metrics."""

    def __init__(self, llm: LLM, model_name: str, metrics: ServerMetrics, cors_origins: Sequence[str] = ()):
        self.llm = llm
        llm.loop.owner = "the server"  # (its refusals and cut-off requests are the server's to the clients)
        self.model_name = model_name
        self.metrics = metrics
        # browser origins allowed to call the API (`mstar serve --cors-origin`; "*": any); none:
        # no CORS headers, so a page of another origin cannot read an answer
        self.cors_origins = tuple(cors_origins)
        self.endpoints = endpoints_of(llm.plan)
        self.created = int(time.time())
        self.id_tag = secrets.token_hex(6)  # in every response id: unique across restarts (http_stream.response_id)
        # request bodies still arriving, which the drain cuts (serve/upload_cut.py)
        self.uploads = Uploads()

    def default_tokens(self, max_tokens: int) -> int:
        """A max_tokens the client did not give, no more than the plan's walks make (a larger one
        given is refused: serve/plan_checks.py)."""
        most = self.llm.checks.most_tokens
        return max_tokens if most is None else min(max_tokens, most)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"the model {shown(model)} does not exist; this server serves {self.model_name!r}",
                           kind="not_found_error", param="model")

    def check_serves(self, is_served: bool, what: str) -> None:
        if not is_served:
            served = ", ".join(self.endpoints.names()) or "nothing"
            raise ApiError(404, f"the plan of {self.model_name!r} does not serve {what} (it serves: {served})",
                           kind="not_found_error")

    def check_tokenizer(self, needs: str, param: str, instead: str = "") -> None:
        """400 for an endpoint whose prompt is text on a server without a tokenizer, saying what
        works there. The Python API's message offers token ids, which only /v1/completions takes:
        a speech client that followed it got "input: Input should be a valid string". needs: what
        the endpoint needs the tokenizer for; param: the body's field holding the text; instead:
        another way its client has, if any."""
        from mstar.runtime.serve.tokenizer import HOW_TO_ADD

        if self.llm.tokenizer is None:
            raise ApiError(400, f"{needs}, and this server has none: restart it and {HOW_TO_ADD}{instead}",
                           param=param)

    async def request(self, prompt: Any, sampling: SamplingParams, default_to_rest: bool = False,
                      media: Optional[dict[str, Any]] = None, limit_field: Optional[str] = "max_tokens",
                      prompt_field: str = "prompt") -> Request:
        """The runtime request (400 for a bad prompt or values). A text or chat prompt is made on
        a worker thread: a long one takes the tokenizer seconds (about 0.7 s a megabyte), which the
        event loop spends on the other clients; token ids are checked here (the hop costs about
        50 us). default_to_rest: max_tokens is what the plan's max_seq_len leaves after the
        prompt, at most what its walks make. media: by modality; with media the prompt may be empty
        token ids. limit_field: the body's field that gave max_tokens, named in its errors (chat's
        `max_completion_tokens`); None where the body has none (images: the server's own count),
        so a prompt too long for it is refused by the prompt's length (`param: "prompt"`).
        prompt_field: the body's field holding the prompt (chat's `messages`, speech's `input`),
        the `param` of a refusal of the prompt itself."""
        fields = (limit_field, prompt_field)
        if isinstance(prompt, (str, dict)):
            return await asyncio.to_thread(self._request, prompt, sampling, default_to_rest, media, fields)
        return self._request(prompt, sampling, default_to_rest, media, fields)

    def _request(self, prompt: Any, sampling: SamplingParams, default_to_rest: bool,
                 media: Optional[dict[str, Any]], fields: tuple[Optional[str], str]) -> Request:
        limit_field, prompt_field = fields
        try:
            ids = [] if media and prompt == [] else self.llm.prompt_tokens(prompt)
            if default_to_rest:
                room = self.llm.plan.deployment.max_seq_len - len(ids)
                if room < 1:
                    raise PromptError(f"the prompt ({len(ids)} tokens) leaves no room to generate within the "
                                      f"plan's max_seq_len {self.llm.plan.deployment.max_seq_len}")
                sampling.max_tokens = self.default_tokens(room)
            if limit_field is None:
                self._check_prompt_room(len(ids), sampling.max_tokens)
            return self.llm.request(ids, sampling, media)
        except (PromptError, SamplingError) as error:  # each names its field (max_tokens past max_seq_len)
            raise _named_error(error, limit_field or "max_tokens", prompt_field) from None

    def _check_prompt_room(self, num_prompt: int, num_kept: int) -> None:
        """PromptError (`prompt`) for a prompt that leaves fewer than `num_kept` tokens (a count the
        body does not set: the image's) within the plan's max_seq_len: what the client can change
        is the prompt's length (it was told of a `max_tokens (1024)` it never sent)."""
        limit, bound = self.llm.token_limit()
        if num_prompt + num_kept > limit:
            raise PromptError(f"the prompt is {num_prompt} tokens, more than this plan takes: at most "
                              f"{max(0, limit - num_kept)} tokens (its {bound}, less the {num_kept} kept for "
                              "the generation); shorten the prompt", param="prompt")

    async def start(self, request: Request) -> sse.Started:
        """Submit; the stream and its first delta (429 full queue, 503 closing, 400 refused)."""
        return (await self.start_all([request]))[0]

    async def start_all(self, requests: Sequence[Request]) -> list[sse.Started]:
        """Submit every request (all before waiting for any first delta, so n choices share their
        steps); each one's stream and first delta. Where one cannot start (429 full queue, 503
        closing, 400 refused), the others are cancelled and that is the answer. Room for them all
        is reserved first, so a full queue refuses the body before any of it runs."""
        ids = [request.id for request in requests]
        if len(requests) > 1:
            try:
                self.llm.loop.reserve(ids)
            except (Overloaded, Closed) as refused:
                raise self._loop_refusal(refused) from None
        try:
            return await self._start_reserved(requests)
        finally:
            if len(requests) > 1:
                self.llm.loop.unreserve(ids)  # (what a submit did not take: a choice that never started)

    def _loop_refusal(self, refused: Exception) -> ApiError:
        """The answer to a body the run loop cannot take, counted: a full queue's 429 (`Overloaded`),
        a closing or dead loop's 503 (`Closed`: a dead run loop's 503s left /metrics flat)."""
        if isinstance(refused, Overloaded):
            self.metrics.refused("overloaded")
            return ApiError(429, str(refused), kind="rate_limit_error")
        self.metrics.refused("unavailable")
        return ApiError(503, str(refused), kind="server_error")

    async def _start_reserved(self, requests: Sequence[Request]) -> list[sse.Started]:
        streams = [self.llm.stream(request) for request in requests]
        firsts = await _first_deltas(streams)
        started = [(stream, first) for stream, first in zip(streams, firsts) if isinstance(first, Delta)]
        failed = next((first for first in firsts if not isinstance(first, Delta)), None)
        refused = next((first for _, first in started if first.is_final and first.is_refused), None)
        if failed is None and refused is not None:  # the body's answer is the refusal: its other
            for request in requests:                # prompts count `refused` with it, not `cancelled`
                self.llm.loop.cancel_refused(request.id)
        if failed is not None or refused is not None:
            await sse.close_all(started)
        if isinstance(failed, (Overloaded, Closed)):
            raise self._loop_refusal(failed) from None
        if failed is not None:
            raise failed
        if refused is not None:  # the run loop counted it `refused`
            raise ApiError(400, _reason(refused.finish_reason), is_counted=True)
        return started


async def _first_deltas(streams: list[AsyncIterator[Delta]]) -> list[Any]:
    """Each stream's first delta, or the Overloaded or Closed its submission raised. One stream is
    awaited directly (as before several could be: no task for the common request); several
    together, and if the handler is cancelled meanwhile, gather has cancelled each one's wait (its
    request with it) by the time it raises here, and each stream is closed."""
    if len(streams) == 1:
        try:
            return [await streams[0].__anext__()]
        except (Overloaded, Closed) as error:
            return [error]
    try:
        return await asyncio.gather(*(stream.__anext__() for stream in streams), return_exceptions=True)
    except BaseException:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        raise


@asynccontextmanager
async def cancelled_when_gone(service: Service, http: HttpRequest, requests: Sequence[Request]
                              ) -> AsyncIterator[None]:
    """While the block runs (a handler waiting for its requests' first outputs or whole answers),
    a client that disconnects cancels the requests: each ends `cancelled` at the next step boundary
    and frees its pages, where before it ran to its max_tokens for nobody. A streaming response
    watches for the disconnect itself once it has started (Starlette's), so leave the block first."""
    def on_gone(watched: asyncio.Future) -> None:
        if not watched.cancelled():  # gone, or its connection failed (the exception retrieved: no log line)
            watched.exception()
            for request in requests:
                service.llm.loop.cancel(request.id)

    watcher = asyncio.ensure_future(_until_disconnected(http))
    watcher.add_done_callback(on_gone)
    try:
        yield
    finally:
        watcher.cancel()


async def _until_disconnected(http: HttpRequest) -> None:
    """Returns when the client goes: once a handler has its body, the next ASGI message is the
    disconnect (or the end of the response, after the block above has left)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _named_error(error: PromptError | SamplingError, limit_field: str, prompt_field: str) -> ApiError:
    """The 400 of a refused prompt or value. The Python API calls the token limit `max_tokens`; a
    body that gave it by another field (chat's `max_completion_tokens`) gets that field's name, in
    the message and as `param`. A refused prompt names the body's prompt field (`param` was null
    for an empty prompt or a negative token id)."""
    message, param = str(error), error.param
    if param == "max_tokens" and limit_field != "max_tokens":
        message, param = re.sub(r"\bmax_tokens\b", limit_field, message), limit_field
    elif isinstance(error, PromptError) and param in (None, "prompt"):
        param = prompt_field
    return ApiError(400, message, param=param)


def _reason(finish_reason: Optional[str]) -> str:
    reason = finish_reason or "error"
    return reason[len("error: "):] if reason.startswith("error: ") else reason


async def collect_all(started: Sequence[sse.Started]) -> list[list[Delta]]:
    """Every delta of every request, in order; as soon as one fails (`collect`'s errors) the others
    still running are cancelled. One request is collected directly, without a task."""
    if len(started) == 1:
        return [await collect(*started[0])]
    tasks = [asyncio.ensure_future(collect(stream, first)) for stream, first in started]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # a task cancelled inside its stream cancels that request (LLM.stream's finally)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sse.close_all(started)


async def collect(stream: AsyncIterator[Delta], first: Delta) -> list[Delta]:
    """Every delta of a request (non-streaming answers); 400 when it failed on its own input,
    500 / 503 when it failed otherwise."""
    deltas = [first]
    while not deltas[-1].is_final:
        deltas.append(await stream.__anext__())
    reason = deltas[-1].finish_reason or "error"
    if reason.startswith("error") and deltas[-1].is_input_fault:  # the run loop counted it `invalid`
        raise ApiError(400, _reason(reason), is_counted=True)
    if reason.startswith("error"):
        raise ApiError(500, _reason(reason), kind="server_error")
    if reason == "cancelled":
        raise ApiError(503, CANCELLED_MESSAGE, kind="server_error")
    return deltas


def build_app(service: Service) -> FastAPI:
    from mstar.runtime.serve.body_limit import BodyLimit, json_body_limit

    load_media_encoders(service.endpoints)
    app = FastAPI(title="mstar", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=json_body_limit(service.llm.plan.deployment.max_seq_len),
                       on_refused=lambda: service.metrics.refused("invalid"))
    app.add_middleware(UploadCut, uploads=service.uploads)
    if service.cors_origins:  # added last, so outermost: a refusal (413, 429, 500) carries its headers too
        from mstar.runtime.serve.cors import JsonCors

        app.add_middleware(JsonCors, origins=list(service.cors_origins))
    _error_handlers(app, service)
    _info_routes(app, service)
    _unserved_routes(app, service)  # first: a path's first route answers
    _text_routes(app, service)
    _token_routes(app, service)
    _media_routes(app, service)
    from mstar.runtime.serve.http_transcribe import transcription_routes  # it builds on this module

    transcription_routes(app, service)
    return app


def _error_handlers(app: FastAPI, service: Service) -> None:
    @app.exception_handler(ApiError)
    async def api_error(http: HttpRequest, error: ApiError) -> JSONResponse:
        if (error.status != 429 and 400 <= error.status < 500 and not error.is_counted
                and http.url.path in GENERATION_PATHS):
            service.metrics.refused("invalid")
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(http: HttpRequest, error: RequestValidationError) -> JSONResponse:
        if http.url.path in GENERATION_PATHS:
            service.metrics.refused("invalid")
        message, where = _body_problem(error.errors()[0] if error.errors() else {})
        return JSONResponse(ApiError(400, message, param=where).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HttpRequest, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's and FastAPI's own errors (an unknown path or method, a body FastAPI could not
        parse, the body bound's 413, the drain's 503 for a body still arriving) as OpenAI errors, with
        their headers (a 405's `Allow` was dropped). A 400 here is a body FastAPI could not parse:
        named and counted `invalid` as every other bad body (it said "There was an error parsing the
        body" and was not counted)."""
        kind = {404: "not_found_error", 503: "server_error"}.get(error.status_code, "invalid_request_error")
        message = str(error.detail)
        if error.status_code == 503 and http.url.path in GENERATION_PATHS:  # a body the drain cut
            service.metrics.refused("unavailable")
        if error.status_code == 400:
            if http.url.path in GENERATION_PATHS:
                service.metrics.refused("invalid")
            message = _unparsed_body(error.__cause__) or message
        return JSONResponse(ApiError(error.status_code, message, kind=kind).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def internal(_: HttpRequest, error: Exception) -> JSONResponse:
        message = f"internal error ({shown_error(error)})"
        return JSONResponse(ApiError(500, message, kind="server_error").body(), status_code=500)


def _body_problem(first: dict[str, Any]) -> tuple[str, Optional[str]]:
    """(message, the field it is about) for a body FastAPI could not read into the route's model.
    A body that is not JSON, a missing body and one that is not an object (or not sent as JSON) are
    said as such (FastAPI's loc for a JSON error is the character's offset, which read as a field:
    "26: JSON decode error")."""
    kind, msg = first.get("type"), str(first.get("msg", "invalid"))
    if kind == "json_invalid":
        offset = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        at = f" at character {offset}" if offset is not None else ""
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', msg)}{at})", None
    location = tuple(p for p in first.get("loc", ()) if p != "body")
    if kind == "missing" and not location:
        return "the request body is missing: send a JSON object", None
    if kind == "model_attributes_type" and not location:  # FastAPI: "a valid dictionary or object"
        given = first.get("input")
        if isinstance(given, (bytes, bytearray)):  # a content type FastAPI does not parse as JSON (curl's -d)
            return "the request body was not read as JSON: send a JSON object with Content-Type: application/json", None
        what = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(given), "a number")
        return f"the request body must be a JSON object, got {what}", None
    where = ".".join(str(p) for p in location) or None
    msg = msg.removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where


def _unparsed_body(cause: Optional[BaseException]) -> Optional[str]:
    """What a body FastAPI's JSON reading failed on was, where json.loads raised something other
    than the JSONDecodeError `_body_problem` words (FastAPI said "There was an error parsing the
    body" for each); None for anything else."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at position "
                f"{cause.start}): send JSON text in UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to be read"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "the request body holds an integer of more than 4300 digits, which no field takes"
    return None


def _info_routes(app: FastAPI, service: Service) -> None:
    @app.api_route("/health", methods=READ_METHODS)
    async def health() -> JSONResponse:
        loop = service.llm.loop
        if loop.error is not None or loop.is_closed:
            return JSONResponse({"status": "unavailable", "reason": loop.error or "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def card() -> dict[str, Any]:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "mstar",
                "serves": service.endpoints.names(), "max_model_len": service.llm.plan.deployment.max_seq_len}

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card()]})

    # a path: model names such as "meta-llama/Llama-3.2-1B" hold slashes
    @app.api_route("/v1/models/{model:path}", methods=READ_METHODS)
    async def model(model: str) -> JSONResponse:
        service.check_model(model)
        return JSONResponse(card())

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics() -> Response:
        kv_pages = getattr(service.llm.engine, "kv_pages", None)
        text = service.metrics.render(service.llm.loop, kv_pages if callable(kv_pages) else dict)
        return Response(text, media_type=CONTENT_TYPE)


# The routes whose bodies are requests (what `mstar_requests_total` counts): a refused model card,
# /tokenize or /detokenize call is not a request, and counted `invalid` it inflated that share
GENERATION_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat completions",
                    "/v1/audio/speech": "speech", "/v1/images/generations": "image generation",
                    "/v1/audio/transcriptions": "transcription"}


def _unserved_routes(app: FastAPI, service: Service) -> None:
    """An endpoint the plan does not serve answers 404 naming what it serves, whatever its body
    (its route validated the body first: a malformed one got a 400 on a plan that cannot serve it)."""
    endpoints = service.endpoints
    served = {"completions": endpoints.can_text, "chat completions": endpoints.can_text,
              "speech": endpoints.can_speech, "image generation": endpoints.can_images,
              "transcription": endpoints.can_transcribe}
    for path, what in GENERATION_PATHS.items():
        if not served[what]:
            app.add_api_route(path, _unserved_handler(service, what), methods=["POST"])


def _unserved_handler(service: Service, what: str) -> Any:
    async def unserved() -> Response:
        service.check_serves(False, what)
        raise AssertionError("check_serves raises for an endpoint not served")

    return unserved


def _text_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest) -> Response:
        service.check_model(body.model)
        service.check_serves(service.endpoints.can_text, "completions")
        tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        # echo with max_tokens 0 answers the prompt alone (vLLM's): its request samples one token,
        # which the answer leaves out (sse.as_answered); a prompt with no room for it is refused by
        # its length (it was told of a `max_tokens (1)` it never sent)
        is_echo_only = body.echo and tokens == 0
        options: dict[str, Any] = {"limit_field": None} if is_echo_only else {}
        choices: list[sse.Choice] = []
        for prompt_index, prompt in enumerate(body.prompt_values()):
            made = await _choices(service, body, prompt, prompt_index, 1 if is_echo_only else tokens, **options)
            if body.echo:  # each choice's text after its prompt's: as sent, token ids decoded
                echo = prompt if isinstance(prompt, str) else _prompt_text(service, made[0].request)
                made = [dataclasses.replace(choice, echo=echo, is_echo_only=is_echo_only) for choice in made]
            choices += made
        return await _text_answer(service, http, choices, body.stream,
                                  lambda started: sse.completion_events(service, choices, body, started),
                                  lambda answers: sse.completion_body(service, choices, answers))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest) -> Response:
        service.check_model(body.model)
        service.check_serves(service.endpoints.can_text, "chat completions")
        limit = body.token_limit()
        prompt = body.prompt_value()
        service.check_tokenizer("chat messages need a tokenizer with a chat template", "messages",
                                "; or send the prompt as token ids to /v1/completions")
        choices = await _choices(service, body, prompt, 0, 1 if limit is None else limit,
                                 default_to_rest=limit is None, limit_field=body.token_limit_field(),
                                 prompt_field="messages")
        return await _text_answer(service, http, choices, body.stream,
                                  lambda started: sse.chat_events(service, choices, body, started),
                                  lambda answers: sse.chat_body(service, choices, answers))


async def _choices(service: Service, body: Any, prompt: Any, prompt_index: int, tokens: int,
                   **options: Any) -> list[sse.Choice]:
    """The body's n requests for one prompt (400 for a bad prompt or values): the first made from
    the prompt as sent (text is tokenized once, on a worker thread), the others from its ids."""
    first = await service.request(prompt, body.sampling(tokens), **options)
    requests = [first] + [await service.request(list(first.prompt_tokens), body.sampling(tokens, choice), **options)
                          for choice in range(1, body.num_choices)]
    return [sse.Choice(request, prompt_index) for request in requests]


def _prompt_text(service: Service, request: Any) -> str:
    """A completion's prompt as text for `echo`: its ids decoded ('' without a tokenizer, as every
    text of that server is: the ids are in `token_ids` then)."""
    tokenizer = service.llm.tokenizer
    return tokenizer.decode(request.prompt_tokens) if tokenizer is not None else ""


async def _text_answer(service: Service, http: HttpRequest, choices: list[sse.Choice], is_stream: bool,
                       events: Callable[[list[sse.Started]], AsyncIterator[str]],
                       answer: Callable[[list[list[Delta]]], dict[str, Any]]) -> Response:
    """A text answer of one or more choices: their events streamed, or the body of all their deltas."""
    requests = [choice.request for choice in choices]
    async with cancelled_when_gone(service, http, requests):
        started = await service.start_all(requests)
        if is_stream:
            return sse.response(events(started))
        answers = await collect_all(started)
    return JSONResponse(answer(answers))


def _token_routes(app: FastAPI, service: Service) -> None:
    """vLLM's /tokenize and /detokenize, with the server's tokenizer: a prompt's token ids as a
    completion or chat request would send them (the plan's prompt format and chat template
    included), and ids back to text. 400 without a tokenizer; ids outside the plan's vocabulary
    are a 400 too."""
    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> JSONResponse:
        service.check_model(body.model)
        service.check_tokenizer("/tokenize needs a tokenizer", "prompt")
        form = service.llm.prompt_format
        prompt = body.prompt_value(form.fields if form is not None else [])
        try:
            ids = await asyncio.to_thread(service.llm.prompt_tokens, prompt)
        except PromptError as error:
            raise ApiError(400, str(error), param=error.param or "prompt") from None
        return JSONResponse({"count": len(ids), "max_model_len": service.llm.plan.deployment.max_seq_len,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> JSONResponse:
        service.check_model(body.model)
        service.check_tokenizer("/detokenize needs a tokenizer", "tokens")
        outside = service.llm.checks.prompt_problem(body.tokens)
        if outside is not None:
            raise ApiError(400, outside, param="tokens")
        return JSONResponse({"prompt": service.llm.tokenizer.decode(body.tokens)})


def _media_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/audio/speech")
    async def speech(body: SpeechBody, http: HttpRequest) -> Response:
        service.check_model(body.model)
        service.check_serves(service.endpoints.can_speech, "speech")
        body.checks()
        service.check_tokenizer("speech takes its input as text (not token ids), which needs a tokenizer",
                                "input")
        sampling = body.sampling()
        if "max_tokens" not in body.model_fields_set:
            sampling.max_tokens = service.default_tokens(sampling.max_tokens)
        form = service.llm.prompt_format
        request = await service.request(body.prompt(form.fields if form is not None else []), sampling,
                                        prompt_field="input")
        async with cancelled_when_gone(service, http, [request]):
            stream, first = await service.start(request)
            if body.stream_format == "sse":
                return sse.response(sse.speech_events(request, stream, first))
            if body.response_format == "pcm":
                if first.is_final:  # nothing streamed yet: a failure is still a JSON error
                    await collect(stream, first)
                return sse.pcm_response(request, stream, first)
            deltas = await collect(stream, first)
        from mstar.runtime.serve.media import wav_bytes
        from mstar.runtime.serve.results import sample_rate_of

        chunks = [value for d in deltas for modality, value in d.media if modality == "audio"]
        data, _ = wav_bytes(chunks, sample_rate_of(service.llm.plan))
        return Response(data, media_type="audio/wav")

    @app.post("/v1/images/generations")
    async def images(body: ImageBody, http: HttpRequest) -> JSONResponse:
        service.check_model(body.model)
        service.check_serves(service.endpoints.can_images, "image generation")
        body.checks()
        size_problem = image_size_problem(body.size, service.endpoints, service.llm.engine.caps.image_sizes)
        if size_problem:
            raise ApiError(400, size_problem, param="size")
        service.check_tokenizer("image generation takes its prompt as text (not token ids), which needs a "
                                "tokenizer", "prompt")
        sampling = SamplingParams(max_tokens=service.default_tokens(DEFAULT_IMAGE_TOKENS), seed=body.seed,
                                  route=dict(service.endpoints.image_route))
        request = await service.request(body.prompt, sampling, limit_field=None)
        async with cancelled_when_gone(service, http, [request]):
            stream, first = await service.start(request)
            deltas = await collect(stream, first)
        from mstar.runtime.serve.media import png_bytes

        images = [png_bytes(value)[0] for d in deltas for modality, value in d.media if modality == "image"]
        data = [{"b64_json": base64.b64encode(png).decode("ascii")} for png in images]
        return JSONResponse({"created": int(time.time()), "data": data})
