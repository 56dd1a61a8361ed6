"""Serving benchmark under real traffic: requests arrive while others decode.

    python benchmarks/bench_serving.py --out results/serving                       # H200: Llama-3-8B shape
    python benchmarks/bench_serving.py --budgets 512,2048 --variants w4,w4+ec      # a subset
    python benchmarks/bench_serving.py --http                                      # through the HTTP server
    python benchmarks/bench_serving.py --workload saturating --budgets 512          # arrivals beyond FP16's capacity
    python benchmarks/bench_serving.py --variants w4 --budgets 512 --workload default,saturating --http
                                                                                   # the front door's table
    python benchmarks/bench_serving.py --cpu --shape tiny --variants w4 --budgets 512 --http --prompt-max 512
                                                                                   # the front door on a CPU
    python benchmarks/bench_serving.py --tiny                                      # CPU smoke check (CI)

Workload (seeded): ``--requests`` requests with Poisson arrivals at ``--rate`` per second, prompts
of random tokens with lengths uniform in ``--prompt-min``..``--prompt-max``, ``--output`` tokens
each (ignore_eos). ``--workload saturating`` replaces these with a load no variant keeps up with: 240
requests at 48/s (FP16 serves about 1 request/s of this size on one H200), prompts 128-2,048
tokens, outputs 32-512 tokens (uniform), ``--max-num-seqs`` 128: the engine always has work, so
output tokens/s measures throughput, reported for W4 and W4+EC as a ratio of FP16's. Variants on the same random weights (HF init at the model's shape, fp16 on
CUDA): fp16, w4 (RTN W4 g128 on every linear but the head), w4+ec (rank-16 gated ECs on evenly
spread linears up to --ec-budget of the W4 bytes). Per variant and token budget
(``max_num_batched_tokens``) the engine is built, warmed up (``LLMEngine.warmup``) and runs the
workload; ``--passes`` > 1 repeats it and reports the last pass.

In-process (default): arrivals are replayed in real time against ``LLMEngine``: before each step the
requests whose arrival time has passed are added; every token's time is the end of the step that
produced it. ``--http``: the same workload through ``spear serve`` on a loopback port with the official
``openai`` client (streaming), spread over ``--client-procs`` processes of its own so that its
parsing stays out of the numbers, times taken by the client. ``--workload`` takes several
workloads (comma-separated) for one table; ``--cpu`` runs a given shape on the CPU (a small shape's
steps take milliseconds: what the front door costs shows).

Reported: TTFT p50/p99 (arrival to first token), ITL p50/p99/max (between consecutive tokens of a
request), output tokens/s (all output tokens over the time from the first arrival to the last
token), engine step time p50 split decode-only / mixed (in-process only), and the steps that took
more than twice the median step of the same token count ("stalls", e.g. a compilation).
The workloads and metrics are serving_cases.py's, the HTTP path serving_http.py's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_cases import GROUP, SHAPES, IdsTokenizer, attach_ecs, build_model, remove_ecs  # noqa: E402
from serving_cases import SATURATING, Request, Trace, percentile, summarize, workload  # noqa: E402,F401
from serving_http import run_http, write_folder  # noqa: E402
from spear.config import QuantConfig  # noqa: E402
from spear.kernels.policy import KernelPolicy  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402
from spear.serve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


# ----------------------------------------------------------------------------- runs

def run_in_process(engine: LLMEngine, reqs: list[Request]) -> Trace:
    trace = Trace(arrivals=[r.arrival for r in reqs], tokens=[[] for _ in reqs])
    cuda = engine.core.runner.device.type == "cuda"
    engine.core.last_step = None
    pending = list(range(len(reqs)))
    index: dict[str, int] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and reqs[pending[0]].arrival <= now:
            i = pending.pop(0)
            r = reqs[i]
            rid = engine.add_request(r.prompt, SamplingParams(max_tokens=r.output, temperature=0, ignore_eos=True),
                                     arrival_time=t0 + r.arrival)
            index[rid] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(reqs[pending[0]].arrival - now, 0.01)))
            continue
        s0 = time.perf_counter()
        outs = engine.step()  # sampling reads the logits back: the step has finished on return
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        if engine.core.last_step is not None:
            trace.steps.append((engine.core.last_step.num_tokens, engine.core.last_step.decode_only, end - s0))
            trace.records.append(engine.core.last_step)
        for o in outs:
            if o.error is None and o.new_token_ids:
                trace.tokens[index[o.request_id]].extend([end - t0] * len(o.new_token_ids))
    return trace


def profile_mixed(engine: LLMEngine, vocab: int, decodes: int = 20, prompt: int = 2048, steps: int = 3) -> str:
    """torch.profiler over ``steps`` mixed steps: ``decodes`` running decodes (128-token prompts) beside
    a chunk of a ``prompt``-token request, i.e. decodes + (budget - decodes) prefill tokens per step.
    Returns the step records and the operator tables sorted by CPU and by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(1)
    short, prompt = min(128, engine.core.max_model_len // 4), min(prompt, engine.core.max_model_len - 1)
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(short)],
                               SamplingParams(max_tokens=engine.core.max_model_len - short, temperature=0,
                                              ignore_eos=True))
            for _ in range(decodes)]
    engine.core.last_step = None
    while engine.core.last_step is None or not engine.core.last_step.decode_only:
        engine.step()
    long_ids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt)],
                                   SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                for _ in range(2)]
    cuda = engine.core.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    records = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            s = engine.core.last_step
            records.append((s.num_tokens, s.num_seqs, s.decode_only, round(1e3 * s.seconds, 1)))
    for rid in rids + long_ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    avg = prof.key_averages()
    text = [f"steps (tokens, seqs, decode_only, ms): {records}",
            avg.table(sort_by="self_cpu_time_total", row_limit=30)]
    if cuda:
        text.append(avg.table(sort_by="self_cuda_time_total", row_limit=30))
    return "\n".join(text)


