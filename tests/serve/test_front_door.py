"""The server's front door under abuse: chats of many messages, bodies parsed off the event loop,
connections that never finish their headers or trickle their bodies, headers over the cap, more
connections than the server keeps (in all and from one client), uploads abandoned midway, a chunked
body over the limit, accept() failures and uvicorn's warnings logged once. The engine-core process (spear serve's two
processes) is in test_engine_core.py."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest

from spear.serve.config import ServerLimits
from tests.serve.conftest import running_server, wait_healthy, wait_ready


def _post(url, path, body, timeout=60):
    return httpx.post(url + path, json=body, timeout=timeout)


@pytest.fixture(scope="module")
def guarded(tiny_llama_path):
    """The tiny model (its tokenizer, the default model's, has a chat template) behind tight guards."""
    limits = ServerLimits(max_messages=8, header_timeout_s=0.5, max_connections=6, max_connections_per_client=4,
                          max_body_bytes=256 * 1024, min_upload_rate=2000, request_timeout_s=4.0,
                          max_header_bytes=8192)
    with running_server(tiny_llama_path, "tiny", limits) as (url, llm):
        wait_ready(llm)
        yield url, llm, limits


def test_a_chat_of_more_messages_than_the_limit_is_refused(guarded):
    """Catches: an unbounded message count (254,197 empty messages in one body held the tokenizer
    thread ~10 s, delaying everyone's requests and /health)."""
    url, _, limits = guarded
    msgs = [{"role": "user", "content": ""}] * (limits.max_messages + 1)
    r = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert f"at most {limits.max_messages}" in r.json()["error"]["message"]
    ok = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": msgs[:2], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_empty_messages_count_toward_the_character_limit(tiny_llama_path):
    """Every message's role counts, so a chat of empty contents is not free."""
    limits = ServerLimits(max_prompt_chars=40)
    with running_server(tiny_llama_path, "tiny", limits) as (url, llm):
        wait_ready(llm)
        msgs = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 4
        r = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text


def test_large_bodies_are_parsed_off_the_event_loop(guarded, monkeypatch):
    """Catches: JSON bodies parsed and validated on the event loop (four 8 MB bodies held /health
    for 124 ms): a large one is parsed on the parse thread, a small one inline."""
    from spear.serve.api import endpoints

    url = guarded[0]
    seen, real = [], endpoints._parse

    def parse(raw, model):
        seen.append(threading.current_thread().name)
        return real(raw, model)

    monkeypatch.setattr(endpoints, "_parse", parse)
    _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1})
    _post(url, "/v1/completions", {"model": "tiny", "prompt": [1] * 50_000, "max_tokens": 1})  # ~100 kB
    assert seen[0] == threading.main_thread().name or not seen[0].startswith("spear-parse")
    assert seen[1].startswith("spear-parse"), seen


def _raw(url: str, source: str = "127.0.0.1") -> socket.socket:
    """A plain TCP connection to the server from the loopback address ``source`` (a client of its own)."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def _closed_count(llm, reason: str) -> float:
    return llm.metrics.registry.get_sample_value("spear_http_connections_closed_total", {"reason": reason}) or 0.0


def _counted(llm, reason: str, above: float, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while _closed_count(llm, reason) <= above:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _answer(sock: socket.socket, within: float = 10.0) -> bytes:
    """Everything the server sends until it closes ``sock``."""
    sock.settimeout(within)
    data = b""
    try:
        while part := sock.recv(65536):
            data += part
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def _trickle(sock: socket.socket, piece: bytes, seconds: float) -> bytes | None:
    """Send ``piece`` every ~0.1 s for up to ``seconds``: what the server answered (b"" if it closed
    the connection), or None if it kept reading all along."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            sock.sendall(piece)
        except OSError:
            return b""
        sock.settimeout(0.1)
        try:
            return sock.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return b""
    return None


_POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (EOF or reset)."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_a_connection_that_never_finishes_its_headers_is_closed(guarded):
    """Catches: no header deadline (2,000 connections sending one byte a second stayed open and
    held the server's sockets). Half a request's headers, a byte at a time: closed after
    header_timeout_s; a complete request on another connection is served meanwhile."""
    url, _, limits = guarded
    slow = _raw(url)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):
        time.sleep(limits.header_timeout_s / 4)
        try:
            slow.sendall(b"X")
        except OSError:
            break
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert _closed(slow, within=limits.header_timeout_s * 4), "the slow connection was kept"
    slow.close()


