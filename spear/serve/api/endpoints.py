"""What the OpenAI endpoints do with a request, between HTTP (app.py) and the frontend
(frontend/async_llm.py): the body parsed, the prompt tokenized, the request submitted, its outputs
turned into the OpenAI response, whole or as server-sent events (sse.py).

Nothing heavy runs on the event loop: bodies over ``_PARSE_OFF_LOOP_BYTES`` are parsed and
validated on a worker thread; tokenization and chat templates run on worker threads with a
tokenizer copy each (the tokenizers library releases the GIL while it encodes), prompts of up to
``_SHORT_PROMPT_CHARS`` on a pool of their own, so a long prompt never holds up a short one,
``/health`` or other clients' streams. A chat may hold at most ``ServerLimits.max_messages``
messages. Whether the request can run (its prompt within the context and the vocabulary, every
sampling field in range) is the input processor's to say, once. No work is done for a client that
has left: a prompt that could not fit the context even at the tokenizer's longest token is refused
before tokenizing, at most ``ServerLimits.max_long_prompts_queued`` long prompts wait for the long
pool (429 beyond), a queued tokenization whose client leaves never runs, and a request whose client
left while it was tokenized is not admitted.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from spear.errors import SpearError
from spear.serve.api.errors import ClientLeft, NotFound, error_response
from spear.serve.core.scheduler import QueueFull
from spear.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from spear.serve.api.sse import EventStream, SSEEncoder, usage
from spear.serve.config import ServerLimits
from spear.serve.frontend.async_llm import AsyncLLM, RequestStream
from spear.serve.frontend.chat import chat_prompt_ids, has_chat_template
from spear.serve.frontend.output import RequestOutput
from spear.serve.frontend.processor import InvalidRequest, encode_text

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_PARSE_OFF_LOOP_BYTES = 64 * 1024   # bodies from this size are parsed on a worker thread
_SHORT_PROMPT_CHARS = 8192          # prompts up to this many characters take the short prompts' pool
_TOKENIZE_THREADS = 2               # threads of each tokenization pool (short prompts, long prompts)


class _Tokenizers:
    """A pool of threads that each hold their own copy of the tokenizer (a tokenizer object's
    Python side is not reentrant; copies encode side by side, the Rust part without the GIL), with
    at most ``max_jobs`` jobs queued or running (None: unbounded); a job whose client leaves while it
    waits never runs."""

    def __init__(self, tokenizer, threads: int, name: str, max_jobs: int | None = None):
        self.tokenizer, self.max_jobs, self.jobs = tokenizer, max_jobs, 0
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    def _mine(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    async def run(self, fn, *args, request: Request | None = None):
        """``fn(tokenizer, *args)`` on a pool thread, with that thread's tokenizer; QueueFull past
        ``max_jobs``; ClientLeft (the job cancelled, or its result dropped) once ``request``'s
        client has disconnected."""
        if self.max_jobs is not None and self.jobs >= self.max_jobs:
            raise QueueFull(f"{self.jobs} long prompts are being tokenized, the most this server queues")
        loop = asyncio.get_running_loop()
        self.jobs += 1
        job = self._pool.submit(lambda: fn(self._mine(), *args))
        # counted until the thread is free, not until this coroutine stops waiting
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        waiting = asyncio.wrap_future(job)
        if request is None:
            return await waiting
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                job.cancel()  # a job not started never runs; a running one finishes unread
                raise ClientLeft("tokenize")

    def _done(self) -> None:
        self.jobs -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token of ``tokenizer`` stands for: its vocabulary's
    longest piece (a byte-level piece has a character per byte, so it bounds the text's characters
    too), doubled where a normalizer may first contract the text (NFC joins characters)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max((len(p) for p in pieces if p), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (2 if backend is None or backend.normalizer is not None else 1)


def _parse(raw: bytes, model):
    """``raw`` JSON as ``model``: the standard library's parser (it keeps a lone surrogate, which
    the model's own validator then names), then the model's strict validation."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, invalid UTF-8, nesting beyond the stack
        detail = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
        raise InvalidRequest(f"malformed JSON body: {detail}") from None
    return model.model_validate(data)


