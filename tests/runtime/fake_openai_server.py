"""A tiny OpenAI-compatible streaming server with known delays, for `mstar bench serve`'s tests.

It serves GET /v1/models, POST /v1/completions and POST /v1/chat/completions (streaming only) on
127.0.0.1 from a thread with its own event loop. Each request's first output event is sent
`ttft_s` after the request arrives and the next ones `itl_s` apart (scheduled from the arrival,
so delays do not accumulate), `max_tokens` events in all, then a finish chunk, a usage chunk
(unless `send_usage` is off) and `data: [DONE]`. A chat stream starts with a role-only delta at
once (not an output event). With `is_ids_only` every event carries empty text and one id in
`token_ids` (as mstar serve streams without a tokenizer). A prompt holding FAIL gets HTTP 500
with an OpenAI error body; one holding CUT stops after two events without [DONE]. Every
request is recorded (arrival time, path, body), and the largest number of streams open at once
is kept.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

MODEL = "fake-model"


class FakeServer:
    def __init__(self, ttft_s: float, itl_s: float, send_usage: bool = True, is_ids_only: bool = False):
        self.ttft_s, self.itl_s, self.send_usage, self.is_ids_only = ttft_s, itl_s, send_usage, is_ids_only
        self.received: list[tuple[float, str, dict]] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> "FakeServer":
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        self.received.append((arrived, request.path, body))
        is_chat = request.path.endswith("/chat/completions")
        prompt = json.dumps(body.get("messages") if is_chat else body.get("prompt"))
        if body.get("model") != MODEL:
            return web.json_response({"error": {"message": f"model {body.get('model')!r} not found",
                                                "type": "invalid_request_error"}}, status=404)
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await self._stream(response, body, is_chat, arrived, is_cut="CUT" in prompt)
        finally:
            self.num_in_flight -= 1
        return response

    async def _stream(self, response: web.StreamResponse, body: dict, is_chat: bool, arrived: float,
                      is_cut: bool) -> None:
        async def send(obj) -> None:
            await response.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        def choice(text: str, finish=None) -> dict:
            if is_chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if is_chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        num_tokens = body["max_tokens"]
        for index in range(num_tokens):
            await asyncio.sleep(max(0.0, arrived + self.ttft_s + index * self.itl_s - time.perf_counter()))
            if self.is_ids_only:  # mstar serve without a tokenizer: no text, the ids are the output
                await send({"choices": [{**choice(""), "token_ids": [index]}]})
            else:
                await send({"choices": [choice(f" t{index}")]})
            if is_cut and index == 1:
                return
        await send({"choices": [choice("", "length")]})
        if self.send_usage:
            prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 7
            await send({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                                                 "total_tokens": prompt_tokens + num_tokens}})
        await send("[DONE]")
