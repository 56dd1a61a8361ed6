"""The HTTP server's own work per token: from the engine core's message of a step to the bytes of
every stream's server-sent event.

    python benchmarks/bench_frontend.py                  # the default model's tokenizer; 1, 8, 64 streams
    python benchmarks/bench_frontend.py --streams 128 --steps 400

Per step, as in ``spear serve``'s API server process: the core's signed msgpack frame unpacked
(core/wire.py), then ``AsyncLLM``'s pass over it (frontend/async_llm.py: the output processor's
text and stop strings, the metrics, each stream's SSE bytes), then every stream's bytes taken from
its queue, as the response that writes them would. The tokens are the ids of real text, so the
detokenizer sees what it serves; the HTTP write itself (uvicorn, the socket) is not in the number.
Reported: microseconds per token and per step (median of --repeats runs of --steps steps).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.serve import SamplingParams  # noqa: E402
from spear.serve.api.sse import SSEEncoder  # noqa: E402
from spear.serve.core.messages import CoreFacts, CoreOutput, CoreOutputs, FromCore  # noqa: E402
from spear.serve.core.wire import Wire  # noqa: E402
from spear.serve.frontend.async_llm import AsyncLLM  # noqa: E402
from spear.serve.frontend.client import CoreClient  # noqa: E402

TEXT = ("The capital of France is Paris, a city on the Seine known for its museums, its cafes and the tower "
        "that Gustave Eiffel built for the world's fair of 1889. ") * 40


class _Core(CoreClient):
    """A core that takes every request and says so; its step messages are fed by hand."""

    def __init__(self, facts: CoreFacts):
        super().__init__()
        self.facts = facts
        self.loaded.set()
        self.ready.set()
        self.taken: list[str] = []

    async def start(self) -> None: ...

    def add(self, request) -> None:
        self.taken.append(request.request_id)

    def abort(self, request_ids) -> None: ...

    async def get_output(self):
        await asyncio.Event().wait()

    def health(self):
        return None

    heartbeat_age = 0.0
    alive = True

    async def shutdown(self, timeout: float = 30.0) -> None: ...


async def run(tokenizer, streams: int, steps: int) -> float:
    """Seconds for ``steps`` steps of ``streams`` streams, the frames unpacked, handled and drained."""
    ids = tokenizer(TEXT).input_ids
    facts = CoreFacts(max_model_len=1 << 20, vocab_size=len(tokenizer), eos_ids=[], num_blocks=1, block_size=16)
    core = _Core(facts)
    llm = AsyncLLM(core, tokenizer)
    wire = Wire(b"k" * 32, FromCore)
    params = SamplingParams(max_tokens=steps + 1, temperature=0)
    submits = [asyncio.ensure_future(llm.submit(ids[:16], params, encode=SSEEncoder(f"cmpl-{i}", "m", False, False)))
               for i in range(streams)]
    await asyncio.sleep(0)
    llm._handle(CoreOutputs(accepted=list(core.taken)))
    live = await asyncio.gather(*submits)
    frames = [wire.pack(CoreOutputs(outputs=[CoreOutput(rid, [ids[(16 + s + k) % len(ids)]])
                                             for k, rid in enumerate(core.taken)], timestamp=time.monotonic()))
              for s in range(steps)]
    sent = 0
    t0 = time.perf_counter()
    for frame in frames:
        llm._handle(wire.unpack(frame))
        for stream in live:
            while not stream.queue.empty():
                sent += len(stream.queue.get_nowait())
    seconds = time.perf_counter() - t0
    assert sent > 0 and not any(s.finished for s in live)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer detokenizes (default: %(default)s)")
    p.add_argument("--streams", default="1,8,64", help="comma-separated stream counts (default: %(default)s)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    from spear.models.checkpoint import load_folder_tokenizer
    from spear.models.loading import resolve_model_path

    tokenizer = load_folder_tokenizer(resolve_model_path(args.model))
    print(f"Frontend per token, {datetime.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
          f"tokenizer of {args.model}, {args.steps} steps, median of {args.repeats}")
    print("| streams | us per token | us per step |\n|---:|---:|---:|")
    for n in [int(x) for x in args.streams.split(",")]:
        runs = [asyncio.run(run(tokenizer, n, args.steps)) for _ in range(args.repeats)]
        s = statistics.median(runs)
        print(f"| {n} | {1e6 * s / (n * args.steps):.1f} | {1e6 * s / args.steps:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
