"""Request bodies a draining server stops waiting for.

In: the ASGI app and an `Uploads` (the server's: `Service.uploads`), which `mstar serve`'s drain
cuts when it cancels the requests in flight (serve/server.py: half a second before
`--drain-timeout`, or at a second signal). Out: `UploadCut`, ASGI middleware: while a request's
body is still arriving, its read waits on the body or the cut, whichever comes first; once cut, the
read raises `UploadCutError`, a 503 the app answers as an OpenAI error (`server_error`, counted
`unavailable` on a generation route), and the connection closes. Before, a client whose upload was
still arriving at the drain's end (a slow transcription upload, a stalled body) held the shutdown
until uvicorn's own timeout cancelled its handler: a plain-text 500 and a CancelledError traceback
in the log, and the process exited a few seconds later than the drain says. Once a body has
arrived its reads pass straight through (a handler's watch for the client's disconnect).
"""
from __future__ import annotations

import asyncio
from typing import Any

from starlette.exceptions import HTTPException

CUT_MESSAGE = "the server is shutting down: it stopped before the request body arrived"


class UploadCutError(HTTPException):
    """A body cut by the drain: 503, raised from the request's read."""

    def __init__(self) -> None:
        super().__init__(503, CUT_MESSAGE)


class Uploads:
    """The bodies still arriving; `cut()` ends their reads (any thread, a signal handler too)."""

    def __init__(self) -> None:
        self.is_cut = False
        self._waiters: set[asyncio.Future] = set()

    def cut(self) -> None:
        self.is_cut = True
        for waiter in list(self._waiters):
            waiter.get_loop().call_soon_threadsafe(_settle, waiter)

    async def first(self, receive: Any) -> Any:
        """receive()'s message, or UploadCutError once cut, whichever comes first."""
        if self.is_cut:
            raise UploadCutError()
        waiter = asyncio.get_running_loop().create_future()
        message = asyncio.ensure_future(receive())
        self._waiters.add(waiter)
        try:
            await asyncio.wait((message, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.discard(waiter)
            if not message.done():
                message.cancel()
        if message.done() and not message.cancelled():
            return message.result()
        raise UploadCutError()


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class UploadCut:
    def __init__(self, app: Any, uploads: Uploads):
        self.app, self.uploads = app, uploads

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_body_done = False

        async def body_or_cut() -> Any:
            nonlocal is_body_done
            if is_body_done:
                return await receive()
            message = await self.uploads.first(receive)
            is_body_done = message.get("type") != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, body_or_cut, send)
