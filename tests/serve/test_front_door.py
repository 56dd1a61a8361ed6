"""The server's front door under abuse: chats of many messages, bodies parsed off the event loop,
connections that never finish their headers, more connections than the server keeps, a chunked
body over the limit, accept() failures logged once. The engine-core process (spear serve's two
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
    limits = ServerLimits(max_messages=8, header_timeout_s=0.5, max_connections=6, max_body_bytes=256 * 1024)
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


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


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
    url, _, limits = guarded
    idle = [_raw(url) for _ in range(limits.max_connections)]
    extra = _raw(url)
    assert _closed(extra, within=2), "a connection beyond the cap was kept"
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
