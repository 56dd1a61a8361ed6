"""What the official openai client costs its own event loop per streaming completion request, by prompt length:
token ids given as ``prompt`` (the client's request transform walks the list id by id) against the same ids
through ``extra_body`` (sent as they are), and the first request of a client against the later ones.

    python benchmarks/bench_http_client.py                  # prompts of 8, 300, 3,000 ids
    python benchmarks/bench_http_client.py --out results/http-client.json

No server: the client talks to an in-memory transport (httpx.MockTransport) that answers one short event
stream, so the times are the client's alone (bench_serving.py --http sends its prompts through extra_body).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import openai

_EVENT = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
          b'"text":"t","logprobs":null,"finish_reason":null}]}\n\n')


async def _times(n_ids: int, via_extra_body: bool, repeats: int) -> list[float]:
    """Seconds of each request's ``create`` call (the first one first), its stream read to the end."""
    def answer(request: httpx.Request) -> httpx.Response:
        assert len(json.loads(request.content)["prompt"]) == n_ids  # the ids arrived either way
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_EVENT * 4 + b"data: [DONE]\n\n")

    client = openai.AsyncOpenAI(base_url="http://bench/v1", api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    ids = list(range(n_ids))
    out = []
    for _ in range(repeats):
        kw = dict(prompt=[], extra_body={"prompt": ids}) if via_extra_body else dict(prompt=ids)
        t = time.perf_counter()
        raw = await client.completions.with_raw_response.create(model="m", max_tokens=4, stream=True, **kw)
        out.append(time.perf_counter() - t)
        async for _ in raw.parse():
            pass
    await client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="8,300,3000", help="prompt lengths in token ids")
    ap.add_argument("--repeats", type=int, default=8, help="requests per client (a fresh client per row)")
    ap.add_argument("--out", type=Path, help="a JSON file for the rows")
    args = ap.parse_args()
    rows = []
    print("| prompt ids | sent as | first request | later requests, median |\n|---:|---|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        for extra in (False, True):
            t = asyncio.run(_times(n, extra, args.repeats))
            rows.append(dict(ids=n, via="extra_body" if extra else "prompt", first_ms=1e3 * t[0],
                             later_median_ms=1e3 * statistics.median(t[1:])))
            print(f"| {n} | {rows[-1]['via']} | {rows[-1]['first_ms']:.1f} ms | {rows[-1]['later_median_ms']:.1f} ms |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), openai=openai.__version__, rows=rows),
                                       indent=1))


if __name__ == "__main__":
    main()
