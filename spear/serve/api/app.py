"""The OpenAI-compatible HTTP server (FastAPI).

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    GET  /v1/models, /health, /metrics

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``:
400 ``invalid_request_error`` for malformed JSON, unknown fields, wrong types, invalid
Unicode and requests that cannot run (empty prompt, prompt or max_tokens beyond the
context, a prompt or stop string over the server's limits); 413 for a body over
``ServerLimits.max_body_bytes``; 404 for an unknown model or path; 429 ``rate_limit_error``
when the waiting queue is full; 500 ``server_error`` for a request the model failed on
(that request only); 503 when the engine has stopped. ``/health`` also answers 503 while
one engine step has run longer than the engine's ``step_timeout_s`` (``spear serve
--step-timeout``), so that a supervisor can restart a server whose GPU hung, and while the
engine's steps keep failing for every request. A client that disconnects, streaming or
not, has its request aborted and its KV blocks freed.

The engine behind the endpoints is a frontend with one interface: ``EngineClient`` (client.py),
the engine core in a process of its own, which ``spear serve`` runs, or ``AsyncEngine``
(async_engine.py), the engine in a thread of this process (tests, embedding). Before it says
ready the engine loads the model and compiles every kernel a step can meet
(``LLMEngine.warmup``): ``/health`` answers 503 ``warming_up`` until then, and requests sent
meanwhile wait.

What each endpoint does with a request is endpoints.py's; the guards of the connections under
the app (header deadline, connection cap) are transport.py's. On SIGTERM the server stops taking
connections and gives open requests ``shutdown_timeout_s`` to finish; then each is ended with
the JSON error (503 ``shutting_down``), a stream with its error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spear.errors import SpearError
from spear.serve.config import ServerLimits
from spear.serve.api.endpoints import NotFound, Server, error_response
from spear.serve.api.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from spear.serve.core.scheduler import QueueFull
from spear.serve.frontend.stream import EngineDead
from spear.serve.api.transport import quiet_accept_faults, uvicorn_config

log = logging.getLogger(__name__)

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


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

def build_app(engine, model_name: str, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app over an engine frontend (``EngineClient`` or ``AsyncEngine``); it starts the
    engine on startup and stops it on shutdown."""
    server = Server(engine, model_name, limits)

    @asynccontextmanager
    async def lifespan(app):
        quiet_accept_faults(asyncio.get_running_loop())
        if not engine.alive and engine.error is None:
            await _maybe_await(engine.start())
        yield
        await _maybe_await(engine.shutdown())
        server.close()

    app = FastAPI(title="spear", description="OpenAI-compatible server for spear models", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _validation_error(exc)

    @app.exception_handler(ValidationError)
    async def _invalid_body(request, exc):  # a body parsed by Server.parse
        return _validation_error(exc)

    @app.exception_handler(RequestError)
    async def _bad_request(request, exc):
        return error_response(400, exc.message, param=exc.param)

    @app.exception_handler(SpearError)
    async def _refused(request, exc):  # the engine refused the request when it was queued
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
        code = "shutting_down" if "shutting down" in str(exc) else "engine_stopped"
        return error_response(503, str(exc), "server_error", code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {exc!r}", "server_error")

    @app.get("/health")
    async def health():
        if not engine.alive:
            if engine.error is None and not engine.loaded.is_set():
                return error_response(503, "the engine is loading its model", "server_error", code="warming_up")
            return error_response(503, f"the engine is not running: {engine.error!r}", "server_error")
        if not engine.ready.is_set():
            return error_response(503, "the engine is warming up (loading the model, compiling its kernels)",
                                  "server_error", code="warming_up")
        if engine.stuck:
            return error_response(503, f"the engine's current step has run for {engine.step_seconds:.0f} s "
                                       f"(limit {engine.step_timeout_s:g} s): the GPU or its driver may be hung",
                                  "server_error")
        if engine.failing:
            return error_response(503, f"the engine's last {engine.failed_steps} steps failed for every request: "
                                       f"{engine.last_failure}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        await engine.wait_loaded()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "spear", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.respond(request, await server.parse(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.respond(request, await server.parse(request, ChatCompletionRequest), chat=True)

    return app


async def _maybe_await(value):
    if asyncio.iscoroutine(value):
        await value


def run_server(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", limits: ServerLimits | None = None) -> None:
    """Serve until SIGTERM / Ctrl-C (blocking): then stop taking connections, give open requests up
    to ``limits.shutdown_timeout_s`` to finish (a second signal ends the wait), end the rest with
    their JSON error (a stream with its error event and ``[DONE]``), stop the engine."""
    import uvicorn

    limits = limits or ServerLimits()

    def cut() -> None:
        engine.fail_open(EngineDead(f"the server is shutting down: the request did not finish within "
                                    f"{limits.shutdown_timeout_s:g} s (shutdown_timeout_s)"))

    class _Server(uvicorn.Server):
        """uvicorn, where the first SIGTERM / Ctrl-C also sets the drain's deadline (``cut`` after
        ``shutdown_timeout_s``) and a second SIGTERM, not only a second Ctrl-C, ends the wait."""

        loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True
            elif self.loop is not None:
                self.loop.call_soon_threadsafe(self.loop.call_later, limits.shutdown_timeout_s, cut)
            super().handle_exit(sig, frame)

    server = _Server(uvicorn_config(build_app(engine, model_name, limits), host, port, log_level, limits))
    engine.on_fatal = lambda: setattr(server, "should_exit", True)  # an engine that cannot start stops it
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it drained for; the drain is done
        pass
