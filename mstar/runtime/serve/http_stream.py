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

A text answer has one choice per request (`Choice`: OpenAI's `n`, and a completion's list of
prompts, n choices a prompt in prompt order); a stream interleaves the choices' deltas as they
come (`merged`), each chunk naming its choice's `index`. Every choice also carries `token_ids`:
the delta's token ids (an extension; without a tokenizer the text is empty and the ids are the
output). A request that fails mid-stream ends the stream with an `{"error": {...}}` event before
`[DONE]`, and the other choices' requests are cancelled. A choice whose request asked for
log-probabilities carries them in `logprobs`, per chunk for the chunk's tokens
(serve/logprobs_format.py); null otherwise. The usage goes on the last chunk with a finish
reason, or with `stream_options.include_usage` on OpenAI's separate usage chunk (empty `choices`)
alone. Usage counts each prompt's tokens once (and its first choice's cached tokens), every
choice's output tokens.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Optional, Sequence, Union

from fastapi.responses import StreamingResponse

from mstar.runtime.conductor.request import Request
from mstar.runtime.conductor.text_context import prompt_context
from mstar.runtime.serve.http_schema import CANCELLED_MESSAGE
from mstar.runtime.serve.logprobs_format import Offsets, chat_logprobs, completion_logprobs
from mstar.runtime.serve.online import Delta

FINISH_REASONS = {"stop": "stop", "length": "length"}
log = logging.getLogger(__name__)


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass(frozen=True)
class Choice:
    """One request of a text answer (its `index` is its place in the answer's list of choices) and
    its prompt's place among the body's prompts (usage counts a prompt's tokens once, whatever its
    n); `echo`: the text a completion's `echo` puts before the choice's own (its prompt's)."""
    request: Request
    prompt_index: int = 0
    echo: str = ""
    # a completion's `echo` with `max_tokens: 0` (what prompt-scoring clients send): its request
    # samples one token, as every request samples one, and the answer leaves it out (`as_answered`)
    is_echo_only: bool = False


Started = tuple[AsyncIterator[Delta], Delta]  # a submitted request's stream and its first delta


def usage(choices: Sequence[Choice], finals: Sequence[Delta]) -> dict[str, Any]:
    """OpenAI's usage object over the choices (their last deltas, in choice order);
    `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache held (0 without a
    hit, or without a cache), a prompt's first choice's."""
    firsts: dict[int, tuple[Choice, Delta]] = {}
    for choice, final in zip(choices, finals):
        firsts.setdefault(choice.prompt_index, (choice, final))
    prompt = sum(len(choice.request.prompt_tokens) for choice, _ in firsts.values())
    cached = sum(final.num_cached_tokens for _, final in firsts.values())
    completion = sum(final.num_output_tokens for final in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def as_answered(choice: Choice, delta: Delta) -> Delta:
    """The delta as the choice's answer shows it: an echo-only choice's without its sampled token
    (no ids, text or log-probabilities, none counted; its prompt's log-probabilities kept), and
    ended `length` where that hidden token ended it `stop` (a stop token or string: its max_tokens
    of 0 is what ended the answer, as vLLM says)."""
    if not choice.is_echo_only:
        return delta
    reason = "length" if delta.finish_reason == "stop" else delta.finish_reason
    return dataclasses.replace(delta, token_ids=[], text="", logprobs=None if delta.logprobs is None else [],
                               num_output_tokens=0, finish_reason=reason)


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


async def close_all(started: Sequence[Started]) -> None:
    """Close every request's stream: one still running is cancelled (its pages go back), one that
    ended is left as it is."""
    for stream, _ in started:
        await stream.aclose()  # type: ignore[attr-defined]


async def merged(started: Sequence[Started]) -> AsyncGenerator[tuple[int, Delta], None]:
    """(choice index, delta) of every choice as the deltas come, until each choice's last; on
    leaving early (a failed choice, a client gone) the choices still running are cancelled. One
    choice is read directly, without a task."""
    if len(started) == 1:
        try:
            async for delta in _deltas(*started[0]):
                yield 0, delta
        finally:
            await close_all(started)
        return
    queue: asyncio.Queue[tuple[int, Union[Delta, BaseException]]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta], first: Delta) -> None:
        try:
            async for delta in _deltas(stream, first):
                queue.put_nowait((index, delta))
        except Exception as error:  # handed to the reader, which raises it
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(index, *pair)) for index, pair in enumerate(started)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= 1 if item.is_final else 0
            yield index, item
    finally:  # a pump cancelled inside its stream cancels that request (LLM.stream's finally)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(started)


