"""CPU experiment: where a mixed step's time goes with a long prompt in flight (the default model).

    python benchmarks/exp/profile_mixed_step.py THREADS CONTEXT [--cap N] [--profile] [--ab]

Times a decode step alone, then the steps of one decoding stream beside an 8,000-token prompt once
the prompt has CONTEXT tokens cached (its chunk capped by --cap and the build's context rule);
--profile prints torch's operator table of three such steps and of three decode steps; --ab times
the steps with the cached keys read as a view, by index_select, and copied contiguous, in turn.
"""
import argparse
import time

import torch

import spear.serve.model.layers.attention as A
from spear.serve.config import EngineConfig
from spear.serve.core.engine import EngineCore
from spear.serve.core.messages import CoreRequest, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("threads", type=int)
p.add_argument("context", type=int)
p.add_argument("--cap", type=int, default=32)
p.add_argument("--profile", action="store_true")
p.add_argument("--ab", action="store_true")
args = p.parse_args()
torch.set_num_threads(args.threads)
eng = EngineCore.from_pretrained("smollm2-135m", EngineConfig(max_prefill_chunk=args.cap, max_prefill_chunk_alone=512))
ids = list(range(1000, 1050)) * 200


def req(rid, n, max_tokens):
    return CoreRequest(rid, ids[:n], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       time.monotonic())


def timed(n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        eng.step()
        out.append((time.perf_counter() - t) * 1e3)
    return out


eng.add(req("s", 20, 4000))
timed(3)
print("decode alone %.1f ms" % (sum(timed(5)) / 5))
eng.abort(["s"])
eng.add(req("L", 8000, 2))
eng.step()


def long_prompt():
    return next(s for s in eng.scheduler.running if s.request_id == "L")


while long_prompt().num_computed_tokens < args.context:
    eng.step()
eng.add(req("s2", 20, 4000))
timed(3)
print("context", long_prompt().num_computed_tokens, "mixed steps ms", [round(x) for x in timed(6)])
if args.ab:
    view = A._context
    modes = {"view": view,
             "index_select": lambda c, b, n: c.index_select(0, b).flatten(0, 1)[:n].transpose(0, 1)[None],
             "contiguous": lambda c, b, n: c.index_select(0, b).flatten(0, 1)[:n].transpose(0, 1)[None].contiguous()}
    res = {k: [] for k in modes}
    for _ in range(4):
        for k, f in modes.items():
            A._context = f
            res[k] += timed(1)
    A._context = view
    print("context", long_prompt().num_computed_tokens, {k: [round(x) for x in v] for k, v in res.items()})
if args.profile:
    with torch.profiler.profile() as prof:
        timed(3)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    eng.abort(["L"])
    timed(2)
    with torch.profiler.profile() as prof:
        timed(3)
    print("decode only\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))