class Server:
    """The endpoints over one frontend serving one model under ``model_name``."""

    def __init__(self, llm: AsyncLLM, model_name: str, limits: ServerLimits | None = None):
        self.llm, self.model_name = llm, model_name
        self.limits = limits or ServerLimits()
        self.created = int(time.time())
        tok = llm.tokenizer
        self._short = _Tokenizers(tok, _TOKENIZE_THREADS, "spear-tokenize-short")
        self._long = _Tokenizers(tok, _TOKENIZE_THREADS, "spear-tokenize-long", self.limits.max_long_prompts_queued)
        self._chars_per_token = longest_token_chars(tok)
        self._parse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spear-parse")

    def _tokenizers(self, chars: int) -> _Tokenizers:
        return self._short if chars <= _SHORT_PROMPT_CHARS else self._long

    async def parse(self, request: Request, model):
        """The body as ``model`` (a pydantic request class): read here (the body limit applies),
        parsed and validated on a worker thread when large, so /health and other clients' streams
        do not wait for it."""
        try:
            raw = await request.body()
        except ClientDisconnect:  # it left mid-upload, or the transport closed it (too slow)
            raise ClientLeft from None
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

    def _check_chars(self, n: int, param: str) -> None:
        """A prompt of ``n`` characters within the server's limit and, before any tokenizing, one that
        could fit the context: no token holds more than ``_chars_per_token`` characters."""
        if n > self.limits.max_prompt_chars:
            raise InvalidRequest(f"the prompt has {n} characters; this server takes at most "
                                 f"{self.limits.max_prompt_chars}", param)
        fewest = -(-n // self._chars_per_token)
        if fewest >= self.llm.max_model_len:
            raise InvalidRequest(f"the prompt has {n} characters, so at least {fewest} tokens (no token of this "
                                 f"model holds more than {self._chars_per_token} characters); the context holds "
                                 f"{self.llm.max_model_len} tokens, prompt and output together", param)

    async def completion_inputs(self, body: CompletionRequest, request: Request | None = None):
        self._check_model(body.model)
        prompt = body.single_prompt()
        params = body.sampling_params(body.max_tokens, self.limits)
        await self.llm.wait_loaded()
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            return await self._tokenizers(len(prompt)).run(encode_text, prompt, request=request), params
        return prompt, params

    async def chat_inputs(self, body: ChatCompletionRequest, request: Request | None = None):
        self._check_model(body.model)
        params = body.sampling_params(body.max_tokens_requested(), self.limits)
        if not has_chat_template(self.llm.tokenizer):
            raise InvalidRequest(f"the model '{self.model_name}' has no chat template; use /v1/completions",
                                 "messages")
        if len(body.messages) > self.limits.max_messages:
            raise InvalidRequest(f"the chat has {len(body.messages)} messages; this server takes at most "
                                 f"{self.limits.max_messages}", "messages")
        messages = body.chat()
        chars = body.chars()
        self._check_chars(chars, "messages")
        await self.llm.wait_loaded()
        try:
            ids = await self._tokenizers(chars).run(chat_prompt_ids, messages, request=request)
        except SpearError as exc:  # the template refused the messages
            raise InvalidRequest(str(exc), "messages") from None
        return ids, params

    # ------------------------------------------------------------------ responses
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

    def _body(self, rid: str, out: RequestOutput, chat: bool) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": usage(out)}

    async def _submit(self, body, ids, params, **kw) -> RequestStream:
        try:
            return await self.llm.submit(ids, params, **kw)
        except InvalidRequest as exc:  # the processor names SamplingParams' fields, not always the body's
            raise body.as_sent(exc) from None

    async def handle(self, request: Request, model, chat: bool):
        """One completion request, body to response; the response's ``Server-Timing`` header says
        where its time went before the engine took it (W3C Server-Timing, milliseconds): ``parse``
        the body read and validated, ``prepare`` its checks and tokenization, ``admit`` until the
        engine core took it (the next step boundary)."""
        start = time.monotonic()
        body = await self.parse(request, model)
        parsed = time.monotonic()
        ids, params = await (self.chat_inputs(body, request) if chat else self.completion_inputs(body, request))
        if await request.is_disconnected():  # it left while its prompt was tokenized: admit nothing
            raise ClientLeft("admit")
        prepared = time.monotonic()
        serial = uuid.uuid4().hex
        rid = ("chatcmpl-" if chat else "cmpl-") + serial
        encoder = SSEEncoder(rid, self.model_name, chat, body.include_usage) if body.stream else None
        stream = await self._submit(body, ids, params, request_id=serial, encode=encoder)
        timing = {"Server-Timing": f"parse;dur={1e3 * (parsed - start):.2f}, prepare;dur={1e3 * (prepared - parsed):.2f}"
                                   f", admit;dur={1e3 * (time.monotonic() - prepared):.2f}"}
        if encoder is not None:
            return EventStream(stream, encoder.role() if chat else b"", headers=timing)
        out = await self.collect(stream, request)
        if out is None or not out.finished:  # the client left; nobody reads this
            return error_response(499, "client closed the request", code="client_closed")
        if out.error is not None:
            return error_response(500, out.error, "server_error", code="request_failed")
        return JSONResponse(self._body(rid, out, chat), headers=timing)