# ---------------------------------------------------------------- completions


def response_id(service: Any, kind: str, choices: Sequence[Choice]) -> str:
    """A response's id: the server's own tag (random, drawn when it started) and its first choice's
    request id. Request ids count from req-0 in every process, so without the tag a restarted server
    answered `cmpl-req-0` again, where OpenAI's ids are unique; the request id stays in it, the one
    the server's logs name."""
    return f"{kind}-{service.id_tag}-{choices[0].request.id}"


def completion_body(service: Any, choices: Sequence[Choice], answers: Sequence[list[Delta]]) -> dict[str, Any]:
    tokenizer = _tokenizer(service, choices)
    answers = [[as_answered(choice, delta) for delta in deltas] for choice, deltas in zip(choices, answers)]
    bodies = []
    for index, deltas in enumerate(answers):
        token_ids = [t for d in deltas for t in d.token_ids]
        echoed, logprobs = _with_prompt(choices[index], deltas[0], _joined_logprobs(choices[index], deltas))
        bodies.append({"index": index, "text": choices[index].echo + "".join(d.text for d in deltas),
                       "logprobs": completion_logprobs(tokenizer, echoed + token_ids, logprobs,
                                                       _offsets(choices[index], echoed)),
                       "finish_reason": finish_reason(deltas[-1]), "token_ids": token_ids})
    return {"id": response_id(service, "cmpl", choices), "object": "text_completion", "created": int(time.time()),
            "model": service.model_name, "choices": bodies, "usage": usage(choices, [a[-1] for a in answers])}


async def completion_events(service: Any, choices: Sequence[Choice], body: Any,
                            started: Sequence[Started]) -> AsyncIterator[str]:
    head = {"id": response_id(service, "cmpl", choices), "object": "text_completion", "created": int(time.time()),
            "model": service.model_name}

    tokenizer = _tokenizer(service, choices)
    offsets = [_offsets(c, []) for c in choices]
    echoes = [c.echo for c in choices]  # each sent once, before its choice's first text

    def choice(index: int, delta: Delta) -> dict[str, Any]:
        echoed, entries = _with_prompt(choices[index], delta, _delta_logprobs(choices[index], delta))
        if echoed:  # (the choice's first delta: its tokens start with the prompt's)
            offsets[index] = _offsets(choices[index], echoed)
        logprobs = completion_logprobs(tokenizer, echoed + delta.token_ids, entries, offsets[index])
        text, echoes[index] = echoes[index] + delta.text, ""
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(delta),
                "token_ids": delta.token_ids}

    async for event in _choice_events(head, choices, body, started, choice):
        yield event


# ---------------------------------------------------------------- chat


def chat_body(service: Any, choices: Sequence[Choice], answers: Sequence[list[Delta]]) -> dict[str, Any]:
    tokenizer = _tokenizer(service, choices)
    bodies = []
    for index, deltas in enumerate(answers):
        token_ids = [t for d in deltas for t in d.token_ids]
        bodies.append({"index": index, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                       "logprobs": chat_logprobs(tokenizer, token_ids, _joined_logprobs(choices[index], deltas),
                                                 _offsets(choices[index], [])),
                       "finish_reason": finish_reason(deltas[-1]), "token_ids": token_ids})
    return {"id": response_id(service, "chatcmpl", choices), "object": "chat.completion", "created": int(time.time()),
            "model": service.model_name, "choices": bodies, "usage": usage(choices, [a[-1] for a in answers])}


