"""Response bodies of the OpenAI-style endpoints: whole JSON answers and server-sent events.

In: the service (model name), the runtime `Request`, the request body, and the request's deltas
(serve/online.py `Delta`: new token ids, text, media, the finish reason on the last). Out:

    completion_body / chat_body            the non-streaming JSON answers
    completion_events / chat_events        SSE: `data: {chunk}` per delta, a last chunk with
                                           the finish reason and `usage`, then `data: [DONE]`
    speech_events                          SSE: `speech.audio.delta` (base64 16-bit PCM) per delta
                                           with audio, then `speech.audio.done` with usage
    pcm_response                           raw 16-bit PCM bytes, one chunk per codec window; a
                                           request that fails or is cancelled after its first bytes
                                           cuts the response (no last chunk), as raw audio has no
                                           way to say so in its bytes
    transcript_events                      SSE: `transcript.text.delta` per delta with text, then
                                           `transcript.text.done` with the whole text and usage
    response(events)                       a StreamingResponse of text/event-stream

Every choice also carries `token_ids`: the delta's token ids (an extension; without a
tokenizer the text is empty and the ids are the output). A request that fails mid-stream ends
with an `{"error": {...}}` event before `[DONE]`. `stream_options.include_usage` adds OpenAI's
separate usage chunk (empty `choices`); the last chunk with a finish reason has usage either way.
"""
from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any, AsyncIterator, Optional

from fastapi.responses import StreamingResponse

from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.http_schema import CANCELLED_MESSAGE
from mstar.runtime.serve.online import Delta

FINISH_REASONS = {"stop": "stop", "length": "length"}
log = logging.getLogger(__name__)


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def usage(request: Request, last: Delta) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix
    cache held (0 without a hit, or without a cache)."""
    prompt = len(request.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": last.num_output_tokens,
            "total_tokens": prompt + last.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def finish_reason(delta: Delta) -> Optional[str]:
    if delta.finish_reason is None:
        return None
    return FINISH_REASONS.get(delta.finish_reason, delta.finish_reason)


def _error_event(delta: Delta) -> str:
    """The stream's last event for a failed request: an invalid_request_error when its own input
    failed it (the 400 a non-streaming request gets), else a server_error."""
    reason = delta.finish_reason or "error"
    message = reason[len("error: "):] if reason.startswith("error: ") else reason
    if reason == "cancelled":  # a stream's client is there to read it: only the server cancels it
        message = CANCELLED_MESSAGE
    kind = "invalid_request_error" if delta.is_input_fault else "server_error"
    return f"data: {dumps({'error': {'message': message, 'type': kind, 'param': None, 'code': None}})}\n\n"


def _is_failed(delta: Delta) -> bool:
    return delta.finish_reason is not None and delta.finish_reason.startswith(("error", "cancelled"))


async def _deltas(stream: AsyncIterator[Delta], first: Delta) -> AsyncIterator[Delta]:
    yield first
    delta = first
    while not delta.is_final:
        delta = await stream.__anext__()
        yield delta


# ---------------------------------------------------------------- completions


def completion_body(service: Any, request: Request, deltas: list[Delta]) -> dict[str, Any]:
    last = deltas[-1]
    choice = {"index": 0, "text": "".join(d.text for d in deltas), "logprobs": None,
              "finish_reason": finish_reason(last), "token_ids": [t for d in deltas for t in d.token_ids]}
    return {"id": f"cmpl-{request.id}", "object": "text_completion", "created": int(time.time()),
            "model": service.model_name, "choices": [choice], "usage": usage(request, last)}


async def completion_events(service: Any, request: Request, body: Any, stream: AsyncIterator[Delta],
                            first: Delta) -> AsyncIterator[str]:
    head = {"id": f"cmpl-{request.id}", "object": "text_completion", "created": int(time.time()),
            "model": service.model_name}
    async for delta in _deltas(stream, first):
        if _is_failed(delta):
            yield _error_event(delta)
            break
        choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": finish_reason(delta),
                  "token_ids": delta.token_ids}
        chunk: dict[str, Any] = {**head, "choices": [choice]}
        if delta.is_final:
            chunk["usage"] = usage(request, delta)
        yield f"data: {dumps(chunk)}\n\n"
        if delta.is_final and body.include_usage:
            yield f"data: {dumps({**head, 'choices': [], 'usage': usage(request, delta)})}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- chat


def chat_body(service: Any, request: Request, deltas: list[Delta]) -> dict[str, Any]:
    last = deltas[-1]
    message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(last),
              "token_ids": [t for d in deltas for t in d.token_ids]}
    return {"id": f"chatcmpl-{request.id}", "object": "chat.completion", "created": int(time.time()),
            "model": service.model_name, "choices": [choice], "usage": usage(request, last)}


async def chat_events(service: Any, request: Request, body: Any, stream: AsyncIterator[Delta],
                      first: Delta) -> AsyncIterator[str]:
    head = {"id": f"chatcmpl-{request.id}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": service.model_name}
    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    yield f"data: {dumps({**head, 'choices': [opening]})}\n\n"
    async for delta in _deltas(stream, first):
        if _is_failed(delta):
            yield _error_event(delta)
            break
        content = {"content": delta.text} if delta.text or not delta.is_final else {}
        choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason(delta),
                  "token_ids": delta.token_ids}
        chunk: dict[str, Any] = {**head, "choices": [choice]}
        if delta.is_final:
            chunk["usage"] = usage(request, delta)
        yield f"data: {dumps(chunk)}\n\n"
        if delta.is_final and body.include_usage:
            yield f"data: {dumps({**head, 'choices': [], 'usage': usage(request, delta)})}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- speech


def pcm(value: Any) -> bytes:
    """An audio emission as little-endian 16-bit PCM bytes."""
    from mstar.runtime.serve.media import pcm_bytes

    return pcm_bytes(value)


class _Cut(Exception):
    """A raw stream's request failed or was cancelled after its first bytes went out."""


