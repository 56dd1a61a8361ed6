"""bench_serving.py's HTTP path: the workload through ``spear serve`` in a process of its own,
driven by the official ``openai`` client, as a user's would be, from processes of its own (the
requests dealt round-robin), so that the client's own parsing of the events stays out of the
numbers. Every process times tokens on the host's monotonic clock from one shared start."""

from __future__ import annotations

import asyncio
import gc
import re
import sys
import time
from pathlib import Path

import torch

from decode_cases import GROUP
from serving_cases import Request, Trace
from spear.config import QuantConfig
from spear.serve import EngineConfig


def word_tokenizer(vocab: int):
    """A tokenizer with one word per id ("t0" .. "tN", spaces between): random token ids stream as
    one text chunk per token, which the HTTP client times."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def write_folder(model, name: str, quantized: bool, folder: Path) -> Path:
    """The variant as ``spear serve`` reads it: a spear checkpoint (W4, with its compensators) or an
    HF folder, with ``word_tokenizer``."""
    tok = word_tokenizer(model.config.vocab_size)
    if quantized:
        from spear.models.checkpoint import save_checkpoint

        save_checkpoint(model, tok, folder, QuantConfig(bits=4, group_size=GROUP), f"random {name}", overwrite=True)
    else:
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
    return folder


def _client(port: int, name: str, jobs: list[tuple[int, float, list[int], int]], ready, start, results) -> None:
    """One client process: its requests (index, arrival, prompt, output tokens), each sent at its
    arrival after the shared ``start`` (time.monotonic()), streamed; back: per index its token
    times, and (sent, headers) times, when the request left the client and when the server's
    answer began (after the engine core took it)."""
    import httpx
    import openai

    times: dict[int, list[float]] = {i: [] for i, *_ in jobs}
    hops: dict[int, tuple[float, float]] = {}
    lags: list[float] = []

    async def watch_loop(period: float = 0.005):
        # how late this process's event loop wakes (s): a token read late by the client itself shows here,
        # not in the server's metrics
        while True:
            t = time.monotonic()
            await asyncio.sleep(period)
            lags.append(time.monotonic() - t - period)

    async def one(client, i, arrival, prompt, output, t0):
        await asyncio.sleep(max(0.0, arrival - (time.monotonic() - t0)))
        sent = time.monotonic() - t0
        raw = await create(client, prompt, output)
        # the server answers with headers once the core took it; its Server-Timing says how long it
        # parsed, prepared and waited for the core (ms)
        timing = dict(re.findall(r"(\w+);dur=([0-9.]+)", raw.headers.get("server-timing", "")))
        hops[i] = (sent, time.monotonic() - t0, {k: float(v) / 1e3 for k, v in timing.items()})
        stream = raw.parse()  # the async client's raw response parses without awaiting
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times[i].append(time.monotonic() - t0)

    async def create(client, prompt, output):
        # The prompt's token ids go in extra_body, which the client sends as it is: given as `prompt` the
        # openai client's request transform walks the list id by id, about 10 us each (3,000 ids hold this
        # process's event loop 31 ms against 1.3 ms through extra_body; bench_http_client.py, quiet 2-core
        # CPU, 2026-12-07), late reads of every other stream of the process that the server is not the
        # cause of. A text prompt, as users mostly send, is one string and costs nothing there.
        return await client.completions.with_raw_response.create(model=name, prompt=[], max_tokens=output,
                                                                 temperature=0, stream=True,
                                                                 extra_body={"prompt": prompt, "ignore_eos": True})

    async def warm_up(client):
        # the client's first request builds its resources and response types (6.0 against 0.6 ms after,
        # bench_http_client.py, the same CPU): one short request before the shared start pays for it, and what
        # is alive then leaves the collector's sweeps, as the server does
        raw = await create(client, jobs[0][2][:8], 2)
        async for _ in raw.parse():
            pass
        gc.collect()
        gc.freeze()

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                    timeout=3600, http_client=httpx.AsyncClient(
                                        limits=httpx.Limits(max_connections=len(jobs) + 8), timeout=3600))
        if jobs:
            await warm_up(client)
        ready.put(True)
        t0 = start.get()
        watcher = asyncio.create_task(watch_loop())
        try:
            await asyncio.gather(*[one(client, *job, t0) for job in jobs])
        finally:
            watcher.cancel()
            await client.close()

    asyncio.run(run_all())
    results.put((times, hops, lags))


def _histogram(text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of the Prometheus histogram ``name`` in ``text``."""
    return [(float("inf") if b == "+Inf" else float(b), float(c))
            for b, c in re.findall(rf'{name}_bucket{{le="([^"]+)"}} ([0-9.e+]+)', text)]


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The bucket bound under which a share ``q`` of the observations fall (an upper estimate)."""
    total = buckets[-1][1] if buckets else 0.0
    return next((b for b, c in buckets if c >= q * total), float("nan")) if total else float("nan")


def server_hops(metrics: str) -> dict:
    """From the server's /metrics: the delay from the engine core's message to the server handling
    it, and the server's event-loop lag, each as p50 / p99 bucket bounds (ms) and the share above
    8 ms."""
    out = {}
    for key, name in (("output_delay", "spear_core_output_delay_seconds"), ("loop_lag", "spear_event_loop_lag_seconds")):
        b = _histogram(metrics, name)
        if not b:
            continue
        total = b[-1][1]
        under8 = next((c for bound, c in b if bound >= 0.008), total)
        out[f"{key}_p50_ms"], out[f"{key}_p99_ms"] = 1e3 * _quantile(b, 0.5), 1e3 * _quantile(b, 0.99)
        out[f"{key}_over_8ms_pct"] = 100 * (total - under8) / total if total else float("nan")
    return out


def run_http(folder: Path, cfg: EngineConfig, dtype: torch.dtype, reqs: list[Request], name: str = "bench",
             start_timeout_s: float = 1800, client_procs: int = 4, device: str = "auto",
             core_threads: int | None = None) -> tuple[Trace, float]:
    """The workload through ``spear serve`` on ``folder`` in a process of its own (it runs the
    engine core in another), driven by the official ``openai`` client in ``client_procs``
    processes: (trace, seconds until /health said ready)."""
    import multiprocessing as mp
    import signal
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "spear", "-q", "serve", "--model", str(folder), "--port", str(port),
           "--served-model-name", name, "--dtype", str(dtype).removeprefix("torch."), "--device", device,
           "--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
           "--max-model-len", str(cfg.max_model_len), "--max-waiting", str(max(cfg.max_waiting, len(reqs))),
           "--log-level", "warning"]
    if cfg.num_blocks is not None:
        cmd += ["--num-blocks", str(cfg.num_blocks)]
    if cfg.itl_slo_ms is not None:
        cmd += ["--itl-slo-ms", str(cfg.itl_slo_ms)]
    if core_threads is not None:
        cmd += ["--core-threads", str(core_threads)]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    clients = []
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"spear serve exited (code {server.returncode}) before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > start_timeout_s:
                raise RuntimeError(f"spear serve was not ready within {start_timeout_s:.0f} s")
            time.sleep(0.5)
        ready_s = time.perf_counter() - t0
        ctx = mp.get_context("spawn")
        ready, results = ctx.Queue(), ctx.Queue()
        starts = [ctx.Queue() for _ in range(client_procs)]
        jobs = [[(i, r.arrival, r.prompt, r.output) for i, r in enumerate(reqs) if i % client_procs == k]
                for k in range(client_procs)]
        clients = [ctx.Process(target=_client, args=(port, name, jobs[k], ready, starts[k], results), daemon=True)
                   for k in range(client_procs)]
        for c in clients:
            c.start()
        for _ in clients:  # every client imported and connected: the arrivals start together
            ready.get(timeout=300)
        start = time.monotonic() + 0.2
        for q in starts:
            q.put(start)
        trace = Trace(arrivals=[r.arrival for r in reqs], tokens=[[] for _ in reqs], hops=[None] * len(reqs))
        lags: list[float] = []
        for _ in clients:
            times, hops, lag = results.get(timeout=7200)
            for i, t in times.items():
                trace.tokens[i] = t
            for i, h in hops.items():
                trace.hops[i] = h
            lags += lag
        trace.server = server_hops(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
        if lags:
            lags.sort()
            trace.server.update(client_loop_lag_p50_ms=1e3 * lags[len(lags) // 2],
                                client_loop_lag_p99_ms=1e3 * lags[min(len(lags) - 1, int(0.99 * len(lags)))],
                                client_loop_lag_max_ms=1e3 * lags[-1],
                                client_loop_lag_over_8ms_pct=100 * sum(x > 0.008 for x in lags) / len(lags))
        return trace, ready_s
    finally:
        for c in clients:
            c.join(30)
            if c.is_alive():
                c.kill()
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(30)
