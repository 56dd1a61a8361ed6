"""``AsyncLLM``: the HTTP server's frontend over a ``CoreClient`` (frontend/client.py; ``spear
serve`` runs the core in a process of its own, frontend/mp_client.py).

    stream = await llm.submit(prompt_ids, params)   # raises InvalidRequest / QueueFull / EngineDead
    async for out in stream: ...                     # RequestOutput deltas (or, with ``encode``, their bytes)
    stream.abort()                                   # e.g. the client went away

A request is checked once by the input processor, sent, and followed from the moment it is sent;
``submit`` returns once the core has taken it. One task reads the core's messages: per message,
the requests taken or refused, then every request's ``RequestOutput`` made in one pass by the
output processor (text, stop strings), each handed to its stream there and then; a streaming
request's ``encode`` turns its output into the bytes of its server-sent events in the same pass.
A refusal ends the one submission of a request that waits to be taken; a refusal of a request
already running answers a second submission this frontend never sent (it sends a request once):
it is logged and the stream goes on, since the core refuses such a duplicate without touching the
request it runs.

``/health`` reads ``problem()``: the core loading or warming up, stopped or dead, silent (no
heartbeat for ``HEARTBEAT_STALE_S``: stopped or frozen), running one step past
``step_timeout_s`` (a hung GPU), failing every request for ``FAILING_STEPS`` steps, or a listener
that died. A request the core has not taken while it is silent, stuck or dead ends with
``EngineDead`` (503).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from spear.serve.core.messages import CoreOutputs, EngineStats, SamplingParams
from spear.serve.core.scheduler import QueueFull
from spear.serve.faults import OncePer
from spear.serve.frontend.client import CoreClient, EngineDead
from spear.serve.frontend.metrics import ServingMetrics
from spear.serve.frontend.output import OutputProcessor, RequestOutput
from spear.serve.frontend.processor import InputProcessor, InvalidRequest

log = logging.getLogger(__name__)

# A step longer than this marks the engine unhealthy (/health answers 503) until it returns: a
# decode step takes milliseconds, a prefill chunk well under a second, and the first steps that
# compile kernels tens of seconds; a step still running after minutes is a hung GPU or driver.
STEP_TIMEOUT_S = 300.0
# This many steps in a row that failed every request they ran mark the engine unhealthy (/health
# answers 503 until a step succeeds): one bad request fails alone, a broken GPU fails them all.
FAILING_STEPS = 3
# The core reports every 0.25 s from a thread of its own, whatever its engine does: silence this
# long means the process is stopped or frozen (a busy step still reports).
HEARTBEAT_STALE_S = 3.0
_TAKE_POLL_S = 0.25

END = object()  # after a stream's final item


class RequestStream:
    """The outputs of one request, as an async iterator that ends after the final one. Outputs are
    put as ``RequestOutput``s, or as the bytes ``encode`` makes of each (empty bytes are skipped)."""

    __slots__ = ("request_id", "_owner", "queue", "encode", "finished", "last_token_time")

    def __init__(self, request_id: str, owner: "AsyncLLM", encode=None):
        self.request_id, self._owner, self.encode = request_id, owner, encode
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.last_token_time: float | None = None

    def put(self, out: RequestOutput) -> None:
        item = out if self.encode is None else self.encode(out)
        if item is not None and item != b"":
            self.queue.put_nowait(item)
        if out.finished:
            self.finished = True
            self.queue.put_nowait(END)

    def fail(self, exc: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(exc)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def batch(self) -> list:
        """Everything put since the last call (waits for the first); ends with ``END`` after the final
        item, or raises the exception that ended the stream (after the items put before it)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def abort(self) -> None:
        """Stop generating (no-op once finished); the engine frees the request's KV blocks and the
        iteration ends. Call it on the event loop that submitted the request."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
            self.queue.put_nowait(END)  # wakes a consumer waiting for the next output



class AsyncLLM:
    """The requests of one HTTP server over one engine core (``client``), on the server's event loop."""

    def __init__(self, client: CoreClient, tokenizer, metrics: ServingMetrics | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S):
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0; got {step_timeout_s}")
        self.client, self.tokenizer = client, tokenizer
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics or ServingMetrics()
        self.metrics.step_running.set_function(lambda: self.step_seconds)
        self.output = OutputProcessor(tokenizer)
        self.processor: InputProcessor | None = None
        self._streams: dict[str, RequestStream] = {}
        self._taking: dict[str, asyncio.Future] = {}
        self._listener: asyncio.Task | None = None
        self._faults = OncePer()
        self.error: BaseException | None = None  # the frontend itself stopped (its listener died)
        client.on_error = self.fail_open  # a core that stops serving ends every open request

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        await self.client.start()
        self._listener = asyncio.create_task(self._listen(), name="spear-core-listener")
        self._listener.add_done_callback(self._listener_ended)

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._listener is not None:
            self._listener.remove_done_callback(self._listener_ended)
            self._listener.cancel()
        await self.client.shutdown(timeout)
        self.fail_open(EngineDead("the server is shutting down", "shutting_down"))

    @property
    def loaded(self):
        return self.client.loaded

    @property
    def ready(self):
        return self.client.ready

    @property
    def alive(self) -> bool:
        return self.client.alive and self.error is None

    @property
    def max_model_len(self) -> int:
        if self.client.facts is None:
            raise EngineDead("the engine is still loading its model")
        return self.client.facts.max_model_len

    async def wait_loaded(self) -> None:
        """Return once the core has loaded the model (its facts are known); EngineDead if it stopped."""
        while not self.client.loaded.is_set():
            if self.client.error is not None:
                raise self.client.error
            await asyncio.sleep(0.05)
        if self.processor is None:
            self.processor = InputProcessor(self.client.facts)

    # ------------------------------------------------------------------ health
    @property
    def stats(self) -> EngineStats:
        health = self.client.health()
        return EngineStats() if health is None or health.stats is None else health.stats

    @property
    def step_seconds(self) -> float:
        health = self.client.health()
        started = None if health is None else health.step_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    @property
    def failed_steps(self) -> int:
        health = self.client.health()
        return 0 if health is None else health.failed_steps

    def refresh_metrics(self) -> None:
        """The gauges of the engine's state as its last report has them, and the link's dropped
        frames (read at each scrape)."""
        self.metrics.set_stats(self.stats)
        self.metrics.count_dropped_frames(self.client.frames_dropped())

    def problem(self) -> tuple[str | None, str] | None:
        """Why the engine cannot serve now, as (error code, message); None when it can."""
        error = self.error or self.client.error
        if error is None and not self.client.loaded.is_set():
            return "warming_up", "the engine is loading its model"
        if error is not None or not self.client.alive:
            return None, f"the engine is not running: {error!r}"
        if not self.client.ready.is_set():
            return "warming_up", "the engine is warming up (loading the model, compiling its kernels)"
        silent = self.client.heartbeat_age
        if silent > HEARTBEAT_STALE_S:
            return None, (f"the engine core has not reported for {silent:.0f} s (limit {HEARTBEAT_STALE_S:g} s): "
                          "it is stopped or frozen")
        if self.step_seconds > self.step_timeout_s:
            return None, (f"the engine's current step has run for {self.step_seconds:.0f} s (limit "
                          f"{self.step_timeout_s:g} s): the GPU or its driver may be hung")
        if self.failed_steps >= FAILING_STEPS:
            health = self.client.health()
            return None, (f"the engine's last {self.failed_steps} steps failed for every request: "
                          f"{health.last_failure}")
        return None

    # ------------------------------------------------------------------ requests
    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     encode=None) -> RequestStream:
        """Check and send a request; returns once the core took it (else raises InvalidRequest,
        QueueFull or EngineDead). Requests sent while the core loads wait for it."""
        await self.wait_loaded()
        if not self.alive:
            raise self.error or self.client.error or EngineDead("the engine core is not running")
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        request = self.processor.process(prompt_token_ids, params, rid, time.monotonic())
        try:
            self.client.add(request)  # in process the core answers here; else in a later message
        except QueueFull:
            self.metrics.rejected.labels("queue_full").inc()
            raise
        # from here the core has it (or will, in order): follow it
        stream = RequestStream(rid, self, encode)
        taken = asyncio.get_running_loop().create_future()
        self._streams[rid], self._taking[rid] = stream, taken
        self.output.add(request)
        try:
            await self._until_taken(taken)
        except BaseException:
            self._taking.pop(rid, None)
            if self._streams.pop(rid, None) is not None and self.output.drop(rid):
                self.client.abort([rid])  # harmless when the core never took it
            stream.finished = True
            raise
        return stream

    async def _until_taken(self, taken: asyncio.Future) -> None:
        while True:
            done, _ = await asyncio.wait((taken,), timeout=_TAKE_POLL_S)
            if done:
                return taken.result()
            if self.client.heartbeat_age > HEARTBEAT_STALE_S:
                raise EngineDead(f"the engine core has not answered for {self.client.heartbeat_age:.0f} s: it is "
                                 "stopped or frozen; retry later", "engine_unresponsive")
            if self.step_seconds > self.step_timeout_s:
                raise EngineDead(f"the engine's current step has run for {self.step_seconds:.0f} s: the GPU or its "
                                 "driver may be hung; retry later", "engine_unresponsive")

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self.output.drop(request_id):
            self.client.abort([request_id])
            self.metrics.requests.labels("abort").inc()

    def fail_open(self, exc: BaseException) -> None:
        """End every open request with ``exc`` now (the server's shutdown deadline) and abort them in
        the core."""
        self._fail_some(list(self._streams), exc)

    # ------------------------------------------------------------------ the core's messages
    async def _listen(self) -> None:
        while True:
            message = await self.client.get_output()
            try:
                self._handle(message)
            except Exception as exc:  # a bug in one message's handling: said, its requests failed, the listener goes on
                held = self._faults.allow()
                if held is not None:
                    log.exception("handling the engine core's message failed: %r%s", exc, OncePer.since(held))
                self._fail_some([o.request_id for o in message.outputs] + message.accepted,
                                EngineDead(f"the server failed on the engine's output: {exc!r}"))

    def _fail_some(self, request_ids: list[str], exc: BaseException) -> None:
        failed = []
        for rid in request_ids:
            taken, stream = self._taking.pop(rid, None), self._streams.pop(rid, None)
            if taken is not None and not taken.done():
                taken.set_exception(exc)
            if stream is not None:
                stream.fail(exc)
            if self.output.drop(rid):
                failed.append(rid)
        if failed and self.client.alive:
            self.client.abort(failed)

    def _listener_ended(self, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        self.error = EngineDead(f"the server stopped listening to the engine core: {exc!r}")
        log.error("%s", self.error, exc_info=exc)
        self.fail_open(self.error)

    def _handle(self, msg: CoreOutputs) -> None:
        if msg.timestamp:  # the core's clock is this host's monotonic clock
            self.metrics.output_delay.observe(max(0.0, time.monotonic() - msg.timestamp))
        for rid in msg.accepted:
            taken = self._taking.pop(rid, None)
            if taken is not None and not taken.done():
                taken.set_result(None)
        for rejection in msg.rejected:
            rid = rejection.request_id
            taken = self._taking.pop(rid, None)
            if taken is None:
                # no submission waits for this answer: one given up on (its client left, the core was
                # silent), or a second one of a running request that this server never sent, which
                # the core refused without touching the request it runs
                if rid in self._streams:
                    log.error("the engine core refused a second submission of running request %r (%s: %s); "
                              "its stream goes on", rid, rejection.reason, rejection.message)
                continue
            self.metrics.rejected.labels(rejection.reason).inc()
            self._streams.pop(rid, None)
            self.output.drop(rid)
            if not taken.done():
                exc = QueueFull(rejection.message) if rejection.reason == "queue_full" else \
                    InvalidRequest(rejection.message)
                taken.set_exception(exc)
        if msg.step is not None:
            self.metrics.observe_step(msg.step, self.client.facts.itl_slo_ms)
        if not msg.outputs:
            return
        outputs, ended_here = self.output.process(msg)
        if ended_here:  # a stop string (or an undecodable token) ended them here: the core still runs them
            self.client.abort(ended_here)
        now = time.monotonic()
        observe, streams, tokens = self.metrics.observe, self._streams, 0
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            observe(out, now, stream.last_token_time)
            tokens += len(out.new_token_ids)
            stream.last_token_time = now
            if out.finished:
                del streams[out.request_id]
            stream.put(out)
        self.metrics.generation_tokens.inc(tokens)
