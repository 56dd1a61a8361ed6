"""``MPClient``: the engine core in a process of its own (core/process.py), reached over a link of
its own (core/wire.py); what ``spear serve`` runs. The link is two socket pairs the core inherits,
which no other process can reach.

``start`` makes this process non-dumpable, makes the link's secret and its two socket pairs (the
requests and outputs; the heartbeats), and starts the core with its ends: under ``spear serve`` in
the child of the zygote its command line forked (core/zygote.py), non-dumpable from its first
instruction; elsewhere (a server embedded without the CLI) spawned, non-dumpable once its
interpreter has started (core/process.py ``sealed_start``, core/wire.py). Every frame is signed
and numbered (core/wire.py); one that is not signed for its channel, not one of the protocol's
messages or a replay is logged (once a minute, with a count), counted (``frames_dropped``, read by
/metrics) and dropped, and the listener goes on. The core's heartbeats are read by a thread of
their own, so their age says how long the core has been silent however busy the event loop is; a
thread also waits for the core's process, so that a core that exits fails every open request at
once (``on_error``). ``shutdown(timeout)`` gives the core ``timeout`` seconds to stop, then ends it
(SIGTERM, SIGKILL a second later): a frozen core costs the server no more than that.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import secrets
import socket
import threading
import time

from spear.serve.config import EngineConfig
from spear.serve.core.messages import Abort, CoreHealth, CoreOutputs, Failed, FromCore, Loaded, Ready, Stop
from spear.serve.core.process import CoreSpec, core_main, forbid_inspection, sealed_start
from spear.serve.core.wire import FROM_CORE, HEARTBEAT, LENGTH, TO_CORE, FrameReader, Malformed, Wire
from spear.serve.core.zygote import Zygote
from spear.serve.faults import OncePer
from spear.serve.frontend.client import CoreClient, EngineDead
from spear.serve.frontend.processor import InvalidRequest

log = logging.getLogger(__name__)

# A core that closed its end of the link has this long to exit (the watch then says how) before
# the server calls it dead while it still runs.
_CLOSED_LINK_GRACE_S = 5.0


# a core that drives a GPU computes nothing heavy with torch on the CPU: more threads only spin at
# their barriers beside the HTTP server's event loop and the clients on the same cores
_CUDA_CORE_THREADS = 2


def default_torch_threads(device: str | None = None) -> int:
    """The core's torch threads. On a CPU the cores this process may run on, but one for the HTTP
    server's process (torch's threads spin at their barriers: one without a core stalls every
    step); where the core runs on CUDA (``device`` cuda…, or None / "auto" with a GPU) a few."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    name = (device or "auto").lower()
    if name.startswith("cuda") or (name == "auto" and _gpu_present()):
        return max(1, min(_CUDA_CORE_THREADS, cpus - 1))
    return max(1, cpus - 1)


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


