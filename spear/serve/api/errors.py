"""Every error the server answers, as OpenAI's JSON body ``{"error": {"message", "type", "param",
"code"}}``: the exceptions of a request's way through the app mapped to their status, and the
body limit that refuses a body over ``ServerLimits.max_body_bytes`` before it is all in memory.

    400 invalid_request_error   malformed JSON, a body that does not validate, a request that cannot run
    404                         an unknown model or path
    413                         a body over the limit (code body_too_large)
    431                         request line and headers over the limit (transport.py, code headers_too_large)
    499                         the client left before its body was in (not sent; counted in /metrics)
    429 rate_limit_error        the waiting queue is full (code queue_full)
    500 server_error            the model failed on this request (code request_failed), or a bug
    503 server_error            the engine stopped, the server is shutting down, the core does not answer
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spear.errors import SpearError
from spear.serve.core.scheduler import QueueFull
from spear.serve.frontend.client import EngineDead
from spear.serve.frontend.processor import InvalidRequest

log = logging.getLogger(__name__)

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def printable(text: str | None) -> str | None:
    """``text`` as valid UTF-8: an error message may quote a client's invalid string."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": printable(message), "type": type_, "param": printable(param), "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def error_event(message: str) -> bytes:
    """A stream's last events after a failure: its error, then ``[DONE]``."""
    return b"data: " + msgspec.json.encode(error_body(message, "server_error")) + b"\n\ndata: [DONE]\n\n"


class NotFound(Exception):
    """HTTP 404 with an OpenAI-style body (unknown model)."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class ClientLeft(Exception):
    """The client closed its connection before its request was admitted: mid-upload (``stage``
    "upload"; or the transport closed it for sending too slowly), while its prompt was tokenized
    ("tokenize") or before the engine took it ("admit"). Nobody reads an answer; counted, never
    logged with a traceback."""

    def __init__(self, stage: str = "upload"):
        super().__init__(stage)
        self.stage = stage


class BodyTooLarge(StarletteHTTPException):
    """The request body is over ``ServerLimits.max_body_bytes`` (HTTP 413).

    An HTTP exception, not a plain one: FastAPI turns any other exception raised while it reads
    a body into 400 "There was an error parsing the body", and re-raises only HTTP exceptions."""

    def __init__(self, message: str):
        super().__init__(413, message)
        self.message = message


class BodyLimit:
    """ASGI middleware: refuses a body over ``limit`` bytes, by its Content-Length before reading
    anything, or while reading a chunked body, before the whole of it is in memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await error_response(413, f"the request body has {int(length)} bytes; this server takes at most "
                                             f"{self.limit}", code="body_too_large")(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(f"the request body is over {self.limit} bytes, the most this server takes")
            return message

        return await self.app(scope, limited, send)


def _validation_error(exc: RequestValidationError | ValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(400, f"malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    # pydantic puts union branches ("str", "list[int]") in the location; they are not fields
    loc = [str(p) for p in first["loc"] if p != "body" and str(p) not in _TYPE_TAGS and "[" not in str(p)]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        message = f"unknown field '{param}'"
    elif param is None:
        message = f"request body: {first['msg']}"
    else:
        message = f"{param}: {first['msg']}"
    return error_response(400, message, param=param, code=first["type"])


def _metrics(request):
    return request.app.state.server.llm.metrics


def add_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise on its way through ``app`` to its JSON error."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _validation_error(exc)

    @app.exception_handler(ValidationError)
    async def _invalid_body(request, exc):  # a body parsed by Server.parse
        return _validation_error(exc)

    @app.exception_handler(InvalidRequest)
    async def _bad_request(request, exc):
        return error_response(400, exc.message, param=exc.param)

    @app.exception_handler(SpearError)
    async def _refused(request, exc):
        return error_response(400, str(exc))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request, exc):
        return error_response(413, exc.message, code="body_too_large")

    @app.exception_handler(NotFound)
    async def _not_found(request, exc):
        return error_response(404, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(QueueFull)
    async def _queue_full(request, exc):
        return error_response(429, f"the server is busy: {exc}; retry later", "rate_limit_error", code="queue_full")

    @app.exception_handler(EngineDead)
    async def _dead(request, exc):
        _metrics(request).rejected.labels(exc.code or "engine_dead").inc()
        return error_response(503, str(exc), "server_error", code=exc.code)

    @app.exception_handler(ClientLeft)
    async def _left(request, exc):
        if exc.stage != "upload":
            _metrics(request).rejected.labels("client_left").inc()
        elif not request.scope.get("state", {}).get("closed_by_server"):  # else transport.py counted it
            _metrics(request).connections_closed.labels("client_left").inc()
        return error_response(499, "client closed the request", code="client_closed")  # not sent: it is gone

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {exc!r}", "server_error")
