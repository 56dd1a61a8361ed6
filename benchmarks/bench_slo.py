"""The acceptance grid of latency-target scheduling (``slo_cases.py``) on the engine, in process.

    python benchmarks/bench_slo.py --out OUT                                   # H200: the whole grid
    python benchmarks/bench_slo.py --densities none,1% --workloads mixed --out OUT   # a part of it
    python benchmarks/bench_slo.py --tiny --out OUT                            # CPU smoke check (CI)

Per compensator density (``slo_cases.DENSITIES``: none, gated rank-16 ECs spread to 1% of the W4
bytes, ECs on every linear) one random model at the shape (HF init, fp16 on CUDA, RTN W4 g128);
per workload (``slo_cases.WORKLOADS``, seeded Poisson arrivals, random prompt ids, EOS ignored)
each static budget runs once and is scored against every target (its schedule does not depend on
the target), and the latency-target scheduler runs once per target with the largest static
budget as its ceiling, on that budget's engine (the same deployment: after the static runs its
scheduler takes the latency table and the target, with a fresh online correction each run); the
table is profiled once and cached for the deployment (``spear profile``'s quick grid). One engine
per budget serves every workload (its max_model_len the longest workload's). Requests are replayed in real time against
``LLMEngine`` as in ``bench_serving.py``: a token's time is the end of the step that made it.

Writes ``results.json`` (every row: case, metrics, prediction accuracy of the latency-target runs),
``steps.json`` (per run, every step: decodes, tokens, padded tokens, decode context, predicted,
measured and interval ms), ``table.md`` and ``floors.md`` (``slo_cases.floors`` on the rows
present; a floor whose rows are missing is not listed). A case that raises is recorded with its error; a CUDA error ends the run
(the process's CUDA context is lost), with the rows so far written.
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
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import slo_cases as cases  # noqa: E402
from bench_serving import run_in_process  # noqa: E402
from serving_cases import Request, percentile  # noqa: E402
from decode_cases import GROUP, SHAPES, IdsTokenizer, attach_ecs, build_model, remove_ecs  # noqa: E402
from spear.config import QuantConfig  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402
from spear.serve import EngineConfig, LLMEngine  # noqa: E402

TINY_WORKLOADS = (cases.Workload("mixed", 6, 40.0, 8, 40, 6, 0), cases.Workload("heavy", 8, 60.0, 16, 60, 8, 1))
TINY_STATIC, TINY_CEILING = (16, 32, 64), 64  # the tiny profile grid: steps of up to 64 tokens


def latency_table(engine: LLMEngine, tiny: bool):
    """The engine's deployment table: the cached one or the quick grid's (``spear profile``); on the
    tiny model the tiny grid (the quick grid needs 256-token contexts)."""
    from spear.serve.latency.profiler import TINY_GRID, profile, table_for

    if engine.core.scheduler.latency is not None:
        return engine.core.scheduler.latency
    return profile(engine.core, TINY_GRID, repeats=2) if tiny else table_for(engine.core)


STEP_COLUMNS = ["decodes", "tokens", "padded_tokens", "decode_context", "predicted_ms", "measured_ms", "interval_ms"]


def step_row(r, engine: LLMEngine) -> list:
    """One StepRecord as STEP_COLUMNS (padded: the size of the mixed-step graph it replayed)."""
    pred = None if r.predicted_ms is None else round(r.predicted_ms, 3)
    return [r.num_decodes, r.num_tokens, 0 if r.decode_only else engine.core.scheduler.padded(r.num_tokens),
            round(r.decode_context, 1), pred, round(r.measured_ms, 3), round(r.interval_ms, 3)]


def requests_of(workload: cases.Workload, vocab: int) -> list[Request]:
    rng = random.Random(workload.seed + 1000)
    return [Request(r.arrival_s, [rng.randrange(vocab) for _ in range(r.prompt_tokens)], r.output_tokens)
            for r in workload.requests()]


def timings_of(trace) -> list[cases.RequestTiming]:
    return [cases.RequestTiming(a, tuple(t)) for a, t in zip(trace.arrivals, trace.tokens)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="Llama-3-8B", help="one of: " + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    p.add_argument("--densities", default=",".join(d.name for d in cases.DENSITIES),
                   help="comma-separated, of: " + ", ".join(d.name for d in cases.DENSITIES).replace("%", "%%"))
    p.add_argument("--workloads", default=",".join(w.name for w in cases.WORKLOADS),
                   help="comma-separated, of: " + ", ".join(w.name for w in cases.WORKLOADS))
    p.add_argument("--targets", default=",".join(f"{t:g}" for t in cases.TARGETS_MS), help="ITL targets in ms")
    p.add_argument("--budgets", default=",".join(map(str, cases.STATIC_BUDGETS)),
                   help="static token budgets (the largest is the latency-target scheduler's ceiling); e.g. add 384 "
                        "to look for a budget tuned on plain W4 that misses once compensators are dense "
                        "(default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU, tiny workloads: smoke check")
    p.add_argument("--out", required=True, help="folder for results.json, table.md and floors.md")
    args = p.parse_args(argv)
    known_d, known_w = {d.name: d for d in cases.DENSITIES}, {w.name: w for w in cases.WORKLOADS}
    densities = [d.strip() for d in args.densities.split(",") if d.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(densities) - set(known_d) or set(workloads) - set(known_w) or not densities or not workloads:
        p.error(f"--densities from {list(known_d)}, --workloads from {list(known_w)}")
    try:
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        p.error(f"--targets: numbers of milliseconds, got {args.targets!r}")
    if not targets or not all(math.isfinite(t) and t > 0 for t in targets):
        p.error(f"--targets: positive milliseconds, got {args.targets!r}")
    try:
        budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        p.error(f"--budgets: whole numbers of tokens, got {args.budgets!r}")
    if not budgets or budgets[0] < 1:
        p.error(f"--budgets: positive token counts, got {args.budgets!r}")
    statics = [cases.Scheduler(f"static {b}", b, False) for b in budgets]
    if args.tiny:
        device, dtype, args.shape, args.max_num_seqs = "cpu", torch.float32, "tiny", 8
        workloads_of = {w.name: w for w in TINY_WORKLOADS}
        statics = [replace(s, name=f"static {b}", max_num_batched_tokens=b) for s, b in zip(statics, TINY_STATIC)]
        ceiling = TINY_CEILING
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: the grid needs a GPU (use --tiny for a CPU smoke check)")
        device, dtype, workloads_of = "cuda", torch.float16, known_w
        ceiling = max(s.max_num_batched_tokens for s in statics)
    if args.shape not in SHAPES:
        p.error(f"unknown shape {args.shape}; known: {sorted(SHAPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    header = (f"Latency-target grid, {datetime.date.today().isoformat()}, {dev_name}, {args.shape}"
              + (f" ({args.layers} layers)" if args.layers else "") + f", {dtype}, in process")
    print(header, flush=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    rows: list[dict] = []
    case_rows: list[tuple] = []
    steps: dict[str, list] = {}

    def write():
        (out / "results.json").write_text(json.dumps({"header": header, "args": vars(args), "rows": rows}, indent=2))
        (out / "steps.json").write_text(json.dumps({"columns": STEP_COLUMNS, "runs": steps}))
        (out / "table.md").write_text(markdown(rows, header) + "\n")
        (out / "floors.md").write_text(cases.floors_markdown(cases.floors(case_rows) if case_rows else []))

    model = build_model(args.shape, args.layers, device, dtype)
    modules = quantize_model_rtn(model, QuantConfig(bits=4, group_size=GROUP), progress=False)
    try:
        for dname in densities:
            density = known_d[dname]
            ec_pct = 0.0
            if density.rank:
                _, ec_pct = attach_ecs(modules, density.rank, density.hidden, density.budget, model)
            # one engine per budget serves every workload (max_model_len their longest), and the
            # latency-target runs reuse the engine of the static budget equal to their ceiling (the same
            # deployment): its scheduler gets the table and the target, a fresh correction each run
            max_len = max(max(w.prompt_max + w.output_tokens + 1 for w in map(workloads_of.get, workloads)),
                          160 if args.tiny else 0)
            cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                               num_blocks=args.max_num_seqs * math.ceil(max_len / 16) + 16)
            engine = None
            for sched, target in [(s, None) for s in statics] + [(cases.SCHEDULERS[-1], t) for t in targets]:
                budget = ceiling if sched.slo else sched.max_num_batched_tokens
                cfg = replace(cfg, max_num_batched_tokens=max(budget, args.max_num_seqs))
                for wname in workloads:
                    workload = workloads_of[wname]
                    base = dict(density=dname, ec_pct=round(ec_pct, 3), workload=wname, scheduler=sched.name,
                                budget=budget)
                    try:
                        if engine is None or engine.core.config.max_num_batched_tokens != cfg.max_num_batched_tokens:
                            engine = None
                            gc.collect()
                            if device == "cuda":
                                torch.cuda.empty_cache()
                            engine = LLMEngine(model, IdsTokenizer(), cfg)
                            engine.warmup()
                        if target is not None:
                            engine.core.scheduler.set_latency(latency_table(engine, args.tiny), target, cfg.min_chunk_tokens)
                        trace = run_in_process(engine, requests_of(workload, vocab))
                    except Exception as exc:  # recorded; a CUDA error ends the run
                        rows.append(dict(base, target_ms=target, error=repr(exc)))
                        print(f"  {base}: {exc!r}", flush=True)
                        if device == "cuda" and "CUDA" in str(exc):
                            raise
                        engine = None
                        continue
                    timings = timings_of(trace)
                    steps[f"{dname} / {wname} / {sched.name}" + ("" if target is None else f" @ {target:g} ms")] = [
                        step_row(r, engine) for r in trace.records]
                    for t in (targets if target is None else [target]):
                        m = cases.summarize(timings, t)
                        # the prefill tokens of the median step that held decodes and a chunk
                        chunks = [r.prefill_tokens for r in trace.records if r.prefill_tokens and r.num_decodes]
                        m["chunk_p50"] = percentile(chunks, 0.5) if chunks else 0.0
                        if target is not None:
                            m["prediction_within_10pct"] = cases.prediction_accuracy(trace.records)
                            m["latency_margin"] = engine.core.scheduler.latency.margin
                        row = dict(base, target_ms=t, **m)
                        rows.append(row)
                        case_rows.append((cases.Case(t, density, workload, sched), m))
                        print("  " + json.dumps(row), flush=True)
                    write()
            engine = None
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            if density.rank:
                remove_ecs(modules)
    finally:
        write()
    print(markdown(rows, header))
    print((out / "floors.md").read_text())
    return 0


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| density | workload | scheduler | target | ITL p99 | SLO attained | TTFT p50 / p99 | "
             "output tok/s | chunk p50 | predicted ±10% |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['density']} | {r['workload']} | {r['scheduler']} | {r['target_ms']} | "
                         f"error: {r['error'][:80]} | | | | | |")
            continue
        acc = r.get("prediction_within_10pct")
        lines.append(f"| {r['density']} ({r['ec_pct']:.2f}%) | {r['workload']} | {r['scheduler']} | "
                     f"{r['target_ms']:g} ms | {r['itl_p99_ms']:.1f} ms | {r['slo_attainment_pct']:.1f}% | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms | {r['output_tok_s']:.0f} | "
                     f"{r['chunk_p50']:.0f} | {'—' if acc is None else f'{100 * acc:.0f}%'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