class MPClient(CoreClient):
    """The core (``EngineCore.from_pretrained``'s arguments, ``CoreSpec``) in a process of its own;
    ``on_loaded(facts)`` is called once the model is in place. ``target(spec)`` is what the core's
    process runs: ``core_main``, or a function that prepares the process and calls it (the tests'
    faults are injected so). ``zygote``: the process to run it in (``spear serve``'s); without one
    it is spawned."""

    def __init__(self, model: str, config: EngineConfig, *, dtype: str | None = None, device: str | None = None,
                 verify: bool = False, eos_token_ids: tuple[int, ...] = (), torch_threads: int | None = None,
                 log_level: str = "info", on_loaded=None, target=core_main, zygote: Zygote | None = None):
        super().__init__()
        self._target = target
        self._zygote = zygote
        self._args = dict(model=model, config=config, dtype=dtype, device=device, verify=verify,
                          eos_token_ids=tuple(eos_token_ids), log_level=log_level,
                          torch_threads=torch_threads or default_torch_threads(device))
        self.on_loaded = on_loaded
        self._health: CoreHealth | None = None
        self._beat_at = time.monotonic()
        self._bad = OncePer()
        # frames dropped, by reason: on the link (the event loop's) and the heartbeats (their thread's)
        self._dropped = {"malformed": 0, "replayed": 0}
        self._beats_dropped = {"malformed": 0, "replayed": 0}
        self._proc = None  # the core's: multiprocessing's Process, or the zygote's ForkedProcess
        self._reader = self._writer = None
        self._closing = False

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        tracer = forbid_inspection()  # spear serve did so already; here for every other server of a core
        if tracer is not None:
            log.warning("process %d traces this server: it can read every request and the link's secret", tracer)
        self._loop = asyncio.get_running_loop()
        secret = secrets.token_bytes(32)
        self._wire = Wire(secret, FromCore, sends=TO_CORE, receives=FROM_CORE)
        link, core_link = socket.socketpair()
        beat, core_beat = socket.socketpair()
        spec = CoreSpec(**self._args, parent_pid=os.getpid(), link=core_link, beat=core_beat, secret=secret)
        self._beat_at = time.monotonic()
        try:
            if self._zygote is not None:  # it gets its ends as descriptors over the zygote's own socket pair
                self._proc = self._zygote.start(self._target, spec)
            else:  # it inherits its ends (multiprocessing passes them to it alone)
                target, args = sealed_start(self._target, spec)
                self._proc = mp.get_context("spawn").Process(target=target, args=args, name="spear-engine-core")
                self._proc.start()
        finally:
            core_link.close()   # so that the core's exit closes the link
            core_beat.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=link, limit=1 << 20)
        threading.Thread(target=self._heartbeats, args=(beat, Wire(secret, CoreHealth, receives=HEARTBEAT)),
                         name="spear-core-heartbeats", daemon=True).start()
        threading.Thread(target=self._watch, args=(self._proc,), name="spear-core-watch", daemon=True).start()

    def _send(self, message) -> None:
        """On the event loop. The transport buffers without a limit: the core reads when it can."""
        frame = self._wire.pack(message)
        self._writer.write(LENGTH.pack(len(frame)) + frame)

    def _watch(self, proc) -> None:
        proc.join()
        if not self._closing and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._died, proc.exitcode)

    def _died(self, code) -> None:
        if self.error is None:
            self.error = EngineDead(f"the engine core exited (code {code})" if self.loaded.is_set() or code
                                    else "the engine core exited before it started")
            log.error("%s", self.error)
        self._stopped()

    def _stopped(self) -> None:
        if self.on_error is not None:
            self.on_error(self.error)
        if not self.loaded.is_set() and self.on_fatal is not None:
            self.on_fatal()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to stop (it stops the tensor-parallel ranks) and wait up to ``timeout`` s; then
        SIGTERM, and SIGKILL a second later (a stopped or frozen core takes no signal but that)."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            if self._writer is not None and not self._writer.is_closing():
                self._send(Stop())
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                log.warning("the engine core did not stop within %g s; ending it", timeout)
                proc.terminate()
                await asyncio.to_thread(proc.join, 1.0)
                if proc.is_alive():
                    proc.kill()
                    await asyncio.to_thread(proc.join, 5.0)
        self.error = self.error or EngineDead("the server is shutting down", "shutting_down")
        if self._writer is not None:
            self._writer.close()

    # ------------------------------------------------------------------ health
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self.error is None

    def health(self) -> CoreHealth | None:
        return self._health

    @property
    def heartbeat_age(self) -> float:
        return time.monotonic() - self._beat_at

    def _heartbeats(self, sock: socket.socket, wire: Wire) -> None:
        beats = FrameReader(sock)
        try:
            while not self._closing:
                if not beats.wait(0.5):
                    continue
                for frame in beats.frames():
                    try:
                        self._health = wire.unpack(frame)
                    except Malformed as exc:
                        self._drop(exc, self._beats_dropped)
                        continue
                    self._beat_at = time.monotonic()
        except EOFError:  # the core exited: the watch reports it
            pass
        except Exception:  # else the heartbeats age and /health says so
            log.exception("the engine core's heartbeat listener stopped")
        finally:
            sock.close()

    def _drop(self, exc: Malformed, counts: dict[str, int]) -> None:
        counts[exc.reason] += 1
        held = self._bad.allow()
        if held is not None:
            log.error("dropped a message from the engine core's link: %s%s", exc, OncePer.since(held))

    def frames_dropped(self) -> dict[tuple[str, str], int]:
        health = self._health
        totals = {("server", reason): n + self._beats_dropped[reason] for reason, n in self._dropped.items()}
        if health is not None:
            totals.update({("core", reason): n for reason, n in health.frames_dropped.items()})
        return totals

    # ------------------------------------------------------------------ requests
    def add(self, request) -> None:
        """Send a request; InvalidRequest when the wire cannot carry it (then nothing of it is sent)."""
        try:
            frame = self._wire.pack(request)
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"the request cannot be sent to the engine: {exc}") from None
        if not self.alive:
            raise self.error or EngineDead("the engine core is not running")
        self._writer.write(LENGTH.pack(len(frame)) + frame)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.alive:
            self._send(Abort(list(request_ids)))

    async def get_output(self) -> CoreOutputs:
        while True:
            try:
                (n,) = LENGTH.unpack(await self._reader.readexactly(LENGTH.size))
                frame = await self._reader.readexactly(n)
            except (asyncio.IncompleteReadError, ConnectionError):
                await self._link_closed()
            try:
                msg = self._wire.unpack(frame)
            except Malformed as exc:
                self._drop(exc, self._dropped)
                continue
            if isinstance(msg, CoreOutputs):
                return msg
            self._lifecycle(msg)

    async def _link_closed(self):
        """The core closed its end: it is exiting, and the watch says how (its exit code fails the
        open requests); this waits for good then. A core that closed it and runs on is dead to us."""
        deadline = time.monotonic() + _CLOSED_LINK_GRACE_S
        while self._proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._proc.is_alive():
            raise EngineDead("the engine core closed its link to the server")
        await asyncio.get_running_loop().create_future()  # cancelled at shutdown

    def _lifecycle(self, msg) -> None:
        if isinstance(msg, Loaded):
            self.facts = msg.facts
            self.loaded.set()
            if self.on_loaded is not None:
                self.on_loaded(msg.facts)
        elif isinstance(msg, Ready):
            self.warmup_seconds = msg.warmup_s
            self.ready.set()
        elif isinstance(msg, Failed):  # the caller reports it (spear serve: one line, exit 2)
            self.error = EngineDead(f"the engine could not start: {msg.message}")
            self._stopped()
