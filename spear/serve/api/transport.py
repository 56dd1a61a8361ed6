"""The HTTP transport under the app: the listening socket, bound before anything is loaded; uvicorn's
httptools protocol on uvloop, with every resource a client holds bounded; the process's file limit
raised so that the connection caps bite first; faults that repeat logged once a minute.

What one connection may hold (``ServerLimits``):

    time      a request's line and headers must arrive within ``header_timeout_s`` of the connection
              (or of the previous response's end); its body then at ``min_upload_rate`` bytes a
              second or faster after a grace of ``header_timeout_s``, and the whole request within
              ``request_timeout_s``. Past either deadline the connection is closed. The time the
              server itself stops reading (flow control while it answers an earlier request of the
              connection) does not count against the client.
    bytes     the request line and headers at most ``max_header_bytes`` (431 beyond; the body's cap
              is the app's, errors.BodyLimit)
    sockets   ``max_connections`` open connections in all and ``max_connections_per_client`` from one
              peer address; beyond either, new ones are closed at once, so one client cannot refuse
              the others.

Each close counts in ``spear_http_connections_closed{reason}`` (the app's metrics) and is logged once
a minute per reason, never once per connection; so are uvicorn's own warnings (``RateLimited``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections import Counter
from typing import Callable

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


class _HeadersTooLarge(Exception):
    """Raised inside the parser's callback to stop it: the request's line and headers are over the cap."""


# why each close happens, as logged (once a minute each) and counted
_REASONS = {
    "header_timeout": "sent no complete request headers within {limits.header_timeout_s:g} s (header_timeout_s)",
    "slow_upload": "sent its request body slower than {limits.min_upload_rate} bytes/s (min_upload_rate)",
    "request_timeout": "did not complete its request within {limits.request_timeout_s:g} s (request_timeout_s)",
    "headers_too_large": "sent request headers over {limits.max_header_bytes} bytes (max_header_bytes): 431",
    "too_many_connections": "is beyond the {limits.max_connections} open connections this server keeps "
                            "(max_connections)",
    "too_many_from_client": "is beyond the {limits.max_connections_per_client} open connections one client may "
                            "hold (max_connections_per_client)",
    "invalid_http": "sent a request that is not valid HTTP: 400",
}


def _plain(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def guarded_protocol(limits: ServerLimits, count: Callable[[str], None] | None = None):
    """uvicorn's httptools protocol with every resource a connection holds bounded (the module's
    docstring); ``count(reason)`` is called once per connection closed for a reason of ``_REASONS``."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    gates = {reason: OncePer() for reason in _REASONS}
    per_peer: Counter[str] = Counter()
    too_large = _plain(b"431 Request Header Fields Too Large", (
        b'{"error":{"message":"the request line and headers are over %d bytes, the most this server takes",'
        b'"type":"invalid_request_error","param":null,"code":"headers_too_large"}}' % limits.max_header_bytes))
    invalid = _plain(b"400 Bad Request", b"Invalid HTTP request received.", b"text/plain; charset=utf-8")
    late = _plain(b"408 Request Timeout", (
        b'{"error":{"message":"the request body came slower than %d bytes/s or not within %g s; send it faster",'
        b'"type":"invalid_request_error","param":null,"code":"request_timeout"}}'
        % (limits.min_upload_rate, limits.request_timeout_s)))

    def report(reason: str) -> None:
        if count is not None:
            count(reason)
        held = gates[reason].allow()
        if held is not None:
            log.warning("closing a connection that %s%s", _REASONS[reason].format(limits=limits), OncePer.since(held))

    class Guarded(HttpToolsProtocol):
        # _waiting: the server waits on this client's bytes for a request (its first bytes, headers or
        # body), since _start; _head_at: when its headers were complete (None: not yet); _head_bytes:
        # bytes received before that (the parser buffers an unfinished header: these bound it);
        # _head_len: bytes of the parsed request line and headers; _body: body bytes parsed
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._timer: asyncio.TimerHandle | None = None
            self._waiting = False
            self._peer = self.client[0] if self.client else ""
            per_peer[self._peer] += 1
            if len(self.connections) > limits.max_connections:
                self._close("too_many_connections")
            elif per_peer[self._peer] > limits.max_connections_per_client:
                self._close("too_many_from_client")
            else:
                self._wait()

        def connection_lost(self, exc) -> None:
            self._waiting = False
            self._cancel()
            per_peer[self._peer] -= 1
            if per_peer[self._peer] <= 0:
                del per_peer[self._peer]
            super().connection_lost(exc)

        # ---------------------------------------------------------------- deadlines
        def _wait(self) -> None:
            """From now the server waits on this client for a request."""
            self._waiting, self._start = True, self.loop.time()
            self._head_at, self._head_bytes, self._head_len, self._body = None, 0, 0, 0
            self._schedule(limits.header_timeout_s)

        def _schedule(self, delay: float) -> None:
            self._cancel()
            self._timer = self.loop.call_later(max(delay, 0.0), self._check)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _check(self) -> None:
            self._timer = None
            if not self._waiting or self.transport.is_closing():
                return
            if self.flow.read_paused:
                # the server is not reading (it answers an earlier request of this connection, or the
                # app has not taken the last 64 KiB): that time is not the client's
                self._start += 1.0
                if self._head_at is not None:
                    self._head_at += 1.0
                self._schedule(1.0)
                return
            if self._head_at is None:
                deadline, reason = self._start + limits.header_timeout_s, "header_timeout"
            else:
                by_rate = self._head_at + limits.header_timeout_s + self._body / limits.min_upload_rate
                whole = self._start + limits.request_timeout_s
                deadline, reason = (by_rate, "slow_upload") if by_rate < whole else (whole, "request_timeout")
            now = self.loop.time()
            if now >= deadline:
                self._close(reason, late if self._head_at is not None else None)
            else:
                self._schedule(deadline - now)

        def _close(self, reason: str, answer: bytes | None = None) -> None:
            self._waiting = False
            self._cancel()
            report(reason)
            if self.cycle is not None and not self.cycle.response_complete:
                # the app, waiting on this body, sees a disconnect: it was the server's doing, counted here
                self.cycle.scope.setdefault("state", {})["closed_by_server"] = reason
            if answer is not None and not self.transport.is_closing():
                self.transport.write(answer)
            self.transport.close()

        # ---------------------------------------------------------------- the parser's events
        def data_received(self, data: bytes) -> None:
            # uvicorn's, with the headers' bytes capped and its faults counted and logged once a minute
            self._unset_keepalive_if_required()
            if self._waiting and self._head_at is None:
                self._head_bytes += len(data)
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError as exc:
                self._close(*(("headers_too_large", too_large) if isinstance(exc.__context__, _HeadersTooLarge)
                              else ("invalid_http", invalid)))
                return
            if self._waiting and self._head_at is None and self._head_bytes > limits.max_header_bytes:
                self._close("headers_too_large", too_large)

        def on_message_begin(self) -> None:
            if not self._waiting:  # a pipelined request: its deadline starts now
                self._wait()
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_len += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_len += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._head_len > limits.max_header_bytes:
                raise _HeadersTooLarge  # stops the parser: data_received answers 431
            self._head_at = self.loop.time()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._waiting = False  # the request is in: from here the time is the app's
            self._cancel()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self._waiting:  # a pipelined request, partly read while the server did not read: a fresh clock
                self._start = self.loop.time()
                if self._head_at is not None:
                    self._head_at = self._start
                self._schedule(limits.header_timeout_s)
            elif not self.pipeline:  # a kept-alive connection: the next request has deadlines too
                self._wait()

    return Guarded


