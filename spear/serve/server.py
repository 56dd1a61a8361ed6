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

Before it says ready the engine compiles every kernel a step can meet (``LLMEngine.warmup``):
``/health`` answers 503 ``warming_up`` until then, and requests sent meanwhile wait in the queue.

Nothing heavy runs on the event loop: tokenization and chat templates run on one worker
thread (the tokenizers library releases the GIL while it encodes), so a long prompt never
holds up /health or other clients' streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from spear.errors import SpearError
from spear.serve.async_engine import AsyncEngine, EngineDead, RequestStream
from spear.serve.chat import chat_prompt_ids, has_chat_template
from spear.serve.config import ServerLimits
from spear.serve.outputs import RequestOutput
from spear.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from spear.serve.scheduler import QueueFull

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _printable(text: str | None) -> str | None:
    """``text`` as valid UTF-8: an error message may quote a client's invalid string."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": _printable(message), "type": type_, "param": _printable(param),
                                   "code": code}}, status_code=status)


def error_event(message: str) -> str:
    body = {"error": {"message": _printable(message), "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n"


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


def _validation_error(exc: RequestValidationError) -> JSONResponse:
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


class _NotFound(Exception):
    """HTTP 404 with an OpenAI-style body (unknown model)."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class Server:
    """The endpoints over one AsyncEngine serving one model under ``model_name``."""

    def __init__(self, engine: AsyncEngine, model_name: str, limits: ServerLimits | None = None):
        self.engine, self.model_name = engine, model_name
        self.limits = limits or ServerLimits()
        self.llm = engine.engine
        self.created = int(time.time())
        # one thread: the tokenizer object is shared and its Python side is not reentrant
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spear-tokenize")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise _NotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                            "model", "model_not_found")

    def _check_lengths(self, ids: list[int], max_tokens: int | None) -> int:
        n, limit = len(ids), self.llm.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this model's context is {limit} tokens "
                               "and one must be left for the output", "prompt")
        if max_tokens is None:
            return limit - n
        if n + max_tokens > limit:
            raise RequestError(f"max_tokens ({max_tokens}) plus the prompt ({n} tokens) exceeds the context of "
                               f"{limit} tokens; at most {limit - n} tokens can be generated", "max_tokens")
        return max_tokens

    async def _submit(self, ids: list[int], params) -> RequestStream:
        try:
            self.llm.check_request(ids, params)
        except SpearError as exc:
            raise RequestError(str(exc), "prompt") from None
        return await self.engine.submit(ids, params)

    def _check_chars(self, n: int, param: str) -> None:
        if n > self.limits.max_prompt_chars:
            raise RequestError(f"the prompt has {n} characters; this server takes at most "
                               f"{self.limits.max_prompt_chars}", param)

    def _sampling(self, body, ids: list[int], max_tokens: int | None):
        try:
            return body.sampling_params(self._check_lengths(ids, max_tokens), self.limits)
        except SpearError as exc:  # a value the engine refuses that the schema let through
            raise RequestError(str(exc)) from None

    async def completion_inputs(self, body: CompletionRequest):
        self._check_model(body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            ids = await self._off_loop(self.llm.tokenize, prompt)
        else:
            ids = list(prompt)
        return ids, self._sampling(body, ids, body.max_tokens)

    async def chat_inputs(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        max_tokens = body.max_tokens_requested()
        if not has_chat_template(self.llm.tokenizer):
            raise RequestError(f"the model '{self.model_name}' has no chat template; use /v1/completions",
                               "messages")
        messages = body.chat()
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = await self._off_loop(chat_prompt_ids, self.llm.tokenizer, messages)
        except SpearError as exc:
            raise RequestError(str(exc), "messages") from None
        return ids, self._sampling(body, ids, max_tokens)

    # ------------------------------------------------------------------ responses
    @staticmethod
    def _usage(out: RequestOutput) -> dict:
        return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                "total_tokens": out.num_prompt_tokens + out.num_output_tokens}

    async def collect(self, stream: RequestStream, request: Request) -> RequestOutput | None:
        """The final output; None if the client disconnected first (the request is then aborted)."""
        async def watch():
            while not stream.finished:
                if await request.is_disconnected():
                    log.info("client left; aborting %s", stream.request_id)
                    stream.abort()
                    return
                await asyncio.sleep(_DISCONNECT_POLL_S)

        watcher = asyncio.create_task(watch())
        try:
            out = None
            async for out in stream:
                pass
            return out
        finally:
            watcher.cancel()
            stream.abort()

    def completion_body(self, rid: str, out: RequestOutput) -> dict:
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": self._usage(out)}

    def chat_body(self, rid: str, out: RequestOutput) -> dict:
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": self._usage(out)}

    async def sse(self, stream: RequestStream, rid: str, chat: bool, include_usage: bool):
        """``data: {chunk}`` events, then ``data: [DONE]``. Cancelled when the client disconnects."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def event(choices: list, **extra) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices,
                    **extra}
            return f"data: {json.dumps(body)}\n\n"

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        try:
            if chat:
                yield event([choice(None, None, role=True)])
            out = None
            async for out in stream:
                if out.error is not None:
                    yield error_event(out.error)
                    yield "data: [DONE]\n\n"
                    return
                if out.new_text and not out.finished:
                    yield event([choice(out.new_text, None)])
                elif out.finished:
                    yield event([choice(out.new_text or (None if chat else ""), out.finish_reason)])
            if include_usage and out is not None:
                yield event([], usage=self._usage(out))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # a failed engine step: the stream ends with an error event
            log.error("request %s failed: %r", rid, exc)
            yield error_event(str(exc))
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()  # no-op when finished; frees the KV blocks of a client that left

    async def respond(self, request: Request, body, chat: bool):
        ids, params = await (self.chat_inputs(body) if chat else self.completion_inputs(body))
        stream = await self._submit(ids, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + stream.request_id
        if body.stream:
            return StreamingResponse(self.sse(stream, rid, chat, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await self.collect(stream, request)
        if out is None or not out.finished:  # the client left; nobody reads this
            return error_response(499, "client closed the request", code="client_closed")
        if out.error is not None:
            return error_response(500, out.error, "server_error", code="request_failed")
        return JSONResponse(self.chat_body(rid, out) if chat else self.completion_body(rid, out))


def build_app(engine: AsyncEngine, model_name: str, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app; it starts the engine thread on startup and stops it on shutdown."""
    server = Server(engine, model_name, limits)

    @asynccontextmanager
    async def lifespan(app):
        if not engine.alive and engine.error is None:
            engine.start()
        yield
        engine.shutdown()
        server.close()

    app = FastAPI(title="spear", description="OpenAI-compatible server for spear models", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
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

    @app.exception_handler(_NotFound)
    async def _not_found(request, exc):
        return error_response(404, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(QueueFull)
    async def _queue_full(request, exc):
        return error_response(429, f"the server is busy: {exc}; retry later", "rate_limit_error", code="queue_full")

    @app.exception_handler(EngineDead)
    async def _dead(request, exc):
        return error_response(503, str(exc), "server_error", code="engine_stopped")

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
            return error_response(503, f"the engine is not running: {engine.error!r}", "server_error")
        if not engine.ready.is_set():
            return error_response(503, "the engine is warming up (compiling its kernels)", "server_error",
                                  code="warming_up")
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
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "spear", "max_model_len": server.llm.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.respond(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.respond(request, body, chat=True)

    return app


def _uvicorn_server(config):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn, where a second SIGTERM (not only a second Ctrl-C) stops waiting for open requests."""

        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True
            super().handle_exit(sig, frame)

    return _Server(config)


def run_server(engine: AsyncEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", limits: ServerLimits | None = None) -> None:
    """Serve until SIGTERM / Ctrl-C (blocking): then stop taking connections, give open requests up
    to ``limits.shutdown_timeout_s`` to finish (a second signal ends the wait), stop the engine."""
    import uvicorn

    limits = limits or ServerLimits()
    config = uvicorn.Config(build_app(engine, model_name, limits), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=limits.shutdown_timeout_s)
    try:
        _uvicorn_server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it drained for; the drain is done
        pass
