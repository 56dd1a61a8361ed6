"""``CoreClient``: the engine core as a frontend sees it, whatever carries the messages. Checked
requests (``CoreRequest``) and aborts go in; one ``CoreOutputs`` per step comes back, with the
requests the core took and those it refused; the core's health is read on the side. Two transports:

    InProcClient   the core in this process, stepped by the caller (LLMEngine, fast tests)
    MPClient      the core in a process of its own, over a link of socket pairs it inherits
                   (frontend/mp_client.py, core/wire.py; spear serve)

Both frontends (``LLMEngine``: synchronous, in process; ``AsyncLLM``: the HTTP server's) hold a
client and the same input and output processors, so a request is checked, and its text made, by
the same code whichever way it travels.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod

from spear.serve.core.engine import EngineCore
from spear.serve.core.messages import CoreFacts, CoreHealth, CoreOutputs, CoreRequest


class EngineDead(RuntimeError):
    """No request can be served: the engine stopped or died (``code`` "engine_stopped"), the server
    is shutting down ("shutting_down"), or the core has stopped answering ("engine_unresponsive")."""

    def __init__(self, message: str, code: str = "engine_stopped"):
        super().__init__(message)
        self.code = code


class CoreClient(ABC):
    """``loaded`` is set once the model is in place (``facts`` known), ``ready`` once the warm-up is
    done (``warmup_seconds``); ``error`` says why the core cannot serve (it stopped, died, or never
    started; ``on_fatal`` is called when it failed before it loaded). ``add`` sends a request:
    where the core answers at once (in process) its refusal raises there (QueueFull, SpearError);
    a core in another process answers in a later ``CoreOutputs``."""

    def __init__(self):
        self.facts: CoreFacts | None = None
        self.loaded = threading.Event()
        self.ready = threading.Event()
        self.warmup_seconds: float | None = None
        self.error: BaseException | None = None
        self.on_error = None    # called (on the event loop) with ``error`` when the core stops serving
        self.on_fatal = None    # called when it stopped before it loaded (the server then stops)

    @abstractmethod
    async def start(self) -> None:
        """Start the core (on the running event loop)."""

    @abstractmethod
    def add(self, request: CoreRequest) -> None: ...

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output(self) -> CoreOutputs:
        """The core's next message of requests taken or refused and of a step's outputs."""

    @abstractmethod
    def health(self) -> CoreHealth | None:
        """The core's latest report of itself (None before the first)."""

    @property
    @abstractmethod
    def heartbeat_age(self) -> float:
        """Seconds since the core last reported (0 in process: the core is this thread)."""

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    async def shutdown(self, timeout: float = 30.0) -> None: ...

    def frames_dropped(self) -> dict[tuple[str, str], int]:
        """Frames of the link to the core dropped so far, by (side, reason): side "server" for those
        this process dropped, "core" for those the core did; reason "malformed" or "replayed"
        (core/wire.py). None in process: nothing travels."""
        return {}


class InProcClient(CoreClient):
    """The core in this process: ``add`` and ``abort`` reach it at once, ``step`` runs one engine
    step in the caller's thread (``get_output`` too, on the event loop, which waits for the step)."""

    def __init__(self, core: EngineCore):
        super().__init__()
        self.core = core
        self.facts = core.facts()
        self.loaded.set()
        self._accepted: list[str] = []
        self._work: asyncio.Event | None = None
        self._closed = False

    async def start(self) -> None:
        self._work = asyncio.Event()
        self.warmup_seconds = self.core.warmup()
        self.ready.set()

    def add(self, request: CoreRequest) -> None:
        self.core.add(request)
        self._accepted.append(request.request_id)
        if self._work is not None:
            self._work.set()

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def step(self) -> CoreOutputs:
        """The requests taken since the last call, and one engine step's outputs when any is unfinished."""
        accepted, self._accepted = self._accepted, []
        if not self.core.has_unfinished():
            return CoreOutputs(accepted=accepted, timestamp=time.monotonic())
        outputs = self.core.step()
        return CoreOutputs(outputs=outputs, accepted=accepted, timestamp=time.monotonic(), step=self.core.last_step)

    async def get_output(self) -> CoreOutputs:
        while not (self._accepted or self.core.has_unfinished()):
            self._work.clear()
            await self._work.wait()
        out = self.step()
        await asyncio.sleep(0)  # let the handlers that were woken run before the next step
        return out

    def health(self) -> CoreHealth:
        core = self.core
        return CoreHealth(ready=self.ready.is_set(), step_started=core.step_started,
                          failed_steps=core.num_failed_steps, last_failure=core.last_failure, stats=core.stats())

    @property
    def heartbeat_age(self) -> float:
        return 0.0

    @property
    def alive(self) -> bool:
        return not self._closed

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._closed = True
        self.error = self.error or EngineDead("the server is shutting down", "shutting_down")
        self.core.close()
