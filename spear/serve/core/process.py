"""The engine core in a process of its own (``spear serve``), driven over ZeroMQ by the HTTP server.

    API server process                                          engine-core process
    HTTP; input processor (checks, tokenization);  --CoreRequest, Abort, Stop-->   EngineCore: scheduler,
    output processor (text, stop strings); SSE     <--CoreOutputs (one a step)--   model runner, sampler,
    (frontend/async_llm.py, zmq_client.py)         <--CoreHealth every 0.25 s--   tensor-parallel ranks

The messages are core/messages.py's Structs, signed with the server's secret (core/wire.py). The
sockets are IPC paths in a folder only the user can enter; each receiver binds its PULL socket and
each sender connects a PUSH (the core binds its inbox, the server the outputs' and the
heartbeat's), so another process could only connect to send, and what it sends is not signed. The
core removes its inbox's name when the server's ``Hello`` arrives (the two are connected), the
server the other names at the core's first messages: within a second or two of the start no name
is left to connect to, and a killed server leaves no folder behind it.

A thread of the core sends ``CoreHealth`` every ``HEARTBEAT_S`` whatever the engine does, so the
server tells a step that runs too long, a core that stopped (SIGSTOP, a frozen host) and a quiet
one apart. The core never waits on the server: its sockets have no send limit, so a slow or
vanished client costs it nothing but memory in the server. Torch's threads are the core's: it
runs on ``CoreSpec.torch_threads`` (the server's process, which computes nothing with torch, on one).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from spear.serve.config import EngineConfig
from spear.serve.core.messages import (Abort, CoreHealth, CoreOutputs, CoreRequest, Failed, Hello, Loaded, Ready,
                                       Rejection, Stop, ToCore)
from spear.serve.core.wire import Malformed, Wire
from spear.serve.faults import OncePer

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25


@dataclass(frozen=True, kw_only=True)
class CoreSpec:
    """What the core process needs to build its engine and reach the server (picklable)."""

    model: str                          # a folder, or the embedded default's name
    config: EngineConfig
    dtype: str | None                   # "float16", ...; None: the engine's default for the device
    device: str | None                  # "cpu", "cuda", "cuda:N"; None: cuda when available
    verify: bool
    eos_token_ids: tuple[int, ...]      # the tokenizer's, beside the model's own
    torch_threads: int
    parent_pid: int
    inbox: str                          # ZeroMQ addresses (ipc://...): the core binds the inbox
    outbox: str
    heartbeat: str
    secret: bytes = field(repr=False)
    log_level: str = "info"


def ipc_path(address: str) -> str:
    return address.removeprefix("ipc://")


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

    def __init__(self, ctx, proc: "_CoreProcess"):
        super().__init__(name="spear-core-heartbeat", daemon=True)
        import zmq

        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(proc.spec.heartbeat)
        self.wire = Wire(proc.spec.secret, ToCore)  # an encoder of its own: the loop's is the loop's
        self.proc, self.stopping = proc, threading.Event()

    def run(self) -> None:
        import zmq

        while True:
            try:
                self.sock.send(self.wire.pack(self.proc.health()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if self.stopping.wait(HEARTBEAT_S):
                break
        self.sock.close()


class _CoreProcess:
    def __init__(self, spec: CoreSpec):
        import zmq

        self.spec = spec
        self.wire = Wire(spec.secret, ToCore)
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(spec.inbox)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)   # never block on the server
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(spec.outbox)
        self.core = None
        self.ready = False
        self.bad = OncePer()

    def send(self, message) -> None:
        import zmq

        self.outbox.send(self.wire.pack(message), zmq.NOBLOCK, copy=False)

    def health(self) -> CoreHealth:
        core = self.core
        if core is None:
            return CoreHealth(ready=False, step_started=None, failed_steps=0, last_failure=None, stats=None)
        return CoreHealth(ready=self.ready, step_started=core.step_started, failed_steps=core.num_failed_steps,
                          last_failure=core.last_failure, stats=core.stats())

    def _receive(self, frame: bytes):
        """The message of ``frame``; None for a malformed or unsigned one (logged once a minute)."""
        try:
            return self.wire.unpack(frame)
        except Malformed as exc:
            held = self.bad.allow()
            if held is not None:
                log.error("dropped %s%s", exc, OncePer.since(held))
            return None

    def await_server(self) -> None:
        """Until the server's Hello arrives; then no other process may connect to the inbox."""
        while not (self.inbox.poll(1000) and isinstance(self._receive(self.inbox.recv()), Hello)):
            if os.getppid() != self.spec.parent_pid:
                raise SystemExit(1)
        try:
            os.unlink(ipc_path(self.spec.inbox))
        except OSError:
            pass
        self.send(Hello())

    def build(self) -> None:
        import torch

        from spear.serve.core.engine import EngineCore

        spec = self.spec
        self.core = EngineCore.from_pretrained(spec.model, spec.config,
                                               dtype=None if spec.dtype is None else getattr(torch, spec.dtype),
                                               device=spec.device, verify=spec.verify)
        self.core.stop_on(spec.eos_token_ids)
        self.send(Loaded(self.core.facts()))

    def run(self) -> None:
        import zmq

        core = self.core
        warm = core.warmup()
        # what is alive now lives as long as the core: out of the collector's sweeps, whose pauses over
        # the model's objects would stall steps
        gc.collect()
        gc.freeze()
        self.ready = True
        self.send(Ready(warm))
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            if os.getppid() != self.spec.parent_pid:  # the server is gone
                log.warning("the server process went away; the engine core stops")
                return
            if not core.has_unfinished():
                poller.poll(1000)
            accepted, rejected, stop = self._commands()
            if accepted or rejected:  # answered at once: the server's handlers wait for it, not for a step
                self.send(CoreOutputs(accepted=accepted, rejected=rejected, timestamp=time.monotonic()))
            if stop:
                return
            if core.has_unfinished():
                outputs = core.step()
                self.send(CoreOutputs(outputs=outputs, timestamp=time.monotonic(), step=core.last_step))

    def _commands(self) -> tuple[list[str], list[Rejection], bool]:
        import zmq

        from spear.errors import SpearError
        from spear.serve.core.scheduler import QueueFull

        accepted, rejected = [], []
        while True:
            try:
                msg = self._receive(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return accepted, rejected, False
            if isinstance(msg, CoreRequest):
                try:
                    self.core.add(msg)
                    accepted.append(msg.request_id)
                except QueueFull as exc:
                    rejected.append(Rejection(msg.request_id, "queue_full", str(exc)))
                except SpearError as exc:
                    rejected.append(Rejection(msg.request_id, "invalid", str(exc)))
            elif isinstance(msg, Abort):
                self.core.abort(msg.request_ids)
            elif isinstance(msg, Stop):
                return accepted, rejected, True

    def close(self) -> None:
        if self.core is not None:
            self.core.close()
        self.inbox.close()
        self.outbox.close()
        self.ctx.term()


def core_main(spec: CoreSpec) -> None:
    """The engine-core process: build the engine, report, serve commands until told to stop or
    until the server's process is gone."""
    # Ctrl-C reaches the whole process group: the server drains its requests, then stops the core
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(spec.torch_threads)
    proc = _CoreProcess(spec)
    beat = None
    try:
        proc.await_server()
        beat = _Heartbeat(proc.ctx, proc)
        beat.start()
        try:
            proc.build()
        except BaseException as exc:  # a bad model, out of memory, a refused config: say so and exit
            from spear.errors import SpearError

            log.debug("engine start failed", exc_info=True)
            proc.send(Failed(str(exc) if isinstance(exc, SpearError) else f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from None
        proc.run()
    finally:
        gc.unfreeze()
        if beat is not None:
            beat.stopping.set()
            beat.join(2)
        proc.close()
