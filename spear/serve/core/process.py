"""The engine core: ``LLMEngine`` in a process of its own, driven by the HTTP server's process.

    API server process                         engine-core process
    HTTP, validation, tokenization,   --add/abort/stop-->   scheduler, model runner, sampler,
    detokenization, stop strings,     <--one message/step--  tensor-parallel ranks (workers.py)
    streaming (client.py)

The two talk over ZeroMQ sockets on IPC paths, messages packed with msgpack: a PUSH/PULL pair
each way, and a second core-to-server pair for a heartbeat that a thread of the core sends every
``HEARTBEAT_S`` whatever the engine is doing (so the server can tell a step that has run too long,
or a core that died, from a quiet one). The core never waits on the server: its sockets have no
send limit, so a slow or vanished client costs it nothing but memory in the server's process.

Messages, core to server (lists):
  ["loaded", info]                 the model is in place (``info``: the engine's facts the server
                                   checks requests against); the warm-up starts
  ["ready", warmup_seconds]        requests are served from now on
  ["failed", message]              the engine could not start; the process exits
  ["step", outputs, accepted, rejected]
                                   one engine step: every request's new tokens ``[rid, new ids,
                                   finished, finish_reason, error, first_token_time]``, the
                                   requests admitted since the last message and those refused
                                   ``[rid, "queue_full" | "invalid", message]``
  ["health", {...}]                the heartbeat: the running step's start, failures, EngineStats
Server to core:
  ["add", rid, prompt ids, sampling fields, arrival]   ["abort", [rids]]   ["stop"]

Stop strings are the server's (it detokenizes): the core runs ``LLMEngine(detokenize=False)`` and
ends a request on EOS, its stop token ids or its length; when the server sees a stop string it
finishes the request itself and aborts it here.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25


@dataclass(frozen=True)
class CoreSpec:
    """What the core process needs to build its engine (picklable)."""

    model: str                     # a folder, or the embedded default's name
    config: object                 # spear.serve.config.EngineConfig
    dtype: str | None              # "float16", ...; None: the engine's default for the device
    device: str | None             # "cpu", "cuda", "cuda:N"; None: cuda when available
    verify: bool
    parent_pid: int
    to_core: str                   # ZeroMQ addresses (ipc://...)
    from_core: str
    heartbeat: str
    log_level: str = "info"


def pack(message) -> bytes:
    import msgpack

    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes):
    import msgpack

    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def sampling_fields(params) -> dict:
    """The fields of a SamplingParams the core needs (stop strings stay with the server)."""
    return {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "seed": params.seed, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos}


def _die_with_parent() -> None:
    """Ask Linux to end this process when the server's process ends (best effort elsewhere: the
    main loop also watches the parent's pid)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Heartbeat(threading.Thread):
    """Sends the core's health every HEARTBEAT_S on a socket of its own (ZeroMQ sockets are not
    shared between threads); reads the loop's fields, which only the loop writes."""

    def __init__(self, ctx, address: str, core: "_Core"):
        super().__init__(name="spear-core-heartbeat", daemon=True)
        import zmq

        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.core, self.stopping = core, threading.Event()

    def run(self) -> None:
        import zmq

        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self.sock.send(pack(["health", self.core.health()]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.sock.close()


class _Core:
    def __init__(self, spec: CoreSpec):
        import zmq

        self.spec = spec
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.connect(spec.to_core)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)   # never block on the server
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(spec.from_core)
        self.engine = None
        self.step_started: float | None = None
        self.loop_failures = 0
        self.last_failure: str | None = None
        self.ready = False

    def send(self, message) -> None:
        import zmq

        self.outbox.send(pack(message), zmq.NOBLOCK)

    def health(self) -> dict:
        eng = self.engine
        stats = None if eng is None else _stats(eng.stats())
        failed = self.loop_failures if eng is None else max(self.loop_failures, eng.num_failed_steps)
        return {"ready": self.ready, "step_started": self.step_started, "failed_steps": failed,
                "last_failure": self.last_failure, "stats": stats}

    def build(self) -> None:
        import torch

        from spear.serve.core.engine import LLMEngine

        dtype = None if self.spec.dtype is None else getattr(torch, self.spec.dtype)
        self.engine = eng = LLMEngine.from_pretrained(self.spec.model, self.spec.config, dtype=dtype,
                                                      device=self.spec.device, verify=self.spec.verify,
                                                      detokenize=False)
        sched = eng.scheduler
        latency = None
        if sched.itl_slo_ms is not None:
            t = sched.latency
            latency = {"created": str(t.created), "device": str(t.deployment.device), "margin": t.margin}
        self.send(["loaded", {
            "max_model_len": eng.max_model_len, "vocab_size": eng.model.config.vocab_size,
            "eos_ids": sorted(int(i) for i in eng.eos_ids), "num_blocks": eng.block_manager.num_blocks,
            "block_size": eng.config.block_size, "tensor_parallel_size": eng.config.tensor_parallel_size,
            "load_report": [list(r) for r in eng.load_report], "itl_slo_ms": sched.itl_slo_ms,
            "min_chunk_tokens": eng.config.min_chunk_tokens, "latency": latency}])

    def run(self) -> None:
        import zmq

        eng = self.engine
        warm = eng.warmup()
        self.ready = True
        self.send(["ready", warm])
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            if os.getppid() != self.spec.parent_pid:  # the server is gone
                log.warning("the server process went away; the engine core stops")
                return
            busy = eng.has_unfinished()
            if not busy:
                poller.poll(1000)
            accepted, rejected, stop = self._commands()
            if stop:
                return
            outputs = self._step() if eng.has_unfinished() else []
            if outputs or accepted or rejected:
                self.send(["step", outputs, accepted, rejected])

    def _commands(self) -> tuple[list, list, bool]:
        import zmq

        from spear.errors import SpearError
        from spear.serve.core.scheduler import QueueFull
        from spear.serve.core.sequence import SamplingParams

        accepted, rejected = [], []
        while True:
            try:
                msg = unpack(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return accepted, rejected, False
            if msg[0] == "stop":
                return accepted, rejected, True
            if msg[0] == "abort":
                for rid in msg[1]:
                    self.engine.abort(rid)
                continue
            _, rid, ids, fields, arrival = msg
            try:
                self.engine.add_request(ids, SamplingParams(**fields), request_id=rid, arrival_time=arrival)
                accepted.append(rid)
            except QueueFull as exc:
                rejected.append([rid, "queue_full", str(exc)])
            except (SpearError, TypeError, ValueError) as exc:
                rejected.append([rid, "invalid", str(exc)])

    def _step(self) -> list:
        self.step_started = time.monotonic()
        try:
            outs = self.engine.step()
        except Exception as exc:  # outside any request (the engine isolates theirs): fail all, go on
            log.exception("engine step failed; failing every request")
            self.loop_failures += 1
            self.last_failure = repr(exc)
            message = f"the engine step failed: {exc!r}"
            return [[rid, [], True, "error", message, None] for rid in self.engine.abort_all()]
        finally:
            self.step_started = None
        self.loop_failures = 0
        packed = []
        for o in outs:
            if o.error is not None:
                self.last_failure = o.error
            packed.append([o.request_id, list(o.new_token_ids), o.finished, o.finish_reason, o.error,
                           o.first_token_time])
        return packed


def _stats(stats) -> dict:
    d = asdict(stats)
    d["latency_correction"] = {str(k): v for k, v in d["latency_correction"].items()}
    return d


def core_main(spec: CoreSpec) -> None:
    """The engine-core process: build the engine, report, serve commands until told to stop or
    until the server's process is gone."""
    # Ctrl-C reaches the whole process group: the server drains its requests, then stops the core
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    core = _Core(spec)
    beat = _Heartbeat(core.ctx, spec.heartbeat, core)
    beat.start()
    try:
        try:
            core.build()
        except BaseException as exc:  # a bad model, out of memory, a refused config: say so and exit
            from spear.errors import SpearError

            log.debug("engine start failed", exc_info=True)
            core.send(["failed", str(exc) if isinstance(exc, SpearError) else f"{type(exc).__name__}: {exc}"])
            raise SystemExit(1) from None
        core.run()
    finally:
        beat.stopping.set()
        beat.join(2)
        if core.engine is not None:
            core.engine.close()
        core.inbox.close()
        core.outbox.close()
        core.ctx.term()
