"""The OpenAI-compatible HTTP server (FastAPI) over the serving frontend (frontend/async_llm.py).

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    GET  /v1/models, /v1/models/{id}, /health, /metrics

What each endpoint does with a request is endpoints.py's, the streaming response sse.py's, every
error's JSON body errors.py's; the guards of the connections under the app (deadlines for a
request's headers and body, a header cap, connection caps in all and per client) are
transport.py's. Before it says ready the engine core loads the model and compiles every kernel a
step can meet: ``/health`` answers 503 ``warming_up`` until then, and
requests sent meanwhile wait. ``/health`` also answers 503 while the engine cannot serve
(``AsyncLLM.problem``: stopped, silent, stuck in a step, failing every request). A client that
disconnects, streaming or not, has its request aborted and its KV blocks freed. On SIGTERM the
server stops taking connections and gives open requests ``shutdown_timeout_s`` to finish; then each
is ended with the JSON error (503 ``shutting_down``), a stream with its error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from spear.serve.api.endpoints import Server
from spear.serve.api.errors import BodyLimit, NotFound, add_error_handlers, error_response
from spear.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from spear.serve.api.transport import quiet_accept_faults, uvicorn_config
from spear.serve.config import ServerLimits
from spear.serve.frontend.async_llm import AsyncLLM
from spear.serve.frontend.client import EngineDead

log = logging.getLogger(__name__)


_LAG_PERIOD_S = 0.02


async def watch_loop_lag(histogram) -> None:
    """How late the event loop wakes a task that slept ``_LAG_PERIOD_S``, observed into ``histogram``:
    a loop busy with one thing (a step's outputs, a large body) delays every stream's tokens by that
    much."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(_LAG_PERIOD_S)
        histogram.observe(max(0.0, loop.time() - before - _LAG_PERIOD_S))


def build_app(llm: AsyncLLM, model_name: str, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app over ``llm``; it starts the frontend (and its engine core) on startup and
    stops them on shutdown."""
    server = Server(llm, model_name, limits)

    @asynccontextmanager
    async def lifespan(app):
        quiet_accept_faults(asyncio.get_running_loop())
        lag = asyncio.create_task(watch_loop_lag(llm.metrics.loop_lag))
        await llm.start()
        # what is alive now lives as long as the server: out of the collector's sweeps, whose pauses
        # over it would show in the streams' inter-token latency
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()
        lag.cancel()
        await llm.shutdown(server.limits.shutdown_timeout_s)  # a frozen core does not hold the exit longer
        server.close()

    app = FastAPI(title="spear", description="OpenAI-compatible server for spear models", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.limits.max_body_bytes)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        problem = llm.problem()
        if problem is not None:
            code, message = problem
            return error_response(503, message, "server_error", code=code)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "spear",
                "max_model_len": llm.max_model_len}

    @app.get("/v1/models")
    async def models():
        await llm.wait_loaded()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # :path: a served name may hold a slash ("org/model")
    async def model(model_id: str):
        if model_id != model_name:
            raise NotFound(f"the model '{model_id}' does not exist; this server serves '{model_name}'", "model",
                           "model_not_found")
        await llm.wait_loaded()
        return model_card()

    @app.get("/metrics")
    async def metrics():
        llm.refresh_metrics()
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, ChatCompletionRequest, chat=True)

    return app


def run_server(llm: AsyncLLM, model_name: str, listener, log_level: str = "info",
               limits: ServerLimits | None = None) -> None:
    """Serve on ``listener`` (a bound socket: transport.listen) until SIGTERM / Ctrl-C (blocking):
    then stop taking connections, give open requests up to ``limits.shutdown_timeout_s`` to finish
    (a second signal ends the wait), end the rest with their JSON error (a stream with its error
    event and ``[DONE]``), stop the engine."""
    import uvicorn

    limits = limits or ServerLimits()

    def cut() -> None:
        llm.fail_open(EngineDead(f"the server is shutting down: the request did not finish within "
                                 f"{limits.shutdown_timeout_s:g} s (shutdown_timeout_s)", "shutting_down"))

    class _Server(uvicorn.Server):
        """uvicorn, where the first SIGTERM / Ctrl-C also sets the drain's deadline (``cut`` after
        ``shutdown_timeout_s``) and a second SIGTERM, not only a second Ctrl-C, ends the wait."""

        loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True
            elif self.loop is not None:
                self.loop.call_soon_threadsafe(self.loop.call_later, limits.shutdown_timeout_s, cut)
            super().handle_exit(sig, frame)

    count = lambda reason: llm.metrics.connections_closed.labels(reason).inc()  # noqa: E731
    server = _Server(uvicorn_config(build_app(llm, model_name, limits), log_level, limits, count))
    llm.client.on_fatal = lambda: setattr(server, "should_exit", True)  # an engine that cannot start stops it
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it drained for; the drain is done
        pass
