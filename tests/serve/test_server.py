"""A real server on a loopback port, driven by the official openai client and raw httpx; its engine
core runs in a process of its own, over its socket pairs, as under ``spear serve``.

The default model answers the openai-client tests (greedy text must equal HF
generate); a tiny random Llama carries the overload, disconnect and load tests.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from functools import partial

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve import core_faults
from tests.serve.conftest import hf_greedy, running_server, wait_ready

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smol(default_model_path):
    with running_server(default_model_path, MODEL, num_blocks=128, max_num_seqs=8, max_model_len=256) as (url, llm):
        wait_ready(llm)
        yield url, llm


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_idle(llm, timeout: float = 20.0):
    """Until the engine core reports no request and no used KV block (aborts are applied between
    steps; the report comes with its heartbeat, every 0.25 s)."""
    deadline = time.monotonic() + timeout
    time.sleep(0.3)  # a report from before the last requests ended says nothing
    while time.monotonic() < deadline:
        s = llm.stats
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout}s: {llm.stats}")


# ---------------------------------------------------------------------- openai client, default model
def test_models_and_health(smol, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(smol[0] + "/health").json() == {"status": "ok"}


def test_completion_greedy_equals_hf_and_streams_the_same(default_model, client):
    model, tok = default_model
    prompt = "The capital of France is"
    expected = tok.decode(hf_greedy(model, tok, prompt, 12), skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected
    assert r.usage.prompt_tokens == len(tok(prompt).input_ids) and r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_streaming_and_not(smol, client, default_model, monkeypatch):
    """The prompt the server submits is, id for id, the tokenizer's chat template applied to the
    messages with the generation prompt; the streamed text equals the whole one.

    Catches: ``ChatCompletionRequest.chat`` giving user messages the system role (as it does
    developer ones): the same number of tokens (the old count-only check passed), other ids; a
    user/assistant swap fails it too."""
    _, tok = default_model
    llm = smol[1]
    submitted: list[list[int]] = []
    submit = llm.submit

    async def recording_submit(ids, params, *args, **kw):  # this frontend object only, undone after the test
        submitted.append(list(ids))
        return await submit(ids, params, *args, **kw)

    monkeypatch.setattr(llm, "submit", recording_submit)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert submitted == [ref]
    assert r.usage.prompt_tokens == len(ref)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text and r.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert submitted == [ref, ref]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_sampling_with_seed_reproduces(client):
    """The same seed gives the same text; other seeds, other texts; temperature 0 the greedy text.
    Catches: the seed ignored (every seed alike, or a repeat differing), the temperature ignored
    (sampled text equal to the greedy one for every seed)."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
    texts = {client.completions.create(**{**kw, "seed": seed}).choices[0].text for seed in range(1, 6)}
    assert len(texts) >= 3, texts
    greedy = client.completions.create(**{**kw, "temperature": 0}).choices[0].text
    assert greedy == client.completions.create(**{**kw, "temperature": 0, "seed": 99}).choices[0].text
    assert any(t != greedy for t in texts)


def test_stop_string(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                  stop=["."])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


# ---------------------------------------------------------------------- bad input: 400, never 500
BAD = [
    ("{not json", None, "malformed JSON"),
    ("[1, 2]", None, "valid dictionary"),
    ("", None, None),
    (json.dumps({"model": MODEL, "prompt": "x", "bogus": 1}), "bogus", "unknown field"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}), "max_tokens", "valid integer"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": "hot"}), "temperature", None),
    (json.dumps({"model": MODEL, "prompt": 42}), "prompt", None),
    (json.dumps({"model": MODEL}), "prompt", "required"),
    (json.dumps({"model": MODEL, "prompt": ""}), "prompt", "empty"),
    (json.dumps({"model": MODEL, "prompt": []}), "prompt", "empty"),
    (json.dumps({"model": MODEL, "prompt": "word " * 400}), "prompt", "context"),
    (json.dumps({"model": MODEL, "prompt": [10 ** 9]}), "prompt", "token ids"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}), "max_tokens", "greater than or equal to 1"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -3}), "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 300}), "max_tokens", "exceeds the context"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": -0.5}), "top_p", None),  # 0 is greedy, as OpenAI's
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 1.5}), "top_p", None),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 2}), "n", "n=1"),
    (json.dumps({"model": MODEL, "prompt": ["a", "b"]}), "prompt", "one prompt"),
    (json.dumps({"model": MODEL, "prompt": "x", "stop": ["a", ""]}), "stop", None),
]
BAD_CHAT = [
    (json.dumps({"model": MODEL, "messages": []}), "messages", None),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}), "messages.0.role", None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user"}]}), "messages.0.content", "required"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}), "max_tokens",
     None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}]}), "messages", "context"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}), "logprobs",
     None),
]


