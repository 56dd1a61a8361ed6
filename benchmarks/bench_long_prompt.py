"""A long prompt beside everyone else, through ``spear serve``: a short request's time to first token
and a running stream's gap between tokens, alone and while an ~8,000-token prompt is prefilled.

    nice -n 10 .venv/bin/python benchmarks/bench_long_prompt.py [--model smollm2-135m] [--out DIR]

The server runs with its defaults (``--serve-arg`` adds to them) in a process of its own; the client
streams over HTTP and times every text event on its monotonic clock. Three phases:

1. **beside a stream**: a stream decoding, then the long prompt; a short request every ``--every``
   seconds from ``--first`` seconds after the long prompt until the long prompt's first token (the
   TTFT of each), and the stream's gaps between the long prompt's sending and its first token;
2. **lone**: the long prompt with no stream, short requests as in 1.

Before, between and after them, **alone**: the short request ``--probes`` times (its TTFT each) and
one stream (its gaps); each phase is compared with the alone runs on either side of it, so that a
machine shared with other jobs changes both sides of a ratio alike.

The floor (issue 54, the 2-core CPU with the default model): beside the long prompt a short
request's TTFT <= 3x its time alone, and a stream's gap <= 3x its gap alone. The long prompt's own
TTFT is printed too: what serving the others costs it. Prints one table; ``--out`` also writes
results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHORT = "Write one sentence about the sea and the sky over it, in the evening."
STREAM = "Once upon a time, in a small village by the sea,"
TEXT = ("The history of the city begins with a small settlement on the river, where traders met to "
        "exchange grain, salt and cloth. Over the centuries the market grew into a town, the town "
        "into a city, and the city into the capital of a wide province. ")


def long_prompt_ids(model: str, n: int) -> list[int]:
    from spear.models.checkpoint import load_folder_tokenizer
    from spear.models.loading import resolve_model_path

    tok = load_folder_tokenizer(resolve_model_path(model))
    one = tok(TEXT, add_special_tokens=False).input_ids
    return (one * (n // len(one) + 1))[:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(client, body: dict, times: list[float], stop: asyncio.Event | None = None) -> None:
    """POST a streaming completion; append the time of each event with text; return when it ends
    (or once ``stop`` is set: the connection closes and the server aborts the request)."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.monotonic())
            if stop is not None and stop.is_set():
                return


def body(model: str, prompt, max_tokens: int) -> dict:
    return dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def ttft(client, model: str, max_tokens: int = 2) -> float:
    times: list[float] = []
    t0 = time.monotonic()
    await stream(client, body(model, SHORT, max_tokens), times)
    return times[0] - t0


async def probes_beside(client, long_ids: list[int], args, with_stream: bool) -> dict:
    stop = asyncio.Event()
    gaps_from: list[float] = []
    runner = None
    if with_stream:
        runner = asyncio.create_task(stream(client, body(args.model, STREAM, args.stream_tokens), gaps_from, stop))
        while len(gaps_from) < 8:  # decoding steadily
            await asyncio.sleep(0.05)
    long_times: list[float] = []
    sent = time.monotonic()
    long = asyncio.create_task(stream(client, body(args.model, long_ids, 2), long_times))
    ttfts, next_at = [], sent + args.first
    while not long_times:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if long_times:
            break
        ttfts.append(await ttft(client, args.model))
        next_at = max(time.monotonic(), next_at + args.every)
    first = long_times[0]
    await long
    stop.set()
    if runner is not None:
        await runner
    in_prefill = [b - a for a, b in zip(gaps_from, gaps_from[1:]) if a >= sent and b <= first]
    return dict(long_ttft_s=first - sent, short_ttft_s=ttfts, stream_gaps_s=in_prefill)


async def measure(port: int, long_ids: list[int], args) -> dict:
    import httpx

    async def alone() -> dict:
        short = [await ttft(client, args.model) for _ in range(args.probes)]
        times: list[float] = []
        await stream(client, body(args.model, STREAM, args.alone_tokens), times)
        return dict(short_ttft_s=short, stream_gaps_s=[b - a for a, b in zip(times[1:], times[2:])])  # 1st: prefill

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
        await ttft(client, args.model, 4)  # the first request pays the lazy set-up
        refs = [await alone()]
        beside = await probes_beside(client, long_ids, args, with_stream=True)
        refs.append(await alone())
        lone = await probes_beside(client, long_ids, args, with_stream=False)
        refs.append(await alone())
    return dict(alone=refs, beside_stream=dict(beside, alone=[0, 1]), lone=dict(lone, alone=[1, 2]))


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spear", "serve", "--model", args.model, "--port", str(port),
           "--log-level", "warning", *args.serve_arg]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"spear serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"spear serve did not answer /health within {timeout:.0f} s")


def q(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))] if s else float("nan")


def table(res: dict) -> str:
    rows = [f"alone ({i}): short TTFT p50 {statistics.median(a['short_ttft_s']):.3f} s, stream gap p50 "
            f"{statistics.median(a['stream_gaps_s']):.3f} s (max {max(a['stream_gaps_s']):.3f})"
            for i, a in enumerate(res["alone"])]
    rows += ["| phase | long prompt TTFT (s) | alone: short TTFT / stream gap p50 (s) | short TTFT p50 / max (s) "
             "| vs alone | stream gap p50 / p90 / max (s) | vs alone (p50 / max) |", "|---|---|---|---|---|---|---|"]
    for name in ("beside_stream", "lone"):
        r = res[name]
        refs = [res["alone"][i] for i in r["alone"]]
        t0 = statistics.median([x for a in refs for x in a["short_ttft_s"]])
        g0 = statistics.median([x for a in refs for x in a["stream_gaps_s"]])
        t, g = r["short_ttft_s"], r["stream_gaps_s"]
        gaps = (f"{statistics.median(g):.3f} / {q(g, 0.9):.3f} / {max(g):.3f} | {statistics.median(g) / g0:.1f}x / "
                f"{max(g) / g0:.1f}x") if g else "- | -"
        rows.append(f"| {name} | {r['long_ttft_s']:.1f} | {t0:.3f} / {g0:.3f} | {statistics.median(t):.3f} / "
                    f"{max(t):.3f} ({len(t)}) | {statistics.median(t) / t0:.1f}x / {max(t) / t0:.1f}x | {gaps} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--long-tokens", type=int, default=8000, help="the long prompt's tokens (default: %(default)s)")
    p.add_argument("--probes", type=int, default=5, help="short requests timed alone (default: %(default)s)")
    p.add_argument("--alone-tokens", type=int, default=48, help="tokens of the stream timed alone")
    p.add_argument("--stream-tokens", type=int, default=4000, help="most tokens of the stream beside the long prompt")
    p.add_argument("--first", type=float, default=3.0, help="first short request, seconds after the long prompt")
    p.add_argument("--every", type=float, default=5.0, help="seconds between short requests beside the long prompt")
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument of spear serve (repeatable)")
    p.add_argument("--out", help="folder for results.json")
    args = p.parse_args(argv)
    long_ids = long_prompt_ids(args.model, args.long_tokens)
    port = free_port()
    proc = start_server(args, port)
    try:
        wait_healthy(proc, port)
        res = asyncio.run(measure(port, long_ids, args))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    res["setup"] = dict(model=args.model, long_tokens=len(long_ids), serve_args=args.serve_arg, cpus=os.cpu_count(),
                        load_average=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M"))
    print(table(res))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
