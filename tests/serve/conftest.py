"""Fixtures of the serving tests: the default model loaded once, and real servers on loopback ports."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """(model, tokenizer) of the default model, fp32 on the CPU; shared, so tests must not modify it."""
    from spear.models.loading import load_model

    return load_model(default_model_path)


def hf_greedy(model, tokenizer, prompt, n: int) -> list[int]:
    """HF transformers' greedy continuation (token ids) of a text or token-id prompt."""
    import torch

    ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, proc=None, what: str = "the server") -> None:
    """Poll ``url``/health until it answers 200 (``proc``, a server subprocess, must stay alive)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None:
            assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} did not answer 200 on /health within {timeout_s:g} s"
        time.sleep(0.2)


@contextlib.contextmanager
def running_server(model_path, model_name: str = "test-model", limits=None, target=None, **config):
    """Serve the model at ``model_path`` as ``spear serve`` does: this process is the API server
    (uvicorn on a thread of its own), the engine core a process of its own over its socket pairs,
    running ``target`` (default: core/process.py's core_main; tests/serve/core_faults.py wraps it
    with a fault). ``config``: EngineConfig fields over small KV limits. Yields (base_url, AsyncLLM)."""
    import uvicorn

    from spear.models.checkpoint import load_folder_tokenizer
    from spear.serve import EngineConfig
    from spear.serve.api.app import build_app
    from spear.serve.api.transport import listen, uvicorn_config
    from spear.serve.config import ServerLimits
    from spear.serve.core.process import core_main
    from spear.serve.frontend.async_llm import AsyncLLM
    from spear.serve.frontend.llm_engine import tokenizer_eos
    from spear.serve.frontend.mp_client import MPClient

    cfg = EngineConfig(**{"num_blocks": 64, "max_model_len": 256, "max_num_seqs": 8, **config})
    tokenizer = load_folder_tokenizer(model_path)
    client = MPClient(str(model_path), cfg, eos_token_ids=tokenizer_eos(tokenizer), log_level="warning",
                       target=target or core_main)
    llm = AsyncLLM(client, tokenizer)
    limits = limits or ServerLimits()
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    count = lambda reason: llm.metrics.connections_closed.labels(reason).inc()  # noqa: E731  (as run_server)
    server = uvicorn.Server(uvicorn_config(build_app(llm, model_name, limits), "warning", limits, count))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", llm
    finally:
        server.should_exit = True
        thread.join(60)
        assert client._proc is None or not client._proc.is_alive(), "the engine core outlived the server"


def wait_ready(llm, timeout_s: float = 120) -> None:
    """Until the engine core has loaded and warmed up (its process starts with the server)."""
    assert llm.ready.wait(timeout_s), f"the engine core was not ready within {timeout_s:g} s: {llm.client.error!r}"


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    """The tiny Llama and its tokenizer, loaded once per module."""
    from spear.models.loading import load_model

    return load_model(tiny_llama_path)


def make_engine(tiny, **cfg):
    """An in-process engine on ``tiny`` (model, tokenizer) with small KV limits, ``cfg`` over them."""
    from spear.serve import EngineConfig, LLMEngine

    model, tok = tiny
    return LLMEngine(model, tok, EngineConfig(**{"num_blocks": 64, "max_model_len": 256, "max_num_seqs": 8, **cfg}))