def check_error(r: httpx.Response, status: int, param, fragment):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if fragment is not None:
        assert fragment in err["message"], err


@pytest.mark.parametrize("body,param,fragment", BAD)
def test_bad_completion_requests(smol, body, param, fragment):
    r = httpx.post(smol[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    check_error(r, 400, param, fragment)


@pytest.mark.parametrize("body,param,fragment", BAD_CHAT)
def test_bad_chat_requests(smol, body, param, fragment):
    r = httpx.post(smol[0] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    check_error(r, 400, param, fragment)


def test_unknown_model_path_and_method(smol):
    url = smol[0]
    check_error(httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model", "nope")
    check_error(httpx.get(url + "/v1/nothing"), 404, None, None)
    check_error(httpx.get(url + "/v1/completions"), 405, None, None)
    assert httpx.get(url + "/health").status_code == 200  # still serving


# ---------------------------------------------------------------------- overload, disconnects, load (tiny model)
def tiny_server(tiny_llama_path, target=None, **cfg):
    """A server of the tiny model (its core with the fault ``target``, if given), ready."""
    import contextlib

    @contextlib.contextmanager
    def ready():
        with running_server(tiny_llama_path, "tiny", target=target,
                            **{"num_blocks": 128, "max_model_len": 512, **cfg}) as (url, llm):
            wait_ready(llm)
            yield url, llm

    return ready()


LONG = {"model": "tiny", "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}


def test_full_queue_answers_429(tiny_llama_path):
    with tiny_server(tiny_llama_path, max_num_seqs=1, max_num_batched_tokens=8, max_waiting=1) as (url, ae):
        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                return await asyncio.gather(*[c.post("/v1/completions", json=LONG) for _ in range(4)])

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and set(codes) <= {200, 429}, codes
        check_error(next(r for r in responses if r.status_code == 429), 429, None, "busy")
        assert next(r for r in responses if r.status_code == 429).json()["error"]["type"] == "rate_limit_error"
        assert metrics(url)['spear_requests_rejected_total{"reason": "queue_full"}'] >= 1
        wait_idle(ae)


def test_client_disconnect_aborts_and_frees_blocks(tiny_llama_path):
    with tiny_server(tiny_llama_path, max_num_seqs=2) as (url, ae):
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True, "max_tokens": 500}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                while not next(lines).startswith("data: "):
                    pass
            deadline = time.monotonic() + 5
            while ae.stats.kv_usage == 0:  # the core reports with its heartbeat, every 0.25 s
                assert time.monotonic() < deadline, "the request never held KV blocks"
                time.sleep(0.05)
        wait_idle(ae)  # the engine dropped the request well before its 500 tokens
        # a non-streaming client that gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 500}, timeout=0.5)
        wait_idle(ae)
        m = metrics(url)
        assert m['spear_requests_total{"finish_reason": "abort"}'] == 2
        assert m["spear_kv_cache_usage_ratio"] == 0.0


def test_64_concurrent_streams_with_random_disconnects(tiny_llama_path):
    # 16 sequences at a time over a small cache: requests queue, and decodes preempt others.
    cfg = dict(max_num_seqs=16, num_blocks=24, block_size=8, max_num_batched_tokens=64, max_model_len=128)
    rng = random.Random(0)
    plan = [(f"Request {i}: " + "lorem ipsum " * rng.randint(1, 12), rng.randint(8, 16),
             rng.randint(1, 4) if rng.random() < 0.3 else None) for i in range(64)]

    async def one(client, prompt, max_tokens, leave_after):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 temperature=0.8, extra_body={"ignore_eos": True})
        n, finish = 0, None
        async for chunk in stream:
            n += 1
            finish = chunk.choices[0].finish_reason or finish
            if leave_after is not None and n >= leave_after:
                await stream.close()
                return "left"
        return finish

    async def run_all(url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[one(client, *p) for p in plan])
        finally:
            await client.close()

    with tiny_server(tiny_llama_path, **cfg) as (url, ae):
        results = asyncio.run(run_all(url))
        stats = wait_idle(ae)
        m = metrics(url)
        assert httpx.get(url + "/health").status_code == 200
    left = sum(r == "left" for r in results)
    assert 5 < left < 40
    assert all(r == "length" for r in results if r != "left"), results
    # a stream its client closes ends as an abort, unless the server generated its last token first
    length, aborted = (m.get(f'spear_requests_total{{"finish_reason": "{r}"}}', 0.0) for r in ("length", "abort"))
    assert length + aborted == 64 and 64 - left <= length and aborted > 0
    assert m["spear_kv_cache_usage_ratio"] == 0.0 and m["spear_num_requests_running"] == 0
    assert stats.num_preemptions > 0 and stats.num_free_blocks == cfg["num_blocks"]


def test_metrics_exposition(smol, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    m = metrics(smol[0])
    for name in ("spear_prompt_tokens_total", "spear_generation_tokens_total", "spear_time_to_first_token_seconds_count",
                 "spear_inter_token_latency_seconds_count", "spear_kv_cache_usage_ratio",
                 "spear_num_requests_waiting", "spear_num_requests_running"):
        assert name in m, name
    assert m["spear_generation_tokens_total"] >= 3 and m["spear_time_to_first_token_seconds_count"] >= 1


def test_a_failing_step_fails_its_requests_not_the_server(tiny_llama_path):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
    with tiny_server(tiny_llama_path, partial(core_faults.failing_first_steps, 2)) as (url, ae):
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        check_error(r, 500, None, "injected failure")
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "injected failure" in events[0] and events[-1] == "data: [DONE]"
        wait_idle(ae)
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.get(url + "/health").status_code == 200


def test_health_reports_a_step_that_does_not_return(tiny_llama_path, tmp_path):
    """A step that runs past the step timeout (here: blocked until a file appears, as on a hung
    GPU) turns /health into 503 while it runs; once it returns, /health is 200 again and the request
    completes."""
    import threading

    entered, release = tmp_path / "entered", tmp_path / "release"
    with tiny_server(tiny_llama_path, partial(core_faults.hanging_first_step, str(entered), str(release))) as (url, ae):
        ae.step_timeout_s = 0.3
        assert httpx.get(url + "/health").status_code == 200
        result = {}
        sender = threading.Thread(target=lambda: result.update(
            r=httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, timeout=60)))
        sender.start()
        deadline = time.monotonic() + 30
        while not entered.exists():
            assert time.monotonic() < deadline, "the engine never ran the step"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health never reported the stuck step"
            time.sleep(0.05)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "hung" in r.json()["error"]["message"]
        assert metrics(url)["spear_engine_step_running_seconds"] > 0.3
        release.touch()
        sender.join(60)
        assert result["r"].status_code == 200
        time.sleep(0.6)  # the next heartbeats
        assert httpx.get(url + "/health").status_code == 200 and ae.step_seconds == 0.0


def test_step_timeout_must_be_positive(tiny_llama_path):
    from spear.serve import EngineConfig
    from spear.serve.frontend.async_llm import AsyncLLM
    from spear.serve.frontend.mp_client import MPClient

    with pytest.raises(ValueError, match="step_timeout_s"):
        AsyncLLM(MPClient(str(tiny_llama_path), EngineConfig()), None, step_timeout_s=0)