def build_variants(args, device, dtype):
    """(name, model) pairs on one set of random weights; the model is changed between them."""
    model = build_model(args.shape, args.layers, device, dtype)
    if "fp16" in args.variants:
        yield "fp16" if dtype == torch.float16 else "fp32", model
    modules = quantize_model_rtn(model, QuantConfig(bits=4, group_size=GROUP), progress=False)
    if "w4" in args.variants:
        yield "w4", model
    if "w4+ec" in args.variants:
        n, pct = attach_ecs(modules, 16, 16, args.ec_budget, model)
        yield f"w4+ec ({pct:.2f}%)", model
        remove_ecs(modules)


@dataclass(frozen=True)
class Load:
    """One workload: seeded Poisson arrivals of prompts and outputs of the given lengths."""

    name: str
    requests: int
    rate: float
    prompt_min: int
    prompt_max: int
    output: int
    output_max: int | None
    max_num_seqs: int

    @property
    def max_len(self) -> int:
        return self.prompt_max + (self.output_max or self.output) + 1

    def describe(self) -> str:
        outputs = f"{self.output}" if self.output_max is None else f"{self.output}-{self.output_max}"
        return (f"{self.name}: {self.requests} requests, Poisson {self.rate:g}/s, prompts {self.prompt_min}-"
                f"{self.prompt_max}, {outputs} output tokens, max_num_seqs {self.max_num_seqs}")


def loads_of(args) -> list[Load]:
    """The workloads the arguments name: ``default`` from --requests etc., ``saturating`` from
    SATURATING (both shrunk by --tiny)."""
    loads = []
    for name in args.workload:
        kw = dict(requests=args.requests, rate=args.rate, prompt_min=args.prompt_min, prompt_max=args.prompt_max,
                  output=args.output, output_max=None, max_num_seqs=args.max_num_seqs)
        if name == "saturating":
            kw.update(SATURATING)
        if args.tiny:
            kw.update(requests=6, rate=40.0, prompt_min=8, prompt_max=40, output=6, max_num_seqs=8,
                      output_max=10 if name == "saturating" else None)
        loads.append(Load(name, **kw))
    return loads


