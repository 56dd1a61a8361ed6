"""No work for clients that left: a prompt that cannot fit the context is refused before it is
tokenized, the long-prompt pool's queue is bounded (429 beyond it), and a queued prompt whose
client left is never tokenized. The limits on connections, headers and bodies are in
test_front_door.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from spear.serve.config import ServerLimits
from tests.serve.conftest import running_server, wait_ready


def _post(url, path, body, timeout=60):
    return httpx.post(url + path, json=body, timeout=timeout)


@pytest.fixture(scope="module")
def queued(tiny_llama_path):
    """The tiny model with a long-prompt queue of three."""
    limits = ServerLimits(max_long_prompts_queued=3)
    with running_server(tiny_llama_path, "tiny", limits) as (url, llm):
        wait_ready(llm)
        yield url, llm, limits


def _rejected(llm, reason: str) -> float:
    return llm.metrics.registry.get_sample_value("spear_requests_rejected_total", {"reason": reason}) or 0.0


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(queued, monkeypatch):
    """Catches: 1M-character prompts tokenized (seconds each) only to be refused for their length.
    A prompt whose characters need more tokens than the context holds, even at the tokenizer's
    longest token, is refused at once; one that may fit is tokenized."""
    from spear.serve.api import endpoints

    url, llm, _ = queued
    calls, real = [], endpoints.encode_text
    monkeypatch.setattr(endpoints, "encode_text", lambda tok, p: calls.append(len(p)) or real(tok, p))
    longest = endpoints.longest_token_chars(llm.tokenizer)
    tok = llm.tokenizer
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    assert longest >= max(len(p) for p in pieces if p)  # independent: the bound covers every piece
    too_long = "a" * (longest * llm.max_model_len)
    r = _post(url, "/v1/completions", {"model": "tiny", "prompt": too_long, "max_tokens": 1})
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
    assert calls == []
    r = _post(url, "/v1/completions", {"model": "tiny", "prompt": "a" * 100, "max_tokens": 1})
    assert r.status_code == 200 and calls == [100], r.text


def test_the_long_prompt_queue_is_bounded_and_left_prompts_never_tokenize(queued, monkeypatch):
    """Catches: an unbounded long-prompt queue, and prompts of clients that had left still tokenized
    (20 dropped 1M-character prompts kept the tokenizer busy 58 s). With the long pool's two threads
    held, one more long prompt waits, the next gets 429; the waiting one's client leaves: its prompt
    is never tokenized and it is counted as client_left."""
    from spear.serve.api import endpoints

    url, llm, limits = queued
    gate, calls, real = threading.Event(), [], endpoints.encode_text

    def held(tok, prompt):
        calls.append(len(prompt))
        gate.wait(30)
        return real(tok, prompt)

    monkeypatch.setattr(endpoints, "encode_text", held)
    long_prompt = "#" * 8800  # the long pool (over 8,192 characters), in ~110 tokens: within the context
    results = []

    def send(timeout):
        try:
            results.append(_post(url, "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 1},
                                 timeout=timeout).status_code)
        except httpx.TimeoutException:
            results.append("left")

    left_before = _rejected(llm, "client_left")
    running = [threading.Thread(target=send, args=(60,)) for _ in range(2)]
    for t in running:
        t.start()
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(calls) == 2, "the two long-pool threads did not start"
    leaver = threading.Thread(target=send, args=(1.0,))  # waits in the queue, then its client leaves
    leaver.start()
    time.sleep(0.3)
    r = _post(url, "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    leaver.join(10)
    deadline = time.monotonic() + 5
    while _rejected(llm, "client_left") <= left_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rejected(llm, "client_left") == left_before + 1
    gate.set()
    for t in running:
        t.join(60)
    assert sorted(map(str, results)) == ["200", "200", "left"]
    assert len(calls) == 2, "the prompt of a client that had left was tokenized"
