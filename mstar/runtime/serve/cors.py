"""CORS for `mstar serve --cors-origin`: starlette's middleware, its refused preflight an OpenAI error.

In: the allowed origins (http_app.py adds it outermost). Out: `JsonCors`, starlette's
`CORSMiddleware` whose refusal of a preflight (an origin, method or header it does not allow) is
400 `{"error": {"message", "type": "invalid_request_error", "param": null, "code": null}}`, the
message naming what was refused, with the preflight's headers still on it; it was starlette's
plain text "Disallowed CORS origin", the one answer of the server that was not JSON. Allowed
preflights and every other answer are starlette's.
"""
from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from mstar.arg_types import shown
from mstar.runtime.serve.http_schema import ApiError

ALLOWED_METHODS = ("GET", "HEAD", "POST")


class JsonCors(CORSMiddleware):
    def __init__(self, app: ASGIApp, origins: list[str]):
        super().__init__(app, allow_origins=origins, allow_methods=list(ALLOWED_METHODS), allow_headers=["*"])

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code < 400:
            return answer
        headers = {name: value for name, value in answer.headers.items()
                   if name.lower() not in ("content-length", "content-type")}
        return JSONResponse(ApiError(answer.status_code, self._refusal(request_headers)).body(),
                            status_code=answer.status_code, headers=headers)

    def _refusal(self, request_headers: Headers) -> str:
        """What the preflight asked that this server does not allow, by name."""
        origin, method = request_headers["origin"], request_headers["access-control-request-method"]
        refused = []
        if not self.is_allowed_origin(origin):
            refused.append(f"the origin {shown(origin)} is not one this server allows (`mstar serve --cors-origin` "
                           "names those)")
        if method not in self.allow_methods:
            refused.append(f"the method {shown(method)} is not allowed (only {', '.join(ALLOWED_METHODS)})")
        if request_headers.get("access-control-request-private-network") is not None:
            refused.append("a public page's access to a private network is not allowed")
        return "CORS preflight refused: " + ("; ".join(refused) or "a request this server does not allow")
