"""The HTTP transport under the app: the listening socket, bound before anything is loaded; uvicorn's
httptools protocol on uvloop, with a deadline for a request's headers and a cap on open
connections; the process's file limit raised so that the cap bites first; the event loop's
failures to accept a connection logged once a minute. A connection that has not sent a request's
headers within ``ServerLimits.header_timeout_s`` is closed, and beyond
``ServerLimits.max_connections`` open connections new ones are closed at once (slow-header clients
cannot hold the server's sockets); each of these faults is logged once a minute, not once per
connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

from spear.errors import SpearError

from spear.serve.config import ServerLimits
from spear.serve.faults import OncePer

log = logging.getLogger(__name__)


def quiet_accept_faults(loop: asyncio.AbstractEventLoop) -> None:
    """Log the event loop's failures to accept a connection (out of file descriptors, typically)
    once a minute, one line, instead of a traceback per attempt."""
    gate, default = OncePer(), loop.get_exception_handler()

    def handler(loop, context):
        if "accept" in str(context.get("message", "")):
            held = gate.allow()
            if held is not None:
                log.error("cannot accept connections: %s (%s)%s", context.get("message"), context.get("exception"),
                          f"; {held} more since the last report" if held else "")
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (port 0: one the system picks); a SpearError in one
    line when the host does not resolve or the address is taken, before any model is loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SpearError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise SpearError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def guarded_protocol(limits: ServerLimits):
    """uvicorn's httptools protocol with a deadline for a request's headers and a cap on connections."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    timeouts, refusals = OncePer(), OncePer()

    class Guarded(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            if len(self.connections) > limits.max_connections:
                held = refusals.allow()
                if held is not None:
                    log.warning("%d connections open, the most this server keeps (max_connections): closing new "
                                "ones%s", len(self.connections) - 1, f" ({held} more since)" if held else "")
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._seen = self.cycle
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is self._seen and not self.transport.is_closing():  # no request's headers yet
                held = timeouts.allow()
                if held is not None:
                    log.warning("closing a connection that sent no complete request headers within %g s "
                                "(header_timeout_s)%s", limits.header_timeout_s, f"; {held} more since" if held else "")
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._seen:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # a kept-alive connection: the next headers have a deadline too
                self._disarm()
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Guarded


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard one; the soft limit now."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return soft
    except (ImportError, ValueError, OSError):
        return 1024


def uvicorn_config(app, log_level: str, limits: ServerLimits):
    """uvicorn's settings for ``app`` on a listening socket of its caller (``listen``): the guarded
    httptools protocol (header deadline, connection cap below the process's file limit, which is
    raised to its hard limit first) on uvloop, a 5 s keep-alive, and a graceful shutdown that
    outlasts ``shutdown_timeout_s`` by the time to write the last errors."""
    import uvicorn

    fds = raise_fd_limit()
    if limits.max_connections > fds - 64:  # the cap must bite before the descriptors run out
        limits = dataclasses.replace(limits, max_connections=max(16, fds - 64))
    return uvicorn.Config(app, log_level=log_level, http=guarded_protocol(limits), loop="uvloop",
                          timeout_keep_alive=5, timeout_graceful_shutdown=limits.shutdown_timeout_s + 5)
