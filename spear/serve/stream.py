"""What an engine frontend hands the HTTP server (server.py), whichever it is: ``EngineClient``
(client.py, the engine core in a process of its own) or ``AsyncEngine`` (async_engine.py, the
engine in a thread of the server's process).

A request's outputs arrive as a ``RequestStream``; ``EngineDead`` says no request can be served
(the engine stopped, died, or the server is shutting down). The health thresholds are the
frontends' common rules for ``/health``.
"""

from __future__ import annotations

import asyncio

from spear.serve.outputs import RequestOutput

# A step longer than this marks the engine unhealthy (/health answers 503) until it returns: a
# decode step takes milliseconds, a prefill chunk well under a second, and the first steps that
# compile kernels tens of seconds; a step still running after minutes is a hung GPU or driver.
STEP_TIMEOUT_S = 300.0
# This many steps in a row that failed every request they ran mark the engine unhealthy (/health
# answers 503 until a step succeeds): one bad request fails alone, a broken GPU fails them all.
FAILING_STEPS = 3

_ABORTED = object()


class EngineDead(RuntimeError):
    """The engine stopped; no request can be served."""


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the finished output. The
    frontend (``owner``, with an ``abort(request_id)``) puts outputs, or an exception that ends the
    iteration with it, into ``queue``."""

    def __init__(self, request_id: str, owner):
        self.request_id, self._owner = request_id, owner
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _ABORTED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Stop generating (no-op once finished); the engine frees the request's KV blocks and
        the iteration ends. Call it on the event loop that submitted the request."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
            self.queue.put_nowait(_ABORTED)  # wakes a consumer waiting for the next output
