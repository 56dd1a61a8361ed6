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
def running_server(engine, model_name: str = "test-model", limits=None):
    """Serve ``engine`` (an LLMEngine) with uvicorn in a thread; yields (base_url, AsyncEngine)."""
    import uvicorn

    from spear.serve.frontend.async_engine import AsyncEngine
    from spear.serve.config import ServerLimits
    from spear.serve.api.app import build_app
    from spear.serve.api.transport import uvicorn_config

    async_engine = AsyncEngine(engine)
    port = free_port()
    limits = limits or ServerLimits()
    server = uvicorn.Server(uvicorn_config(build_app(async_engine, model_name, limits), "127.0.0.1", port, "warning",
                                           limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    if not async_engine.ready.wait(60):  # the warm-up (nothing to compile on the CPU)
        raise RuntimeError("the test engine did not finish its warm-up")
    try:
        yield f"http://127.0.0.1:{port}", async_engine
    finally:
        server.should_exit = True
        thread.join(30)
        assert not async_engine._thread.is_alive(), "the engine thread outlived the server"


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    """The tiny Llama and its tokenizer, loaded once per module."""
    from spear.models.loading import load_model

    return load_model(tiny_llama_path)


def make_engine(tiny, **cfg):
    """An engine on ``tiny`` (model, tokenizer) with small KV limits, ``cfg`` over them."""
    from spear.serve import EngineConfig, LLMEngine

    model, tok = tiny
    return LLMEngine(model, tok, EngineConfig(**{"num_blocks": 64, "max_model_len": 256, "max_num_seqs": 8, **cfg}))
