"""What the OpenAI endpoints do with a request, between HTTP (server.py) and an engine frontend:
the body parsed and checked, the prompt tokenized, the request submitted, its outputs turned into
the OpenAI response, whole or as server-sent events; and every error as the OpenAI JSON body.

Nothing heavy runs on the event loop: bodies over ``_PARSE_OFF_LOOP_BYTES`` are parsed and
validated on a worker thread; tokenization and chat templates run on worker threads with a
tokenizer copy each (the tokenizers library releases the GIL while it encodes), prompts of up to
``_SHORT_PROMPT_CHARS`` on a pool of their own, so a long prompt never holds up a short one,
``/health`` or other clients' streams. A chat may hold at most ``ServerLimits.max_messages``
messages.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from spear.errors import SpearError
from spear.serve.frontend.chat import chat_prompt_ids, has_chat_template
from spear.serve.config import ServerLimits
from spear.serve.core.outputs import RequestOutput
from spear.serve.api.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from spear.serve.frontend.stream import RequestStream

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
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

class NotFound(Exception):
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
            raise NotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'",
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
