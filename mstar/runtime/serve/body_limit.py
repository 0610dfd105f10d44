"""A bound on the size of a request body other than a transcription upload (a JSON request).

In: the ASGI app, the bound (`json_body_limit` of the plan's max_seq_len) and what to call on
each refusal (the server counts it `invalid`, as every other 4xx; it was not counted). Out:
`BodyLimit`, ASGI middleware: a body whose Content-Length is past the bound is answered 413 before
it is read; one sent in chunks without a length is counted as it arrives and refused (413) once
past it. A
multipart body sent to the transcription route passes: that route bounds the audio itself
(transcription.py, MAX_AUDIO_BYTES); one sent to any other route is bounded like JSON (before,
any multipart Content-Type passed everywhere, and a 400 MB body was read whole to be refused).
Before the bound, a 200 MB JSON body was read whole and parsed.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from mstar.runtime.serve.http_schema import ApiError

MAX_JSON_BODY_BYTES = 32 << 20  # the bound whatever the plan
MIN_JSON_BODY_BYTES = 1 << 20
JSON_BYTES_PER_TOKEN = 64  # text runs at 4-12 bytes a token in JSON (escapes included), ids under 8
UPLOAD_PATHS = ("/v1/audio/transcriptions",)  # routes that bound their multipart form themselves


def json_body_limit(max_seq_len: int) -> int:
    """A JSON body's bound for a plan: JSON_BYTES_PER_TOKEN bytes a token of its max_seq_len,
    within [MIN_JSON_BODY_BYTES, MAX_JSON_BODY_BYTES]. A prompt past max_seq_len is refused
    anyway; a larger body only costs the server the time to read, parse and tokenize it (30 MB of
    text took 20 s to be refused)."""
    return min(MAX_JSON_BODY_BYTES, max(MIN_JSON_BODY_BYTES, JSON_BYTES_PER_TOKEN * max_seq_len))


class BodyLimit:
    def __init__(self, app: Any, limit: Optional[int] = None, on_refused: Optional[Callable[[], None]] = None):
        """limit: None takes MAX_JSON_BODY_BYTES as it is when the app is built; on_refused: called
        once per 413."""
        self.app, self.limit = app, MAX_JSON_BODY_BYTES if limit is None else limit
        self.on_refused = on_refused or (lambda: None)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        # (a media type is case-insensitive: `Multipart/Form-Data` got the JSON bodies' 1 MiB cap)
        if scope.get("path") in UPLOAD_PATHS and headers.get(b"content-type", b"").lower().startswith(b"multipart/"):
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            self.on_refused()
            await self._refuse()(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _message(self) -> str:
        return f"the request body is larger than {self.limit} bytes"

    def _refuse(self) -> JSONResponse:
        return JSONResponse(ApiError(413, self._message()).body(), status_code=413)

    def _counted(self, receive: Any) -> Any:
        received = 0

        async def counted() -> Any:
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    self.on_refused()
                    raise HTTPException(413, self._message())
            return message

        return counted
