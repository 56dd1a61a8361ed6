"""``spear serve`` as two processes: the HTTP server and the engine core (spear/serve/core/process.py,
client.py). Greedy outputs, stop strings included, equal the in-process engine's; a client that
leaves has its request aborted in the core; a dead core turns /health 503 and answers every
client with the JSON error at once; past --shutdown-timeout a non-streaming request ends with
the JSON error too."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.serve.test_cli import _start_server

PROMPTS = ["Hello there", "The capital of France is", "Once upon a time"]


def _core_of(proc) -> psutil.Process:
    """The engine-core process among the server's children (a spawned multiprocessing child)."""
    kids = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(kids) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children()]
    return kids[0]


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    proc, url = _start_server(tiny_llama_path)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except Exception:
                proc.kill()


def test_the_engine_runs_in_a_process_of_its_own(served):
    proc, _ = served
    core = _core_of(proc)
    assert core.pid != proc.pid and core.is_running()


@pytest.mark.parametrize("stop", [None, ["the"], [" a", "e"]])
def test_greedy_text_with_stop_strings_equals_the_in_process_engine(served, tiny_llama_path, stop):
    """The server detokenizes and applies stop strings, the core samples: the text, its length and
    the finish reason equal one engine's that does all of it."""
    from spear.serve import EngineConfig, LLMEngine, SamplingParams

    _, url = served
    eng = LLMEngine.from_pretrained(str(tiny_llama_path), EngineConfig(num_blocks=512))
    want = eng.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, stop=tuple(stop or ())))
    for prompt, w in zip(PROMPTS, want):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                       "temperature": 0, "stop": stop}, timeout=60)
        body = r.json()
        assert r.status_code == 200, body
        assert body["choices"][0]["text"] == w.text and body["choices"][0]["finish_reason"] == w.finish_reason
        assert body["usage"]["completion_tokens"] == w.num_output_tokens
        streamed, last = "", None
        with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                                 "temperature": 0, "stop": stop, "stream": True},
                          timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])["choices"][0]
                    streamed += chunk["text"]
                    last = chunk["finish_reason"] or last
        assert streamed == w.text and last == w.finish_reason


def _running(url) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("spear_num_requests_running "))
    return float(line.split()[1])


def test_a_client_that_leaves_is_aborted_in_the_core(served):
    _, url = served
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 20
    while _running(url) != 0:
        assert time.monotonic() < deadline, "the request kept running in the core after its client left"
        time.sleep(0.2)


def test_a_dead_core_turns_health_503_and_answers_every_client(tiny_llama_path):
    """Catches: a server that hangs, or answers 200 on /health, once its engine is gone."""
    proc, url = _start_server(tiny_llama_path)
    try:
        results: list = []

        def stream():
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            lines = []
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
                    for line in s.iter_lines():
                        lines.append(line)
                        if len(lines) == 3:
                            results.append("started")
            except httpx.TransportError as exc:
                lines.append(f"transport: {exc!r}")
            results.append(lines)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while not results:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _core_of(proc).kill()
        t.join(30)
        assert not t.is_alive(), "the open stream hung after the core died"
        lines = [ln for ln in results[-1] if ln]
        assert lines[-1] == "data: [DONE]" and "engine core exited" in lines[-2], lines[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 with the core dead"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_past_the_shutdown_timeout_a_waiting_request_gets_the_json_error(tiny_llama_path):
    """Catches: SIGTERM past --shutdown-timeout answering a non-streaming request with uvicorn's
    text/plain 500; the documented JSON 503 instead."""
    proc, url = _start_server(tiny_llama_path, "--shutdown-timeout", "1")
    try:
        out: list = []

        def long_request():
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
            try:
                out.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
            except httpx.TransportError as exc:
                out.append(exc)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 30
        while _running(url) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    r = out[0]
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert err["code"] == "shutting_down" and "shutdown_timeout" in err["message"]


def test_a_model_that_cannot_load_ends_the_server_with_one_line(tiny_llama_path, tmp_path):
    """The engine core fails to start (here: the weights are missing): the server stops with the
    core's reason on one line and exit code 2, instead of answering 503 forever."""
    import shutil
    import subprocess
    import sys

    from tests.serve.conftest import free_port

    bad = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_path, bad)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    proc = subprocess.run([sys.executable, "-m", "spear", "-q", "serve", "--model", str(bad), "--port",
                           str(free_port()), "--log-level", "error"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert "error:" in last and "no weights" in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
