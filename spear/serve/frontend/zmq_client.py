"""``ZmqClient``: the engine core in a process of its own (core/process.py), reached over ZeroMQ;
what ``spear serve`` runs.

The sockets live in a folder of the temporary directory that only the user can enter, named after
this process (``spear-core-<pid>-...``); every name in it goes once both sides are connected, and
a start removes the folders of servers that were killed before theirs went. Every message is
signed with a secret made here (core/wire.py); a message that is not signed with it or is not
one of the protocol's types is logged (once a minute, with a count) and dropped, and the listener
goes on. The core's heartbeats are read by a thread of their own, so their age says how long the
core has been silent however busy the event loop is; a thread also waits for the core's process,
so that a core that exits fails every open request at once (``on_error``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

from spear.serve.config import EngineConfig
from spear.serve.core.messages import Abort, CoreHealth, CoreOutputs, Failed, FromCore, Hello, Loaded, Ready, Stop
from spear.serve.core.process import CoreSpec, core_main, ipc_path
from spear.serve.core.wire import Malformed, Wire
from spear.serve.faults import OncePer
from spear.serve.frontend.client import CoreClient, EngineDead
from spear.serve.frontend.processor import InvalidRequest

log = logging.getLogger(__name__)

_PREFIX = "spear-core-"


def default_torch_threads() -> int:
    """The core's torch threads: the cores this process may run on, but one for the HTTP server's
    process (torch's threads spin at their barriers: one without a core stalls every step)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


def socket_folder() -> Path:
    """A new folder for one server's sockets (mode 0700), after removing those of dead servers."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{_PREFIX}*"):
        try:
            pid = int(old.name[len(_PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:  # its server is gone (killed before the names went)
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            pass  # not ours to judge
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))


class ZmqClient(CoreClient):
    """The core (``EngineCore.from_pretrained``'s arguments, ``CoreSpec``) in a process of its own;
    ``on_loaded(facts)`` is called once the model is in place. ``target(spec)`` is what the core's
    process runs: ``core_main``, or a function that prepares the process and calls it (the tests'
    faults are injected so)."""

    def __init__(self, model: str, config: EngineConfig, *, dtype: str | None = None, device: str | None = None,
                 verify: bool = False, eos_token_ids: tuple[int, ...] = (), torch_threads: int | None = None,
                 log_level: str = "info", on_loaded=None, target=core_main):
        super().__init__()
        self._target = target
        self._args = dict(model=model, config=config, dtype=dtype, device=device, verify=verify,
                          eos_token_ids=tuple(eos_token_ids), log_level=log_level,
                          torch_threads=torch_threads or default_torch_threads())
        self.on_loaded = on_loaded
        self._health: CoreHealth | None = None
        self._beat_at = time.monotonic()
        self._bad = OncePer()
        self._proc = None
        self._dir: Path | None = None
        self._closing = False

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._dir = socket_folder()
        addr = {name: f"ipc://{self._dir / name}" for name in ("inbox", "outbox", "heartbeat")}
        secret = secrets.token_bytes(32)
        self._wire = Wire(secret, FromCore)
        self._ctx = zmq.asyncio.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(addr["inbox"])      # the core binds it
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(addr["outbox"])
        self._paths = {name: ipc_path(a) for name, a in addr.items()}
        beat_ctx = zmq.Context()
        beat = beat_ctx.socket(zmq.PULL)
        beat.setsockopt(zmq.LINGER, 0)
        beat.bind(addr["heartbeat"])
        threading.Thread(target=self._heartbeats, args=(beat_ctx, beat, Wire(secret, CoreHealth)),
                         name="spear-core-heartbeats", daemon=True).start()
        spec = CoreSpec(**self._args, parent_pid=os.getpid(), inbox=addr["inbox"], outbox=addr["outbox"],
                        heartbeat=addr["heartbeat"], secret=secret)
        self._beat_at = time.monotonic()
        self._proc = mp.get_context("spawn").Process(target=self._target, args=(spec,), name="spear-engine-core")
        self._proc.start()
        self._out.send(self._wire.pack(Hello()))
        threading.Thread(target=self._watch, args=(self._proc,), name="spear-core-watch", daemon=True).start()

    def _forget_name(self, name: str) -> None:
        """The other side is connected: remove the socket's name, and the folder once it is empty."""
        try:
            os.unlink(self._paths[name])
        except OSError:
            pass
        try:
            self._dir.rmdir()
        except OSError:
            pass  # not empty yet (or gone)

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
        """Ask the core to stop (it stops the tensor-parallel ranks), wait up to ``timeout`` s, then end it."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                self._out.send(self._wire.pack(Stop()))
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
        self.error = self.error or EngineDead("the server is shutting down", "shutting_down")
        for sock in (getattr(self, "_out", None), getattr(self, "_in", None)):
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

    def health(self) -> CoreHealth | None:
        return self._health

    @property
    def heartbeat_age(self) -> float:
        return time.monotonic() - self._beat_at

    def _heartbeats(self, ctx, sock, wire: Wire) -> None:
        first = True
        try:
            while not self._closing:
                if not sock.poll(500):
                    continue
                try:
                    self._health = wire.unpack(sock.recv())
                except Malformed as exc:
                    self._dropped(exc)
                    continue
                self._beat_at = time.monotonic()
                if first:
                    first = False
                    self._forget_name("heartbeat")
        except Exception:  # a closed context at shutdown; else the heartbeats age and /health says so
            if not self._closing:
                log.exception("the engine core's heartbeat listener stopped")
        finally:
            sock.close(0)
            ctx.term()

    def _dropped(self, exc: Malformed) -> None:
        held = self._bad.allow()
        if held is not None:
            log.error("dropped a message from the engine core's sockets: %s%s", exc, OncePer.since(held))

    # ------------------------------------------------------------------ requests
    def add(self, request) -> None:
        """Send a request; InvalidRequest when the wire cannot carry it (then nothing of it is sent)."""
        try:
            frame = self._wire.pack(request)
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"the request cannot be sent to the engine: {exc}") from None
        if not self.alive:
            raise self.error or EngineDead("the engine core is not running")
        self._out.send(frame, copy=False)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.alive:
            self._out.send(self._wire.pack(Abort(list(request_ids))), copy=False)

    async def get_output(self) -> CoreOutputs:
        while True:
            frame = await self._in.recv(copy=True)
            try:
                msg = self._wire.unpack(frame)
            except Malformed as exc:
                self._dropped(exc)
                continue
            if isinstance(msg, CoreOutputs):
                return msg
            self._lifecycle(msg)

    def _lifecycle(self, msg) -> None:
        if isinstance(msg, Hello):
            self._forget_name("outbox")
        elif isinstance(msg, Loaded):
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
