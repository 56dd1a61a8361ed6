"""Streaming responses: a request's outputs as OpenAI's server-sent events.

``SSEEncoder`` turns one ``RequestOutput`` into the bytes of its events in the frontend's pass over
a step (frontend/async_llm.py): the chunk's fixed part is encoded once per request, so a token
costs one JSON string encoding and a concatenation. ``EventStream`` is the response that writes
them: whatever waits when it wakes goes out in one write (a client reading slower than the engine
steps gets fewer, larger writes, not a backlog of small ones), and a client that leaves has its
request aborted.

    data: {"id": ..., "object": "text_completion", "created": ..., "model": ..., "choices": [...]}
    ...
    data: [DONE]
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from starlette.responses import Response

from spear.serve.api.errors import error_event
from spear.serve.frontend.async_llm import END, RequestStream
from spear.serve.frontend.output import RequestOutput

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


def usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}


class SSEEncoder:
    """The events of one streaming request (``chat``: chat.completion.chunk, else text_completion)."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool):
        self.chat, self.include_usage = chat, include_usage
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        self._head = b"data: " + _json.encode(head)[:-1]  # the object left open for "choices"
        self._open = self._head + (b',"choices":[{"index":0,"delta":' if chat else b',"choices":[{"index":0,"text":')

    def _chunk(self, text: str | None, finish: str | None) -> bytes:
        if self.chat:
            body = b"{}" if text is None else b'{"content":' + _json.encode(text) + b"}"
        else:
            body = _json.encode(text or "")
        return self._open + body + b',"logprobs":null,"finish_reason":' + _json.encode(finish) + b"}]}\n\n"

    def role(self) -> bytes:
        """A chat stream's first event: the assistant's role."""
        return self._open + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'

    def __call__(self, out: RequestOutput) -> bytes:
        if out.error is not None:
            return self.error(out.error)
        if not out.finished:
            return self._chunk(out.new_text, None) if out.new_text else b""
        last = self._chunk(out.new_text or (None if self.chat else ""), out.finish_reason)
        if self.include_usage:
            last += self._head + b',"choices":[],"usage":' + _json.encode(usage(out)) + b"}\n\n"
        return last + _DONE

    @staticmethod
    def error(message: str) -> bytes:
        return error_event(message)


class EventStream(Response):
    """The response of a streaming request: ``first`` (a chat's role event), then the stream's
    bytes as they come, until its final event, its failure's error event, or the client leaving."""

    media_type = "text/event-stream"

    def __init__(self, stream: RequestStream, first: bytes = b"", headers: dict[str, str] | None = None):
        # no body, so no Content-Length: the events go out chunked (as StreamingResponse sets itself up)
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})
        self.stream, self.first = stream, first

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        left = asyncio.ensure_future(self._watch(receive))
        try:
            pending, done = [self.first] if self.first else [], False
            while not done:
                for item in await self.stream.batch():
                    if item is END:
                        done = True
                    elif isinstance(item, BaseException):
                        pending.append(SSEEncoder.error(str(item)))
                        done = True
                    else:
                        pending.append(item)
                if left.done():  # the client is gone: nobody reads these
                    return
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": not done})
                pending = []
        finally:
            left.cancel()
            self.stream.abort()  # no-op when finished; frees the KV blocks of a client that left

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.stream.abort()
