"""The engine in a thread of the HTTP server's process: one background thread owns the LLMEngine.

``spear serve`` runs the engine in a process of its own (client.py, core.py); this in-process
frontend offers the server the same interface, for tests and for embedding the server.

Request handlers never touch the engine. They post commands (add, abort) to a
queue; the engine thread applies them between steps, runs ``step()``, and hands
each output to its request's ``asyncio.Queue`` on the handler's event loop. So the
event loop never waits for a model step (torch releases the GIL while it computes),
and the engine needs no locks.

    stream = await async_engine.submit(prompt_ids, params)   # raises SpearError / QueueFull
    async for out in stream: ...                              # RequestOutput deltas
    stream.abort()                                            # e.g. the client went away
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid

from spear.serve.core.engine import LLMEngine
from spear.serve.core.outputs import EngineStats, RequestOutput
from spear.serve.api.metrics import ServingMetrics
from spear.serve.core.scheduler import QueueFull
from spear.serve.core.sequence import SamplingParams
from spear.serve.frontend.stream import STEP_TIMEOUT_S, EngineDead, Frontend, RequestStream

log = logging.getLogger(__name__)

_ACCEPTED = object()


class AsyncEngine(Frontend):
    def __init__(self, engine: LLMEngine, metrics: ServingMetrics | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S):
        super().__init__(metrics, step_timeout_s)
        self.engine = engine
        self._step_started: float | None = None  # monotonic time the running step began
        self.stats: EngineStats = engine.stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._last_token: dict[str, float] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spear-engine", daemon=True)
        self._loop_failures = 0                 # steps in a row that raised out of the engine
        self.last_failure: str | None = None    # the message of the last failed request or step
        self.loaded.set()                       # the model is in place from the start

    # ------------------------------------------------------------------ what the handlers check against
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_token_ids, params)

    async def wait_loaded(self) -> None:
        if self.error is not None:
            raise EngineDead(f"the engine is not running: {self.error!r}")

    def fail_open(self, exc: BaseException) -> None:
        """End every open request with ``exc`` (the server's shutdown deadline)."""
        self._post(("fail", exc))

    # ------------------------------------------------------------------ handler side
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def step_seconds(self) -> float:
        """How long the step now running has run (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def failed_steps(self) -> int:
        """Steps in a row that failed every request they ran, or that raised."""
        return max(self._loop_failures, self.stats.num_failed_steps)

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it (else raises its SpearError / QueueFull)."""
        if not self.alive:
            raise EngineDead(f"the engine is not running: {self.error!r}")
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(rid, self)
        self._post(("add", rid, prompt_token_ids, params, time.monotonic(), asyncio.get_running_loop(), stream))
        while True:  # the engine answers between steps; a thread that died meanwhile never will
            try:
                first = await asyncio.wait_for(stream.queue.get(), timeout=1.0)
                break
            except asyncio.TimeoutError:
                if not self._thread.is_alive():
                    raise EngineDead(f"the engine is not running: {self.error!r}") from None
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        return stream

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.warmup_seconds = self.engine.warmup()  # requests wait in the queue meanwhile
            self.ready.set()
            while not self._stopping.is_set():
                self._wake.clear()  # before draining: a command posted after this wakes the wait below
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._publish_stats()
                    self._wake.wait(timeout=1.0)
                    continue
                self._step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # outside any request (the engine isolates theirs): fail all, go on
                    log.exception("engine step failed; failing %d requests", len(self._streams))
                    self._loop_failures += 1
                    self.last_failure = repr(exc)
                    self._fail_all(exc)
                    self.engine.abort_all()  # nothing may stay scheduled that nobody waits for
                    self._publish_stats()
                    continue
                finally:
                    self._step_started = None
                self._loop_failures = 0
                self._deliver(outputs)
                self._publish_stats()
        except BaseException as exc:
            self.error = exc
            log.exception("engine thread stopped")
        # Nobody will step any more: answer every open and every queued request.
        dead = EngineDead(f"the engine stopped: {self.error!r}" if self.error else "the server is shutting down")
        self._fail_all(dead)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._send(cmd[5], cmd[6], dead)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "fail":
                self._fail_all(cmd[1])
                continue
            if cmd[0] == "add":
                _, rid, ids, params, arrival, loop, stream = cmd
                try:
                    self.engine.add_request(ids, params, request_id=rid, arrival_time=arrival)
                except Exception as exc:  # SpearError (bad request) or QueueFull: the handler answers
                    self.metrics.rejected.labels("queue_full" if isinstance(exc, QueueFull) else "invalid").inc()
                    self._send(loop, stream, exc)
                    continue
                self._streams[rid] = (loop, stream)
                self._send(loop, stream, _ACCEPTED)
            else:
                rid = cmd[1]
                if self.engine.abort(rid):
                    self.metrics.requests.labels("abort").inc()
                self._streams.pop(rid, None)
                self._last_token.pop(rid, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            if out.error is not None:
                self.last_failure = out.error
            self.metrics.observe(out, now, self._last_token.get(rid))
            self._last_token[rid] = now
            target = self._streams.get(rid)
            if out.finished:
                self._streams.pop(rid, None)
                self._last_token.pop(rid, None)
            if target is not None:
                self._send(*target, out)

    def _send(self, loop: asyncio.AbstractEventLoop, stream: RequestStream, item) -> None:
        try:
            loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            if stream.request_id in self._streams:
                self.engine.abort(stream.request_id)
                self._streams.pop(stream.request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, (loop, stream) in list(self._streams.items()):
            self.engine.abort(rid)
            self._send(loop, stream, exc)
        self._streams.clear()
        self._last_token.clear()

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()
        self.metrics.set_stats(self.stats)
