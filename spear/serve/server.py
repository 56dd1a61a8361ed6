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

Nothing heavy runs on the event loop: bodies over ``_PARSE_OFF_LOOP_BYTES`` are parsed and
validated on a worker thread; tokenization and chat templates run on worker threads with a
tokenizer copy each (the tokenizers library releases the GIL while it encodes), prompts of up to
``_SHORT_PROMPT_CHARS`` on a pool of their own, so a long prompt never holds up a short one,
``/health`` or other clients' streams. A chat may hold at most ``ServerLimits.max_messages``
messages. A connection that has not sent a request's headers within
``ServerLimits.header_timeout_s`` is closed, and beyond ``ServerLimits.max_connections`` open
connections new ones are closed at once (slow-header clients cannot hold the server's sockets);
each of these faults is logged once a minute, not once per connection. On SIGTERM the server
stops taking connections and gives open requests ``shutdown_timeout_s`` to finish; then each is
ended with the JSON error (503 ``shutting_down``), a stream with its error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spear.errors import SpearError
from spear.serve.stream import EngineDead, RequestStream
from spear.serve.chat import chat_prompt_ids, has_chat_template
from spear.serve.config import ServerLimits
from spear.serve.outputs import RequestOutput
from spear.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from spear.serve.scheduler import QueueFull

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_PARSE_OFF_LOOP_BYTES = 64 * 1024   # bodies from this size are parsed on a worker thread
_SHORT_PROMPT_CHARS = 8192          # prompts up to this many characters take the short prompts' pool
_TOKENIZE_THREADS = 2               # threads of each tokenization pool (short prompts, long prompts)


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


class _NotFound(Exception):
    """HTTP 404 with an OpenAI-style body (unknown model)."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class _Tokenizers:
    """A pool of threads that each hold their own copy of the tokenizer (a tokenizer object's
    Python side is not reentrant; copies encode side by side, the Rust part without the GIL)."""

    def __init__(self, tokenizer, threads: int, name: str):
        self.tokenizer = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    def _mine(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    async def run(self, fn, *args):
        """``fn(tokenizer, *args)`` on a pool thread, with that thread's tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._mine(), *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _parse(raw: bytes, model):
    """``raw`` JSON as ``model``: the standard library's parser (it keeps a lone surrogate, which
    the model's own validator then names), then the model's strict validation."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, invalid UTF-8, nesting beyond the stack
        detail = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
        raise RequestError(f"malformed JSON body: {detail}") from None
    return model.model_validate(data)


def _encode(tokenizer, prompt: str) -> list[int]:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it
        raise SpearError(f"the prompt is not valid Unicode text ({exc.reason} at character {exc.start})") from None
    return tokenizer(prompt).input_ids


class Server:
    """The endpoints over one engine frontend (``EngineClient`` or ``AsyncEngine``) serving one
    model under ``model_name``."""

    def __init__(self, engine, model_name: str, limits: ServerLimits | None = None):
        self.engine, self.model_name = engine, model_name
        self.limits = limits or ServerLimits()
        self.created = int(time.time())
        tok = engine.tokenizer
        self._short = _Tokenizers(tok, _TOKENIZE_THREADS, "spear-tokenize-short")
        self._long = _Tokenizers(tok, _TOKENIZE_THREADS, "spear-tokenize-long")
        self._parse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spear-parse")

    def _tokenizers(self, chars: int) -> _Tokenizers:
        return self._short if chars <= _SHORT_PROMPT_CHARS else self._long

    async def parse(self, request: Request, model):
        """The body as ``model`` (a pydantic request class): read here (the body limit applies),
        parsed and validated on a worker thread when large, so /health and other clients' streams
        do not wait for it."""
        raw = await request.body()
        if len(raw) < _PARSE_OFF_LOOP_BYTES:
            return _parse(raw, model)
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, _parse, raw, model)

    def close(self) -> None:
        self._short.close()
        self._long.close()
        self._parse_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise _NotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                            "model", "model_not_found")

    def _check_lengths(self, ids: list[int], max_tokens: int | None) -> int:
        n, limit = len(ids), self.engine.max_model_len
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
            self.engine.check_request(ids, params)
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
        await self.engine.wait_loaded()
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            try:
                ids = await self._tokenizers(len(prompt)).run(_encode, prompt)
            except SpearError as exc:
                raise RequestError(str(exc), "prompt") from None
        else:
            ids = list(prompt)
        return ids, self._sampling(body, ids, body.max_tokens)

    async def chat_inputs(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        max_tokens = body.max_tokens_requested()
        if not has_chat_template(self.engine.tokenizer):
            raise RequestError(f"the model '{self.model_name}' has no chat template; use /v1/completions",
                               "messages")
        if len(body.messages) > self.limits.max_messages:
            raise RequestError(f"the chat has {len(body.messages)} messages; this server takes at most "
                               f"{self.limits.max_messages}", "messages")
        messages = body.chat()
        # every field a message holds counts, so that a chat of empty messages is not free
        chars = sum(len(m["content"]) + len(m["role"]) + 1 for m in messages)
        self._check_chars(chars, "messages")
        await self.engine.wait_loaded()
        try:
            ids = await self._tokenizers(chars).run(chat_prompt_ids, messages)
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


def build_app(engine, model_name: str, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app over an engine frontend (``EngineClient`` or ``AsyncEngine``); it starts the
    engine on startup and stops it on shutdown."""
    server = Server(engine, model_name, limits)

    @asynccontextmanager
    async def lifespan(app):
        _quiet_accept_faults(asyncio.get_running_loop())
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

    @app.exception_handler(_NotFound)
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


class _OncePer:
    """Lets a repeated fault through once per ``interval_s`` (with the count held back since)."""

    def __init__(self, interval_s: float = 60.0):
        self.interval_s, self.last, self.held = interval_s, 0.0, 0

    def allow(self) -> int | None:
        """None to hold this one back, else how many were held back before it."""
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held


def _quiet_accept_faults(loop: asyncio.AbstractEventLoop) -> None:
    """Log the event loop's failures to accept a connection (out of file descriptors, typically)
    once a minute, one line, instead of a traceback per attempt."""
    gate, default = _OncePer(), loop.get_exception_handler()

    def handler(loop, context):
        if "accept" in str(context.get("message", "")):
            held = gate.allow()
            if held is not None:
                log.error("cannot accept connections: %s (%s)%s", context.get("message"), context.get("exception"),
                          f"; {held} more since the last report" if held else "")
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _guarded_protocol(limits: ServerLimits):
    """uvicorn's h11 protocol with a deadline for a request's headers and a cap on connections."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeouts, refusals = _OncePer(), _OncePer()

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            if len(self.connections) > limits.max_connections:
                held = refusals.allow()
                if held is not None:
                    log.warning("%d connections open, the most this server keeps (max_connections): closing new "
                                "ones%s", len(self.connections) - 1, f" ({held} more since)" if held else "")
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._seen = self.cycle
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is self._seen and not self.transport.is_closing():  # no request's headers yet
                held = timeouts.allow()
                if held is not None:
                    log.warning("closing a connection that sent no complete request headers within %g s "
                                "(header_timeout_s)%s", limits.header_timeout_s, f"; {held} more since" if held else "")
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self._deadline is not None and self.cycle is not self._seen:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # a kept-alive connection: the next headers have a deadline too
                self._disarm()
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Guarded


def _raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard one; the soft limit now."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return soft
    except (ImportError, ValueError, OSError):
        return 1024


def _uvicorn_server(config, on_exit=None):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn, where a second SIGTERM (not only a second Ctrl-C) stops waiting for open
        requests, and the first calls ``on_exit`` (the drain's deadline)."""

        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True
            elif on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    return _Server(config)


def uvicorn_config(app, host: str, port: int, log_level: str, limits: ServerLimits):
    """uvicorn's settings for ``app``: the guarded h11 protocol (header deadline, connection cap below
    the process's file limit, which is raised to its hard limit first), a 5 s keep-alive, and a
    graceful shutdown that outlasts ``shutdown_timeout_s`` by the time to write the last errors."""
    import uvicorn

    fds = _raise_fd_limit()
    if limits.max_connections > fds - 64:  # the cap must bite before the descriptors run out
        limits = _replace(limits, max_connections=max(16, fds - 64))
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=_guarded_protocol(limits),
                          timeout_keep_alive=5, timeout_graceful_shutdown=limits.shutdown_timeout_s + 5)


