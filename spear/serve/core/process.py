"""The engine core in a process of its own (``spear serve``), driven by the HTTP server over a link
of its own.

    API server process                                          engine-core process
    HTTP; input processor (checks, tokenization);  --CoreRequest, Abort, Stop-->   EngineCore: scheduler,
    output processor (text, stop strings); SSE     <--CoreOutputs (one a step)--   model runner, sampler,
    (frontend/async_llm.py, mp_client.py)         <--CoreHealth every 0.25 s--   tensor-parallel ranks

The messages are core/messages.py's Structs, signed and numbered with the server's secret, on two
socket pairs whose ends the core gets from the server (core/wire.py says what that holds against):
one for the requests and the outputs, one for the heartbeats. They have no name: no other process
can connect to them, and no folder or name is left behind a killed server. Under ``spear serve``
the core's process is forked from the server's sealed start (core/zygote.py) and is non-dumpable
from its first instruction; a spawned one makes itself so before it imports the engine
(``sealed_start``).

A thread of the core sends ``CoreHealth`` every ``HEARTBEAT_S`` whatever the engine does, so the
server tells a step that runs too long, a core that stopped (SIGSTOP, a frozen host) and a quiet
one apart. The core never waits on the server: its outputs are written by a thread of their own
behind a queue of no limit, so a slow or vanished client costs it nothing but memory. Torch's
threads are the core's: it runs on ``CoreSpec.torch_threads`` (the server's process, which computes
nothing with torch, on one).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from spear.serve.config import EngineConfig
from spear.serve.core.messages import (Abort, CoreHealth, CoreOutputs, CoreRequest, Failed, Loaded, Ready, Rejection,
                                       Stop, ToCore)
from spear.serve.core.wire import FROM_CORE, HEARTBEAT, TO_CORE, FrameReader, FrameSender, FrameWriter, Malformed, Wire
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
    # the core's ends of the link's socket pairs (passed to its process alone): requests and outputs, heartbeats
    link: socket.socket | None = field(repr=False, compare=False)
    beat: socket.socket | None = field(repr=False, compare=False)
    secret: bytes = field(repr=False)
    log_level: str = "info"


_PR_SET_PDEATHSIG, _PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 1, 3, 4


def _prctl(option: int, arg: int = 0) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.prctl(option, arg, 0, 0, 0)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}): {os.strerror(err)}")
    return result


def forbid_inspection() -> int | None:
    """Make this process non-dumpable (Linux; nothing elsewhere): a process of the same user without
    CAP_SYS_PTRACE can then no longer ptrace it, open its /proc/<pid>/mem or take its descriptors,
    and it leaves no core dump (core/wire.py says what that holds). Returns the pid of a process
    that traces this one already (it keeps its hold, and is worth a warning), else None."""
    if not sys.platform.startswith("linux"):
        return None
    _prctl(_PR_SET_DUMPABLE, 0)
    with open("/proc/self/status") as f:
        tracer = next((int(line.split()[1]) for line in f if line.startswith("TracerPid:")), 0)
    return tracer or None


def dumpable() -> bool | None:
    """Whether this process is dumpable (None where the system does not say)."""
    return bool(_prctl(_PR_GET_DUMPABLE)) if sys.platform.startswith("linux") else None


# The core's process runs this first. Its multiprocessing target is the builtin ``exec``, which
# takes nothing of spear's to find, so the process makes itself non-dumpable before it unpickles
# the core's target and spec, whose imports (the engine, torch) take seconds; until then a process
# of the user may open its memory (core/wire.py). The link's sockets come apart from the spec.
_SEALED_START = """
import ctypes, sys
if sys.platform.startswith("linux") and ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
import dataclasses, pickle
target, spec = pickle.loads(blob)
target(dataclasses.replace(spec, link=link, beat=beat))
"""


def sealed_start(target, spec: CoreSpec) -> tuple:
    """multiprocessing's (target, args) that run ``target(spec)`` in a process that is non-dumpable
    before it imports anything of the engine."""
    blob = pickle.dumps((target, dataclasses.replace(spec, link=None, beat=None)))
    return exec, (_SEALED_START, {"blob": blob, "link": spec.link, "beat": spec.beat})


def _die_with_parent() -> None:
    """Ask Linux to end this process when the server's process ends (elsewhere the main loop's watch
    of the parent's pid is all there is)."""
    if sys.platform.startswith("linux"):
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Heartbeat(threading.Thread):
    """Sends the core's health every HEARTBEAT_S on a socket of its own (read by a thread of the
    server's own, whatever its event loop does); reads the loop's fields, which only the loop writes."""

    def __init__(self, proc: "_CoreProcess"):
        super().__init__(name="spear-core-heartbeat", daemon=True)
        self.out = FrameWriter(proc.spec.beat)
        self.wire = Wire(proc.spec.secret, CoreHealth, sends=HEARTBEAT)  # numbered apart from the loop's frames
        self.proc, self.stopping = proc, threading.Event()

    def run(self) -> None:
        # a server that does not read blocks this thread only (its socket's buffer holds minutes of beats)
        while True:
            try:
                self.out.write(self.wire.pack(self.proc.health()))
            except OSError:  # the server is gone
                return
            if self.stopping.wait(HEARTBEAT_S):
                return