class RateLimited(logging.Filter):
    """Lets each distinct message of a logger through once per ``interval_s`` (uvicorn's warnings
    about bad connections would otherwise log once per connection: 2,000 garbage connections wrote
    482 KB)."""

    def __init__(self, interval_s: float = 60.0):
        super().__init__()
        self.interval_s = interval_s
        self._gates: dict[str, OncePer] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = str(record.msg)[:200]
        gate = self._gates.get(key)
        if gate is None:
            if len(self._gates) > 1024:  # distinct messages are few; this bounds a flood of varied ones
                self._gates.clear()
            gate = self._gates[key] = OncePer(self.interval_s)
        held = gate.allow()
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg} ({held} more since the last report)"
        return True


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


def uvicorn_config(app, log_level: str, limits: ServerLimits, count: Callable[[str], None] | None = None):
    """uvicorn's settings for ``app`` on a listening socket of its caller (``listen``): the guarded
    httptools protocol (deadlines, header cap, connection caps below the process's file limit, which
    is raised to its hard limit first; ``count``: guarded_protocol's) on uvloop, a 5 s keep-alive, a
    graceful shutdown that outlasts ``shutdown_timeout_s`` by the time to write the last errors, and
    uvicorn's own warnings rate-limited."""
    import uvicorn

    fds = raise_fd_limit()
    if limits.max_connections > fds - 64:  # the cap must bite before the descriptors run out
        limits = dataclasses.replace(limits, max_connections=max(16, fds - 64))
    config = uvicorn.Config(app, log_level=log_level, http=guarded_protocol(limits, count), loop="uvloop",
                            timeout_keep_alive=5, timeout_graceful_shutdown=limits.shutdown_timeout_s + 5)
    uvicorn_log = logging.getLogger("uvicorn.error")  # after Config: it configures uvicorn's loggers
    if not any(isinstance(f, RateLimited) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(RateLimited())
    return config