def test_connections_beyond_the_cap_are_closed_and_the_slots_come_back(guarded):
    """Catches: no connection cap (1,100 idle connections under ulimit -n 1024 made /health time
    out for ~20 s). Beyond max_connections new ones are closed at once; once the idle ones are cut
    (the header deadline) the server answers again."""
    url, llm, limits = guarded
    before = _closed_count(llm, "too_many_connections")
    idle = [_raw(url, f"127.0.0.{2 + i % 3}") for i in range(limits.max_connections)]  # within each client's cap
    extra = _raw(url, "127.0.0.5")
    assert _closed(extra, within=2), "a connection beyond the cap was kept"
    assert _counted(llm, "too_many_connections", before)
    extra.close()
    time.sleep(limits.header_timeout_s * 3)
    for s in idle:
        s.close()
    wait_healthy(url, 10, what="the server, its idle connections cut,")


def test_a_chunked_body_over_the_limit_gets_413(guarded):
    """A body without Content-Length, sent in chunks past max_body_bytes: refused with the JSON
    413 before it is all in memory, and the server goes on."""
    url, _, limits = guarded
    sock = _raw(url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    sock.sendall(head)
    chunk = b"[" + b"1," * 8191 + b"1"
    try:
        for _ in range(limits.max_body_bytes // len(chunk) + 2):
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    except OSError:  # the server may close once it has answered
        pass
    sock.settimeout(10)
    data = b""
    try:
        while b"\r\n\r\n" not in data or b"}" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    except (socket.timeout, ConnectionResetError):
        pass
    sock.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b'"code":"body_too_large"' in data.replace(b" ", b"")
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_accept_faults_are_logged_once_a_minute(caplog):
    """Catches: a traceback per failed accept() (the log grew 97 MB in 45 s out of descriptors)."""
    import asyncio

    from spear.serve.api.transport import quiet_accept_faults

    loop = asyncio.new_event_loop()
    try:
        quiet_accept_faults(loop)
        with caplog.at_level(logging.ERROR, logger="spear.serve.api.transport"):
            for _ in range(200):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
        assert len([r for r in caplog.records if "cannot accept" in r.getMessage()]) == 1
    finally:
        loop.close()


def test_one_client_cannot_take_every_connection(guarded):
    """Catches: one pool of connections for everyone (2,100 idle connections of one client refused
    every other). Beyond max_connections_per_client that client's new connections are closed at
    once; another client is still served meanwhile."""
    url, llm, limits = guarded
    before = _closed_count(llm, "too_many_from_client")
    mine = [_raw(url, "127.0.0.7") for _ in range(limits.max_connections_per_client)]
    extra = _raw(url, "127.0.0.7")
    assert _closed(extra, within=2), "a connection beyond the client's cap was kept"
    assert _counted(llm, "too_many_from_client", before)
    other = _raw(url, "127.0.0.8")
    other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _answer(other).startswith(b"HTTP/1.1 200"), "another client was refused"
    for s in [extra, other, *mine]:
        s.close()


def test_a_body_trickled_below_the_minimum_rate_is_cut_with_408(guarded):
    """Catches: nothing bounded the body once the headers were in (a byte every 20 s kept a
    connection 168 s; 2,100 such connections answered nobody for 60 s). A body far below
    min_upload_rate is cut after the grace (header_timeout_s) with a 408, counted once."""
    url, llm, limits = guarded
    before = _closed_count(llm, "slow_upload")
    sock = _raw(url)
    sock.sendall(_POST_HEAD % 100_000)  # under max_body_bytes: no 413
    answer = _trickle(sock, b" ", limits.request_timeout_s)  # ~10 bytes a second
    assert answer is not None, "a body at 10 bytes/s was kept for the whole request timeout"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert _counted(llm, "slow_upload", before)
    sock.close()
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_a_body_that_never_finishes_meets_the_request_timeout(guarded):
    """A body sent fast enough for the rate but never complete is cut at request_timeout_s (408)."""
    url, llm, limits = guarded
    before = _closed_count(llm, "request_timeout")
    sock = _raw(url)
    sock.sendall(_POST_HEAD % 100_000)  # under max_body_bytes: no 413
    answer = _trickle(sock, b" " * (2 * limits.min_upload_rate // 10), limits.request_timeout_s * 3)  # twice the rate
    assert answer is not None, "the request timeout did not bite"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert _counted(llm, "request_timeout", before)
    sock.close()


def test_an_abandoned_upload_is_counted_without_a_traceback(guarded, capfd):
    """Catches: each client that left mid-upload logged two tracebacks (starlette's
    ClientDisconnect; 2.8 KB a disconnect). It is counted as client_left and logs nothing."""
    url, llm, _ = guarded
    capfd.readouterr()
    before = _closed_count(llm, "client_left")
    for _ in range(3):
        sock = _raw(url)
        sock.sendall(_POST_HEAD % 1000 + b'{"model": "ti')
        time.sleep(0.1)
        sock.close()
    assert _counted(llm, "client_left", before + 2)
    time.sleep(0.3)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ClientDisconnect" not in err, err[-2000:]


def test_headers_over_the_cap_get_431(guarded):
    """Catches: headers had no size limit (a 64 MB header was accepted; 8 of them added 300 MB). A
    header over max_header_bytes gets the JSON 431, whole or still arriving."""
    url, llm, limits = guarded
    before = _closed_count(llm, "headers_too_large")
    whole = _raw(url)
    whole.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * limits.max_header_bytes + b"\r\n\r\n")
    answer = _answer(whole)
    assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer, answer[:200]
    unfinished = _raw(url)
    try:
        unfinished.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (2 * limits.max_header_bytes))
    except OSError:
        pass
    assert _answer(unfinished).startswith(b"HTTP/1.1 431")
    assert _counted(llm, "headers_too_large", before + 1)
    ok = _raw(url)
    ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Fine: " + b"a" * 1000 + b"\r\nConnection: close\r\n\r\n")
    assert _answer(ok).startswith(b"HTTP/1.1 200")
    for s in (whole, unfinished, ok):
        s.close()


def test_a_kept_alive_connection_gets_deadlines_for_its_next_request(guarded):
    """After a response, the same connection's next request has the header deadline again."""
    url, _, limits = guarded
    sock = _raw(url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # never finished
    assert _closed(sock, within=limits.header_timeout_s * 6)
    sock.close()


def test_uvicorns_warnings_are_rate_limited():
    """Catches: uvicorn's own warnings logged once per connection (2,000 garbage connections wrote
    482 KB): each distinct message once per interval, with the count held back."""
    from spear.serve.api.transport import RateLimited

    logger = logging.getLogger("test.ratelimited")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    gate, keep = RateLimited(interval_s=60.0), Keep()
    logger.addFilter(gate)
    logger.addHandler(keep)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        for _ in range(500):
            logger.warning("Invalid HTTP request received.")
        logger.warning("another message")
        logger.info("info passes")
        logger.info("info passes")
    finally:
        logger.removeFilter(gate)
        logger.removeHandler(keep)
    assert records == ["Invalid HTTP request received.", "another message", "info passes", "info passes"]


def test_responses_say_where_their_time_went_and_metrics_the_servers_hops(guarded):
    """The Server-Timing header of a completion (streamed or not) names the server's parse, prepare
    and admit times; /metrics holds the delay of the core's messages and the event loop's lag."""
    import re

    url, llm, _ = guarded
    for stream in (False, True):
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream})
        assert r.status_code == 200, r.text
        timing = dict(re.findall(r"(\w+);dur=([0-9.]+)", r.headers["server-timing"]))
        assert set(timing) == {"parse", "prepare", "admit"} and all(float(v) >= 0 for v in timing.values())
    time.sleep(0.1)
    metrics = httpx.get(url + "/metrics", timeout=5).text
    for name in ("spear_core_output_delay_seconds_count", "spear_event_loop_lag_seconds_count"):
        count = float(re.search(rf"^{name} ([0-9.e+]+)$", metrics, re.M).group(1))
        assert count > 0, name