class _CoreProcess:
    def __init__(self, spec: CoreSpec):
        self.spec = spec
        self.wire = Wire(spec.secret, ToCore, sends=FROM_CORE, receives=TO_CORE)
        self.commands = FrameReader(spec.link)
        self.outbox = FrameSender(spec.link, "spear-core-outbox")  # never blocks on the server
        self.core = None
        self.ready = False
        self.bad = OncePer()
        self.dropped = {"malformed": 0, "replayed": 0}  # the server's frames dropped, by reason

    def send(self, message) -> None:
        self.outbox.send(self.wire.pack(message))

    def health(self) -> CoreHealth:
        core, dropped = self.core, {k: n for k, n in self.dropped.items() if n}
        if core is None:
            return CoreHealth(ready=False, step_started=None, failed_steps=0, last_failure=None, stats=None,
                              frames_dropped=dropped)
        return CoreHealth(ready=self.ready, step_started=core.step_started, failed_steps=core.num_failed_steps,
                          last_failure=core.last_failure, stats=core.stats(), frames_dropped=dropped)

    def _receive(self, frame: bytes):
        """The message of ``frame``; None for a malformed, unsigned or replayed one (counted; logged
        once a minute)."""
        try:
            return self.wire.unpack(frame)
        except Malformed as exc:
            self.dropped[exc.reason] += 1
            held = self.bad.allow()
            if held is not None:
                log.error("dropped %s%s", exc, OncePer.since(held))
            return None

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
        core = self.core
        warm = core.warmup()
        # what is alive now lives as long as the core: out of the collector's sweeps, whose pauses over
        # the model's objects would stall steps
        gc.collect()
        gc.freeze()
        self.ready = True
        self.send(Ready(warm))
        while True:
            if os.getppid() != self.spec.parent_pid:  # the server is gone
                log.warning("the server process went away; the engine core stops")
                return
            if not core.has_unfinished():
                self.commands.wait(1.0)
            try:
                accepted, rejected, stop = self._commands()
            except EOFError:
                log.warning("the server closed the link; the engine core stops")
                return
            if accepted or rejected:  # answered at once: the server's handlers wait for it, not for a step
                self.send(CoreOutputs(accepted=accepted, rejected=rejected, timestamp=time.monotonic()))
            if stop:
                return
            if core.has_unfinished():
                outputs = core.step()
                self.send(CoreOutputs(outputs=outputs, timestamp=time.monotonic(), step=core.last_step))

    def _commands(self) -> tuple[list[str], list[Rejection], bool]:
        """Every command that has arrived, in order, up to a Stop; EOFError once the server closed the link."""
        from spear.errors import SpearError
        from spear.serve.core.scheduler import QueueFull

        accepted, rejected = [], []
        for frame in self.commands.frames():
            msg = self._receive(frame)
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
        return accepted, rejected, False

    def close(self) -> None:
        if self.core is not None:
            self.core.close()
        self.outbox.close(linger=2.0)
        self.spec.link.close()
        self.spec.beat.close()


def core_main(spec: CoreSpec) -> None:
    """The engine-core process: build the engine, report, serve commands until told to stop or
    until the server's process is gone."""
    tracer = forbid_inspection()  # sealed_start's already; here for the look for a tracer (and other callers)
    # Ctrl-C reaches the whole process group: the server drains its requests, then stops the core
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if tracer is not None:
        log.warning("process %d traces the engine core: it can read every request and the link's secret", tracer)
    import torch

    torch.set_num_threads(spec.torch_threads)
    proc = _CoreProcess(spec)
    beat = None
    try:
        beat = _Heartbeat(proc)
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