def run_variant(args, name: str, model, load: Load, budgets: list[int], targets: list[float], policy, device, dtype,
                scratch: Path) -> list[dict]:
    """One variant under one workload: per token budget (and latency target), the paths asked for."""
    rows, folder = [], None
    vocab = SHAPES[args.shape]["vocab_size"]
    reqs = workload(load.requests, load.rate, load.prompt_min, load.prompt_max, load.output, vocab, args.seed,
                    load.output_max)
    max_len = max(load.max_len, 160) if args.tiny and targets else load.max_len  # the tiny profile grid's contexts
    ceiling = args.slo_ceiling or max(budgets)
    if args.tiny:
        ceiling = max(ceiling, 64)  # the tiny profile grid: steps of up to 64 tokens
    for budget, target in [(b, None) for b in budgets] + [(ceiling, x) for x in targets]:
        cfg = EngineConfig(max_num_seqs=load.max_num_seqs, max_num_batched_tokens=max(budget, load.max_num_seqs),
                           max_model_len=max_len, kernels=policy, itl_slo_ms=target,
                           num_blocks=load.max_num_seqs * math.ceil(max_len / 16) + 16)
        label = budget if target is None else f"SLO {target:g} ms (<= {budget})"
        common = dict(variant=name, workload=load.name, budget=label)
        if "http" in args.paths and (target is None or not args.tiny):
            if folder is None:
                t0 = time.perf_counter()
                folder = write_folder(model, name, name.startswith("w4"), scratch / "model")
                print(f"  {name}: wrote {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
            for _ in range(args.passes):
                trace, ready_s = run_http(folder, cfg, dtype, reqs, client_procs=args.client_procs, device=device,
                                          core_threads=args.core_threads)
            rows.append(dict(common, path="HTTP", warmup_s=ready_s, **summarize(trace, target)))
            print("  " + json.dumps(rows[-1]), flush=True)
        if "in-process" not in args.paths:
            continue
        t0 = time.perf_counter()
        if target is not None and args.tiny:  # the start-up grid needs 256-token contexts: a tiny one
            from spear.serve.latency.profiler import TINY_GRID, profile

            cfg.latency_table = profile(LLMEngine(model, IdsTokenizer(), replace(cfg, itl_slo_ms=None)).core,
                                        TINY_GRID, repeats=2)
        engine = LLMEngine(model, IdsTokenizer(), cfg)  # with a target: profiles its latency table
        warm = engine.warmup()
        print(f"  {name} {load.name} budget {label}: engine in {time.perf_counter() - t0:.1f} s (warm-up "
              f"{warm:.1f} s)", flush=True)
        for _ in range(args.passes):
            trace = run_in_process(engine, reqs)
        rows.append(dict(common, path="in process", warmup_s=warm, **summarize(trace, target)))
        print("  " + json.dumps(rows[-1]), flush=True)
        if args.profile and args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            slug = name.split(" ")[0].replace("+", "_")
            (Path(args.out) / f"profile-{slug}-{budget}.txt").write_text(
                profile_mixed(engine, vocab, decodes=min(20, load.max_num_seqs - 2)))
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="Llama-3-8B", help="one of: " + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    p.add_argument("--variants", default="fp16,w4,w4+ec", help="comma-separated: fp16, w4, w4+ec")
    p.add_argument("--budgets", default="512,2048", help="comma-separated max_num_batched_tokens")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--prompt-min", type=int, default=256)
    p.add_argument("--prompt-max", type=int, default=3072)
    p.add_argument("--output", type=int, default=128, help="output tokens per request")
    p.add_argument("--workload", default="default",
                   help="comma-separated: default (--requests, --rate, --prompt-min/max, --output, --max-num-seqs), "
                        "saturating (arrivals beyond FP16's capacity with varied lengths: module docstring) "
                        "(default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--ec-budget", type=float, default=0.01, help="EC bytes / W4 model bytes (default: 1%%)")
    p.add_argument("--passes", type=int, default=1, help="runs of the workload per engine; the last is reported")
    p.add_argument("--paths", default="in-process",
                   help="comma-separated: in-process (the engine stepped by this process), http (spear serve in a "
                        "process of its own on a folder this writes, the official openai client in --client-procs "
                        "processes) (default: %(default)s)")
    p.add_argument("--http", action="store_true", help="shorthand for --paths in-process,http")
    p.add_argument("--client-procs", type=int, default=4, help="processes of the HTTP client (default: %(default)s)")
    p.add_argument("--core-threads", type=int, help="torch threads of the engine core, in process and in spear serve "
                                                    "(default: spear serve's)")
    p.add_argument("--itl-slo-ms", default="",
                   help="comma-separated inter-token latency targets: per variant and target, one more run "
                        "under the latency-target scheduler (ceiling: the largest --budgets; the latency "
                        "table is profiled at start-up unless cached)")
    p.add_argument("--slo-ceiling", type=int, help="max_num_batched_tokens of the latency-target runs "
                   "(default: the largest --budgets)")
    p.add_argument("--profile", action="store_true",
                   help="after each run, torch.profiler over 3 mixed steps (20 decodes + a chunk) into --out")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU: smoke check")
    p.add_argument("--cpu", action="store_true", help="run --shape on the CPU in fp32 (a small shape: the front door)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for results.json and table.md")
    args = p.parse_args(argv)
    args.paths = ["in-process", "http"] if args.http else [x.strip() for x in args.paths.split(",") if x.strip()]
    if not args.paths or set(args.paths) - {"in-process", "http"}:
        p.error(f"--paths: choose from in-process, http; got {args.paths}")
    args.workload = [w.strip() for w in args.workload.split(",") if w.strip()]
    if not args.workload or set(args.workload) - {"default", "saturating"}:
        p.error(f"--workload: choose from default, saturating; got {args.workload}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(args.variants) - {"fp16", "w4", "w4+ec"}:
        p.error(f"--variants: choose from fp16, w4, w4+ec; got {args.variants}")
    if args.client_procs < 1:
        p.error("--client-procs must be >= 1")
    budgets = [int(b) for b in args.budgets.split(",")]
    targets = [float(x) for x in args.itl_slo_ms.split(",") if x.strip()]
    if args.tiny:
        args.shape, args.client_procs = "tiny", min(args.client_procs, 2)
        budgets = [min(b, 64) for b in budgets]
    if args.tiny or args.cpu:
        device, dtype = "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: the benchmark needs a GPU (use --tiny for a CPU smoke check, --cpu for a small "
                    "shape on the CPU)")
        device, dtype = "cuda", torch.float16
    from spear.serve.frontend.mp_client import default_torch_threads

    # the in-process engine on the threads spear serve's core gets
    torch.set_num_threads(args.core_threads or default_torch_threads(device))
    if args.shape not in SHAPES:
        p.error(f"unknown shape {args.shape}; known: {sorted(SHAPES)}")
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    policy = KernelPolicy()
    loads = loads_of(args)
    header = (f"Serving, {datetime.date.today().isoformat()}, {dev_name}, {args.shape}"
              + (f" ({args.layers} layers)" if args.layers else "") + f", {dtype}"
              + ("" if "http" not in args.paths else f", HTTP client in {args.client_procs} processes") + "; "
              + "; ".join(load.describe() for load in loads))
    print(header, flush=True)
    rows = []
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spear-bench-serving-") as scratch:
        for name, model in build_variants(args, device, dtype):
            for load in loads:
                rows += run_variant(args, name, model, load, budgets, targets, policy, device, dtype, Path(scratch))
    table = markdown(rows, header) + throughput_ratios(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"header": header, "args": vars(args), "rows": rows}, indent=2))
        (out / "table.md").write_text(table + "\n")
    return 0