def run_server(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", limits: ServerLimits | None = None) -> None:
    """Serve until SIGTERM / Ctrl-C (blocking): then stop taking connections, give open requests up
    to ``limits.shutdown_timeout_s`` to finish (a second signal ends the wait), end the rest with
    their JSON error (a stream with its error event and ``[DONE]``), stop the engine."""
    import uvicorn

    limits = limits or ServerLimits()
    config = uvicorn_config(build_app(engine, model_name, limits), host, port, log_level, limits)
    loop_box: list = []

    def deadline() -> None:
        loop = loop_box[0] if loop_box else None
        if loop is None:
            return

        def cut():
            engine.fail_open(EngineDead(f"the server is shutting down: the request did not finish within "
                                        f"{limits.shutdown_timeout_s:g} s (shutdown_timeout_s)"))

        loop.call_soon_threadsafe(loop.call_later, limits.shutdown_timeout_s, cut)

    server = _uvicorn_server(config, deadline)
    if hasattr(engine, "on_fatal"):  # an engine that cannot start stops the server
        engine.on_fatal = lambda: setattr(server, "should_exit", True)
    original = server.startup

    async def startup(*args, **kwargs):
        loop_box.append(asyncio.get_running_loop())
        return await original(*args, **kwargs)

    server.startup = startup
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it drained for; the drain is done
        pass


def _replace(limits: ServerLimits, **changes) -> ServerLimits:
    from dataclasses import replace

    return replace(limits, **changes)
