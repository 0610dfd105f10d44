"""A bound on the size of a request body other than a multipart upload (a JSON request).

In: the ASGI app and the bound. Out: `BodyLimit`, ASGI middleware: a body whose Content-Length is
past the bound is answered 413 before it is read; one sent in chunks without a length is counted
as it arrives and refused (413) once past it. Multipart bodies (transcription uploads) pass: their
route bounds the audio itself (transcription.py, MAX_AUDIO_BYTES). Before, a 200 MB JSON body was
read whole and parsed.
"""
from __future__ import annotations

from typing import Any, Optional

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from mstar.runtime.serve.http_schema import ApiError

MAX_JSON_BODY_BYTES = 32 << 20  # a 131072-token prompt of token ids is about 1 MB of JSON


class BodyLimit:
    def __init__(self, app: Any, limit: Optional[int] = None):
        """limit: None takes MAX_JSON_BODY_BYTES as it is when the app is built."""
        self.app, self.limit = app, MAX_JSON_BODY_BYTES if limit is None else limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if headers.get(b"content-type", b"").startswith(b"multipart/"):
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
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
                    raise HTTPException(413, self._message())
            return message

        return counted
