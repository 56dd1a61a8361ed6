"""The HTTP server's side of the engine core (core.py): ``EngineClient``.

It starts the engine-core process, sends it requests and aborts, and turns each step's message
into ``RequestOutput``s: it detokenizes here (one ``IncrementalDetokenizer`` per request, with
the request's stop strings), finishes a request whose text reached a stop string and aborts it
in the core. It offers what the server's handlers use of an engine, as ``AsyncEngine`` (the
in-process variant, async_engine.py) does: ``submit`` / ``abort``, the request's checks, the
tokenizer, ``/health``'s facts and the metrics.

Everything runs on the server's event loop, except the wait for the core's process, which a
thread watches: a core that exits fails every open request with ``EngineDead`` at once and
turns ``/health`` 503, and no request waits on it again.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import uuid

from spear.errors import SpearError
from spear.serve.core import process as _core
from spear.serve.frontend.detokenizer import IncrementalDetokenizer
from spear.serve.api.metrics import ServingMetrics
from spear.serve.core.outputs import EngineStats, RequestOutput, StepRecord
from spear.serve.core.scheduler import QueueFull
from spear.serve.core.sequence import SamplingParams, check_prompt
from spear.serve.frontend.stream import STEP_TIMEOUT_S, EngineDead, Frontend, RequestStream

log = logging.getLogger(__name__)


class _Request:
    """A request's state on the server's side."""

    __slots__ = ("stream", "params", "detok", "token_ids", "num_prompt", "arrival", "first_token_time",
                 "last_token", "accepted")

    def __init__(self, stream: RequestStream, ids: list[int], params: SamplingParams, tokenizer, arrival: float):
        self.stream, self.params = stream, params
        self.detok = IncrementalDetokenizer(tokenizer, ids, params.stop)
        self.token_ids = list(ids)
        self.num_prompt = len(ids)
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token: float | None = None
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()


class EngineClient(Frontend):
    """The engine core (``CoreSpec``'s model and EngineConfig) in a process of its own."""

    def __init__(self, model: str, config, tokenizer, dtype: str | None = None, device: str | None = None,
                 verify: bool = False, metrics: ServingMetrics | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S, log_level: str = "info", on_loaded=None):
        super().__init__(metrics, step_timeout_s)
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.dtype, self.device, self.verify, self.log_level = dtype, device, verify, log_level
        self.on_loaded = on_loaded            # called with the core's facts once the model is in place
        self.info: dict | None = None         # the core's facts (max_model_len, vocabulary, ...)
        self.stats = EngineStats(0, 0, 0.0, 0, 0)
        self._health: dict = {}
        self._requests: dict[str, _Request] = {}
        self._proc = None
        self._dir: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        """Start the core process and the tasks that listen to it (on the running loop)."""
        import zmq
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="spear-core-")
        addr = {name: f"ipc://{os.path.join(self._dir, name)}" for name in ("to_core", "from_core", "heartbeat")}
        self._ctx = zmq.asyncio.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(addr["to_core"])
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(addr["from_core"])
        self._beat = self._ctx.socket(zmq.PULL)
        self._beat.bind(addr["heartbeat"])
        spec = _core.CoreSpec(self.model, self.config, self.dtype, self.device, self.verify, os.getpid(),
                              addr["to_core"], addr["from_core"], addr["heartbeat"], self.log_level)
        self._proc = mp.get_context("spawn").Process(target=_core.core_main, args=(spec,), name="spear-engine-core")
        self._proc.start()
        self._tasks = [asyncio.create_task(self._listen(self._in)), asyncio.create_task(self._listen(self._beat))]
        threading.Thread(target=self._watch, args=(self._proc,), name="spear-core-watch", daemon=True).start()

    def _watch(self, proc) -> None:
        proc.join()
        if not self._closing:
            code = proc.exitcode
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._died, code)

    def _died(self, code) -> None:
        if self.error is None:
            self.error = EngineDead(f"the engine core exited (code {code})" if self.loaded.is_set() or code
                                    else "the engine core exited before it started")
            log.error("%s", self.error)
        self._fail_all(self.error)
        if not self.loaded.is_set() and self.on_fatal is not None:
            self.on_fatal()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to stop (it stops the tensor-parallel ranks), wait up to ``timeout`` s,
        then end it; fail whatever is still open."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                self._out.send(_core.pack(["stop"]))
            except Exception:  # the socket or the context is gone already
                pass
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                log.warning("the engine core did not stop in %.0f s; terminating it", timeout)
                proc.terminate()
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
        self._fail_all(EngineDead("the server is shutting down"))
        for t in self._tasks:
            t.cancel()
        for sock in (getattr(self, "_out", None), getattr(self, "_in", None), getattr(self, "_beat", None)):
            if sock is not None:
                sock.close(0)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ health
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self.error is None

    @property
    def step_seconds(self) -> float:
        started = self._health.get("step_started")
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    @property
    def failed_steps(self) -> int:
        return int(self._health.get("failed_steps") or 0)

    @property
    def last_failure(self) -> str | None:
        return self._health.get("last_failure")

    # ------------------------------------------------------------------ what the handlers check against
    @property
    def max_model_len(self) -> int:
        if self.info is None:
            raise EngineDead("the engine is still loading its model")
        return self.info["max_model_len"]

    async def wait_loaded(self) -> None:
        """Return once the core has loaded the model (its facts are known); EngineDead if it died."""
        while not self.loaded.is_set():
            if self.error is not None:
                raise self.error
            await asyncio.sleep(0.05)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise SpearError when the request cannot run (the engine's own checks, from its facts)."""
        check_prompt(prompt_token_ids, params, self.max_model_len, self.info["vocab_size"])

    # ------------------------------------------------------------------ requests
    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> RequestStream:
        """Queue a request; returns once the core accepted it (else raises its SpearError / QueueFull
        / EngineDead). Requests sent while the core warms up wait for it."""
        await self.wait_loaded()
        if not self.alive:
            raise self.error or EngineDead("the engine core is not running")
        self.check_request(prompt_token_ids, params)
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(rid, self)
        req = _Request(stream, prompt_token_ids, params, self.tokenizer, time.monotonic())
        self._requests[rid] = req
        self._out.send(_core.pack(["add", rid, list(prompt_token_ids), _core.sampling_fields(params), req.arrival]))
        try:
            await req.accepted
        except BaseException:
            self._requests.pop(rid, None)
            stream.finished = True
            raise
        return stream

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None and self.alive:
            try:
                self._out.send(_core.pack(["abort", [request_id]]))
            except Exception:  # closing: the core is being stopped anyway
                pass
            self.metrics.requests.labels("abort").inc()

    # ------------------------------------------------------------------ the core's messages
    async def _listen(self, sock) -> None:
        while True:
            try:
                msg = _core.unpack(await sock.recv())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a closed socket at shutdown, or a malformed message
                if self._closing:
                    return
                log.error("engine core message: %r", exc)
                continue
            try:
                self._handle(msg)
            except Exception:
                log.exception("handling the engine core's %r message", msg[0])

    def _handle(self, msg: list) -> None:
        kind = msg[0]
        if kind == "step":
            self._step(*msg[1:])
        elif kind == "health":
            self._health = msg[1]
            if msg[1].get("stats") is not None:
                self._set_stats(msg[1]["stats"])
        elif kind == "loaded":
            self.info = msg[1]
            self.loaded.set()
            if self.on_loaded is not None:
                self.on_loaded(self.info)
        elif kind == "ready":
            self.warmup_seconds = msg[1]
            self.ready.set()
        elif kind == "failed":  # the caller reports it (spear serve: one line, exit 2)
            self.error = EngineDead(f"the engine could not start: {msg[1]}")
            self._fail_all(self.error)
            if self.on_fatal is not None:
                self.on_fatal()

    def _set_stats(self, d: dict) -> None:
        step = d.get("last_step")
        self.stats = EngineStats(d["num_running"], d["num_waiting"], d["kv_usage"], d["num_free_blocks"],
                                 d["num_preemptions"], d["num_failed_steps"], d["num_steps"],
                                 None if step is None else StepRecord(**step), d["itl_slo_ms"],
                                 {int(k): v for k, v in d["latency_correction"].items()})
        self.metrics.set_stats(self.stats)

    def _step(self, outputs: list, accepted: list, rejected: list) -> None:
        for rid in accepted:
            req = self._requests.get(rid)
            if req is not None and not req.accepted.done():
                req.accepted.set_result(None)
        for rid, why, message in rejected:
            req = self._requests.pop(rid, None)
            self.metrics.rejected.labels(why).inc()
            if req is not None and not req.accepted.done():
                req.accepted.set_exception(QueueFull(message) if why == "queue_full" else SpearError(message))
        now = time.monotonic()
        for rid, new_ids, finished, reason, error, first_token_time in outputs:
            req = self._requests.get(rid)
            if req is None:  # aborted here, or finished here on a stop string: the rest is dropped
                continue
            out = self._advance(req, rid, new_ids, finished, reason, error, first_token_time)
            self.metrics.observe(out, now, req.last_token)
            req.last_token = now
            if out.finished:
                self._requests.pop(rid, None)
                if not finished:  # a stop string, seen here: the core still runs it
                    self._out.send(_core.pack(["abort", [rid]]))
            req.stream.queue.put_nowait(out)

    def _advance(self, req: _Request, rid: str, new_ids: list[int], finished: bool, reason, error,
                 first_token_time) -> RequestOutput:
        if req.first_token_time is None:
            req.first_token_time = first_token_time
        taken = []
        for tok in new_ids:
            req.token_ids.append(tok)
            taken.append(tok)
            if req.detok.add(tok):  # the text reached a stop string: the request ends at this token
                finished, reason = True, "stop"
                break
        if error is not None:
            out = RequestOutput(rid, [], "", True, "error", req.num_prompt, req.arrival, req.first_token_time,
                                req.token_ids, len(req.token_ids), req.detok.text, req.detok.emitted)
            out.error = error
            return out
        new_text = req.detok.delta(final=finished)
        return RequestOutput(rid, taken, new_text, finished, reason, req.num_prompt, req.arrival,
                             req.first_token_time, req.token_ids, len(req.token_ids), req.detok.text,
                             req.detok.emitted)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, req in list(self._requests.items()):
            if not req.accepted.done():
                req.accepted.set_exception(exc)
            else:
                req.stream.queue.put_nowait(exc)
        self._requests.clear()

    def fail_open(self, exc: BaseException) -> None:
        """End every open request with ``exc`` now (the server's shutdown deadline) and abort them
        in the core."""
        rids = list(self._requests)
        self._fail_all(exc)
        if rids and self.alive:
            try:
                self._out.send(_core.pack(["abort", rids]))
            except Exception:
                pass
