"""What an engine frontend hands the HTTP server (server.py), whichever it is: ``EngineClient``
(client.py, the engine core in a process of its own) or ``AsyncEngine`` (async_engine.py, the
engine in a thread of the server's process).

A request's outputs arrive as a ``RequestStream``; ``EngineDead`` says no request can be served
(the engine stopped, died, or the server is shutting down). ``Frontend`` holds what both share:
their life's flags, the metrics, and the rules ``/health`` applies to each one's step facts.
"""

from __future__ import annotations

import asyncio
import threading

from spear.serve.api.metrics import ServingMetrics
from spear.serve.core.outputs import RequestOutput

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


class Frontend:
    """The part both frontends share. A frontend sets ``loaded`` once the model is in place,
    ``ready`` once the warm-up is done (``warmup_seconds``), ``error`` when it stopped; it answers
    ``step_seconds`` (how long the running step has run, 0 between steps) and ``failed_steps``
    (steps in a row that failed every request they ran, or that raised)."""

    step_seconds: float
    failed_steps: int

    def __init__(self, metrics: ServingMetrics | None, step_timeout_s: float):
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0; got {step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics or ServingMetrics()
        self.metrics.step_running.set_function(lambda: self.step_seconds)
        self.error: BaseException | None = None
        self.loaded = threading.Event()
        self.ready = threading.Event()
        self.warmup_seconds: float | None = None
        self.on_fatal = None  # called when the engine fails before it loaded (the server then stops)

    @property
    def failing(self) -> bool:
        return self.failed_steps >= FAILING_STEPS

    @property
    def stuck(self) -> bool:
        """The running step has taken longer than ``step_timeout_s`` (it may still return)."""
        return self.step_seconds > self.step_timeout_s