class _PcmResponse(StreamingResponse):
    """Raw PCM, whose bytes cannot say that the request failed: on `_Cut` the response ends without
    its last chunk and uvicorn closes the connection, which a client reads as an incomplete body
    (httpx: RemoteProtocolError) instead of complete, shorter audio (the stream ended as if done)."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        except _Cut as cut:
            log.warning("%s; its PCM stream is cut short (the client sees an incomplete body)", cut)


def pcm_response(request: Request, stream: AsyncIterator[Delta], first: Delta) -> StreamingResponse:
    return _PcmResponse(_pcm_chunks(request, stream, first), media_type="audio/pcm")


async def _pcm_chunks(request: Request, stream: AsyncIterator[Delta], first: Delta) -> AsyncIterator[bytes]:
    async for delta in _deltas(stream, first):
        for modality, value in delta.media:
            if modality == "audio":
                yield pcm(value)
        if _is_failed(delta):
            raise _Cut(f"request {request.id} ended {delta.finish_reason!r} mid-stream")


async def speech_events(request: Request, stream: AsyncIterator[Delta], first: Delta) -> AsyncIterator[str]:
    async for delta in _deltas(stream, first):
        if _is_failed(delta):
            yield _error_event(delta)
            return
        for modality, value in delta.media:
            if modality == "audio":
                audio = base64.b64encode(pcm(value)).decode("ascii")
                yield f"data: {dumps({'type': 'speech.audio.delta', 'audio': audio})}\n\n"
        if delta.is_final:
            done = {"type": "speech.audio.done", "usage": {"input_tokens": len(request.prompt_tokens),
                                                          "output_tokens": delta.num_output_tokens,
                                                          "total_tokens": len(request.prompt_tokens)
                                                          + delta.num_output_tokens}}
            yield f"data: {dumps(done)}\n\n"


# ---------------------------------------------------------------- transcription


async def transcript_events(request: Request, stream: AsyncIterator[Delta], first: Delta) -> AsyncIterator[str]:
    texts: list[str] = []
    async for delta in _deltas(stream, first):
        if _is_failed(delta):
            yield _error_event(delta)
            return
        if delta.text:
            texts.append(delta.text)
            yield f"data: {dumps({'type': 'transcript.text.delta', 'delta': delta.text})}\n\n"
        if delta.is_final:
            prompt = len(request.prompt_tokens)
            usage = {"type": "tokens", "input_tokens": prompt, "output_tokens": delta.num_output_tokens,
                     "total_tokens": prompt + delta.num_output_tokens}
            yield f"data: {dumps({'type': 'transcript.text.done', 'text': ''.join(texts), 'usage': usage})}\n\n"