async def chat_events(service: Any, choices: Sequence[Choice], body: Any,
                      started: Sequence[Started]) -> AsyncIterator[str]:
    head = {"id": response_id(service, "chatcmpl", choices), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": service.model_name}
    openings = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for index in range(len(choices))]
    yield f"data: {dumps({**head, 'choices': openings})}\n\n"

    tokenizer = _tokenizer(service, choices)
    offsets = [_offsets(c, []) for c in choices]

    def choice(index: int, delta: Delta) -> dict[str, Any]:
        content = {"content": delta.text} if delta.text or not delta.is_final else {}
        logprobs = chat_logprobs(tokenizer, delta.token_ids, _delta_logprobs(choices[index], delta), offsets[index])
        return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason(delta),
                "token_ids": delta.token_ids}

    async for event in _choice_events(head, choices, body, started, choice):
        yield event


def _tokenizer(service: Any, choices: Sequence[Choice]) -> Any:
    """The tokenizer that names the choices' tokens, where one asked for log-probabilities."""
    return service.llm.tokenizer if any(choice.request.logprobs is not None for choice in choices) else None


def _delta_logprobs(choice: Choice, delta: Delta) -> Optional[list[Any]]:
    """The delta's TokenLogprobs, one a token (an empty list for a delta without any, such as a
    refused request's); None when its request asked for none."""
    if choice.request.logprobs is None:
        return None
    return delta.logprobs if delta.logprobs is not None else [None] * len(delta.token_ids)


def _offsets(choice: Choice, echoed: list[int]) -> Offsets:
    """Where a choice's token names start: after its prompt's last tokens, or at the text's start
    where its tokens begin with the echoed prompt's (logprobs_format.py)."""
    return Offsets([] if echoed else prompt_context(choice.request.prompt_tokens))


def _with_prompt(choice: Choice, delta: Delta, logprobs: Optional[list[Any]]
                 ) -> tuple[list[int], Optional[list[Any]]]:
    """The prompt's token ids and log-probabilities to put before the choice's own, on the delta
    that carries them (its first, where `echo` asked for them: Delta.prompt_logprobs); else no ids
    and `logprobs` as they are."""
    found = delta.prompt_logprobs
    if found is None or logprobs is None:
        return [], logprobs
    return list(choice.request.prompt_tokens), found + logprobs


def _joined_logprobs(choice: Choice, deltas: Sequence[Delta]) -> Optional[list[Any]]:
    if choice.request.logprobs is None:
        return None
    return [entry for delta in deltas for entry in _delta_logprobs(choice, delta) or []]


async def _choice_events(head: dict[str, Any], choices: Sequence[Choice], body: Any, started: Sequence[Started],
                         choice: Any) -> AsyncIterator[str]:
    """A chunk per delta of any choice (`choice(index, delta)` its entry), the usage of them all on
    the chunk that ends the last choice, or with `include_usage` in its own chunk after it alone (on
    both, a client that adds up usage chunk by chunk counted the request twice; OpenAI's other
    chunks carry none), then [DONE]; a failed choice's error event ends the stream."""
    finals: dict[int, Delta] = {}
    async with contextlib.aclosing(merged(started)) as deltas:  # leaving cancels the choices still running
        async for position, delta in deltas:
            delta = as_answered(choices[position], delta)
            if _is_failed(delta):
                yield _error_event(delta)
                break
            chunk: dict[str, Any] = {**head, "choices": [choice(position, delta)]}
            if delta.is_final:
                finals[position] = delta
            is_last = len(finals) == len(choices) and delta.is_final
            totals = usage(choices, [finals[p] for p in range(len(choices))]) if is_last else None
            if totals is not None and not body.include_usage:
                chunk["usage"] = totals
            yield f"data: {dumps(chunk)}\n\n"
            if totals is not None and body.include_usage:
                yield f"data: {dumps({**head, 'choices': [], 'usage': totals})}\n\n"
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
