"""`POST /v1/audio/transcriptions`: a WAV file in, its transcript out (OpenAI's endpoint).

In: the service (serve/http_app.py: the LLM, what the plan serves) and a multipart form
(serve/transcription.py reads and checks it). Out: `{"text": ..., "usage": {"type": "duration",
"seconds": ...}}` for `response_format` json, the bare text for `text`, or with `stream` true
server-sent events: `{"type": "transcript.text.delta", "delta": ...}` per delta with text as the
decoder makes it, then `{"type": "transcript.text.done", "text": ..., "usage": {...tokens}}`.

Served for plans whose audio prompt takes a waveform and that emit text (serve/endpoints.py); the
request is the one `mstar run --prompts` makes of a line with `audio` (the samples as the
request's audio media, an empty decoder prompt or a language's start sequence; on a plan whose
prompt holds audio placeholders, the prompt format's frame with one placeholder per audio state),
submitted to the online loop as every other endpoint's. `max_tokens` (extension) defaults to what the plan's
max_seq_len leaves after the decoder prompt; `temperature` absent or 0 is greedy.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mstar.runtime.serve import http_stream as sse
from mstar.runtime.serve.api import PromptError, SamplingParams
from mstar.runtime.serve.audio_input import audio_input_of
from mstar.runtime.serve.http_app import Service, cancelled_when_gone, collect
from mstar.runtime.serve.http_schema import ApiError
from mstar.runtime.serve.transcription import read_form, samples, start_sequence


def transcription_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/audio/transcriptions")
    async def transcriptions(http: HttpRequest) -> Response:
        form = await read_form(http)
        service.check_model(form.model)
        service.check_serves(service.endpoints.can_transcribe, "transcription")
        llm = service.llm
        if llm.tokenizer is None:
            from mstar.runtime.serve.tokenizer import HOW_TO_ADD

            raise ApiError(400, f"a transcript is text, and this server has no tokenizer: {HOW_TO_ADD}")
        audio_input = audio_input_of(llm.plan)
        if audio_input is None:  # can_transcribe says there is one
            raise ApiError(404, "this model takes no audio waveform", kind="not_found_error")
        audio = await asyncio.to_thread(samples, form, audio_input)
        seconds = round(int(audio.shape[0]) / audio_input.sample_rate, 3)
        prompt = start_sequence(llm.plan, llm.tokenizer, form.language)
        if llm.audio_layout is not None:  # the prompt around one placeholder per audio state
            try:
                ids = llm.prompt_tokens(prompt) if isinstance(prompt, str) else prompt
                prompt = llm.laid_out_audio(ids, int(audio.shape[0]))
            except PromptError as error:
                raise ApiError(400, str(error)) from None
        max_tokens = form.max_tokens
        if max_tokens is None:  # what the decoder's sequence holds, once per window the clip spans
            num_windows = -(-int(audio.shape[0]) // audio_input.window_samples)
            max_tokens = service.default_tokens(max(1, llm.plan.deployment.max_seq_len * num_windows - len(prompt)))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=form.temperature, seed=form.seed)
        request = await service.request(prompt, sampling, media={"audio": audio})
        async with cancelled_when_gone(service, http, [request]):
            stream, first = await service.start(request)
            if form.is_stream:
                return sse.response(sse.transcript_events(request, stream, first))
            deltas = await collect(stream, first)
        text = "".join(d.text for d in deltas)
        if form.response_format == "text":
            return PlainTextResponse(text)
        return JSONResponse({"text": text, "usage": {"type": "duration", "seconds": seconds}})