def throughput_ratios(rows: list[dict]) -> str:
    """The table's foot: output tok/s of each W4 variant over FP16's at the same budget, workload and
    path; and the front door's cost: HTTP (client in processes of its own) against the engine in
    process, beside the floors (H200, whole Llama-3-8B shape)."""
    full = ("fp16", "fp32")  # the unquantized variant: fp32 on the CPU
    key = lambda r: (r["budget"], r.get("workload"), r.get("path"))  # noqa: E731
    fp = {key(r): r for r in rows if r["variant"] in full}
    lines = [f"{r['variant']} / {fp[key(r)]['variant']} output tok/s at budget {r['budget']} ({r.get('workload')}, "
             f"{r.get('path')}): {r['output_tok_s'] / fp[key(r)]['output_tok_s']:.2f}x"
             for r in rows if r["variant"] not in full and key(r) in fp]
    http = {(r["variant"], r["budget"], r.get("workload")): r for r in rows if r.get("path") == "HTTP"}
    for r in rows:
        h = http.get((r["variant"], r["budget"], r.get("workload"))) if r.get("path") == "in process" else None
        if h is not None:
            lines.append(f"{r['variant']} budget {r['budget']} {r.get('workload')}: HTTP / in process ITL p50 "
                         f"{h['itl_p50_ms'] / r['itl_p50_ms']:.2f}x, p99 {h['itl_p99_ms'] / r['itl_p99_ms']:.2f}x "
                         f"(floor <= 1.15x), max {h['itl_max_ms'] / r['itl_max_ms']:.2f}x (<= 1.5x); TTFT p50 "
                         f"{1e3 * (h['ttft_p50_s'] - r['ttft_p50_s']):+.0f} ms (<= +15 ms), p99 "
                         f"{1e3 * (h['ttft_p99_s'] - r['ttft_p99_s']):+.0f} ms (<= +50 ms); output tok/s "
                         f"{h['output_tok_s'] / r['output_tok_s']:.2f}x (saturating: >= 0.95x)")
            if "until_taken_p50_ms" in h:
                lines.append(f"  HTTP TTFT by hop, p50 / p99: the client sending late {h['client_late_p50_ms']:.1f} / "
                             f"{h['client_late_p99_ms']:.1f} ms, until the core took it {h['until_taken_p50_ms']:.1f} / "
                             f"{h['until_taken_p99_ms']:.1f} ms, then to the first token {h['taken_to_first_p50_ms']:.1f} / "
                             f"{h['taken_to_first_p99_ms']:.1f} ms")
            if "server_admit_p50_ms" in h:
                lines.append("  of 'until the core took it', p50 / p99: the server parsing the body "
                             f"{h['server_parse_p50_ms']:.1f} / {h['server_parse_p99_ms']:.1f} ms, preparing it "
                             f"{h['server_prepare_p50_ms']:.1f} / {h['server_prepare_p99_ms']:.1f} ms, waiting for the "
                             f"core {h['server_admit_p50_ms']:.1f} / {h['server_admit_p99_ms']:.1f} ms; outside the "
                             f"server (client and socket) {h['outside_server_p50_ms']:.1f} / "
                             f"{h['outside_server_p99_ms']:.1f} ms")
            if "output_delay_p50_ms" in h:
                lines.append("  in the server, p50 / p99 (bucket bounds): the core's message to its handling "
                             f"{h['output_delay_p50_ms']:.1f} / {h['output_delay_p99_ms']:.1f} ms "
                             f"({h['output_delay_over_8ms_pct']:.2f}% over 8 ms); event-loop lag "
                             f"{h.get('loop_lag_p50_ms', float('nan')):.1f} / {h.get('loop_lag_p99_ms', float('nan')):.1f} ms "
                             f"({h.get('loop_lag_over_8ms_pct', float('nan')):.2f}% over 8 ms)")
            if "client_loop_lag_p50_ms" in h:
                lines.append(f"  in the clients: event-loop lag p50 / p99 / max {h['client_loop_lag_p50_ms']:.1f} / "
                             f"{h['client_loop_lag_p99_ms']:.1f} / {h['client_loop_lag_max_ms']:.1f} ms "
                             f"({h['client_loop_lag_over_8ms_pct']:.2f}% over 8 ms)")
    return ("\n\n" + "\n".join(lines)) if lines else ""


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| variant | workload | path | budget | mixed step p50 | decode step p50 | ITL p50 | ITL p99 | "
             "ITL max | TTFT p50 | TTFT p99 | output tok/s | stalls | SLO attained | predicted ±10% |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = lambda k: "—" if k not in r or not math.isfinite(r[k]) else f"{r[k]:.1f} ms"  # noqa: E731
        pct = lambda k, s: "—" if k not in r or not math.isfinite(r[k]) else f"{s * r[k]:.1f}%"  # noqa: E731
        lines.append(f"| {r['variant']} | {r.get('workload', 'default')} | {r.get('path', 'in process')} | "
                     f"{r['budget']} | {ms('mixed_step_p50_ms')} | {ms('decode_step_p50_ms')} | "
                     f"{ms('itl_p50_ms')} | {ms('itl_p99_ms')} | {ms('itl_max_ms')} | {r['ttft_p50_s']:.3f} s | "
                     f"{r['ttft_p99_s']:.3f} s | {r['output_tok_s']:.0f} | {r.get('stalls', '—')} | "
                     f"{pct('slo_attainment_pct', 1)} | {pct('prediction_within_10pct', 100)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
