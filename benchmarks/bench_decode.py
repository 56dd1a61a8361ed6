"""Decode benchmark of the serving engine: FP16 vs W4 vs W4+EC at Llama-2-7B and Llama-3-8B shapes.

    python benchmarks/bench_decode.py --out results/decode               # H200: both shapes, 32 layers
    python benchmarks/bench_decode.py --layers 8 --models Llama-3-8B      # fewer layers, one shape
    python benchmarks/bench_decode.py --tiny                              # CPU smoke check (seconds)

Protocol (SPEAR.md §4): random weights (HF init, never zero), fp16 on CUDA. Variants run
one after another on the same weights:

  fp16    the HF-initialised model
  w4      RTN W4 (group 128, symmetric) on every linear but lm_head; on CUDA the engine packs
          each layer once for the Triton W4A16 kernel (spear/serve/model/layers/linear.py)
  w4+ec   w4 plus gated ECs (rank --ec-rank, gate hidden --ec-hidden) on evenly spread
          linears until the compensators reach --ec-budget of the W4 model's bytes (about
          1%); the kernel runs them fused at decode
  w4+ec-all  (--ec-all) the same ECs on every linear: the worst-case density
  w4 head     (--w4-head) w4 with the output head in W4 g128 too
  w4 w8-head  (--w8-head) w4 with the output head in W8 per-channel (the W8A16 kernel on CUDA)

Kernel options (--fused-max-m, --u-split-max, --pdl, --table, ...) build the engine's
KernelPolicy (spear/kernels/policy.py): a variant of the kernels is another policy.

Per variant and concurrency (1 and --batches): ``model`` is the median latency of one
decode step of the captured CUDA graph (CUDA events over replays, after warm-up),
``engine`` the median wall time of an LLMEngine decode step (scheduler, input
preparation, graph replay, sampling). Tokens/s = batch / latency. Ratios against FP16
and W4 come from the same run. On CPU (``--tiny``) only the engine time exists.
Prints a Markdown table with date and device; --out also writes results.json / table.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_cases import GROUP, SHAPES, IdsTokenizer, attach_ecs, build_model, remove_ecs  # noqa: E402
from spear.config import QuantConfig  # noqa: E402
from spear.kernels.policy import PDL_MODES, KernelPolicy  # noqa: E402
from spear.models.modules import set_module  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402
from spear.serve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

def graph_latency_ms(engine: LLMEngine, batch: int, reps: int) -> float | None:
    runner = engine.core.runner
    if not runner.graphs:
        return None
    graph = runner.graphs[next(b for b in runner.graphs if b >= batch)]
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# options that set a field of the engine's KernelPolicy: (option's dest, policy field)
POLICY_OPTIONS = (
    ("u_split_max", "u_split_max"),
    ("attn_max_splits", "attention_max_splits"),
    ("attn_min_split_tiles", "attention_min_split_tiles"),
    ("gate_programs", "gate_programs"),
    ("rope_in_attention", "rope_in_attention"),
    ("fused_max_m", "fused_max_m"),
    ("pdl", "pdl"),
    ("table", "launch_table"),
)


def policy_from(args) -> KernelPolicy:
    """The kernel policy the options ask for (the defaults where they are silent)."""
    return KernelPolicy(**{field: getattr(args, dest) for dest, field in POLICY_OPTIONS
                           if getattr(args, dest) is not None})


def _batch_list(text: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes >= 1, got {text!r}")
    return out


def kernel_profile(engine: LLMEngine, batch: int, reps: int = 10) -> list[dict] | None:
    """GPU time per decode step by kernel name (torch.profiler over graph replays), largest first,
    with the graph's wall time per step, so launch gaps show as the difference."""
    runner = engine.core.runner
    if not runner.graphs:
        return None
    from spear.kernels.timing import profile_graph

    graph = runner.graphs[next(b for b in runner.graphs if b >= batch)]
    return [{"kernel": k, "us_per_step": us, "calls_per_step": n} for k, us, n in profile_graph(graph, reps, reps)]


def engine_decode(engine: LLMEngine, batch: int, prompt_len: int, gen: int, warmup: int, reps: int, vocab: int):
    """Median engine step (ms) over decode-only steps at ``batch`` running sequences; graph latency."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=warmup + gen, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    times, seen = [], 0
    while engine.has_unfinished():
        sched = engine.core.scheduler
        decode_only = (not sched.waiting and len(sched.running) == batch
                       and all(s.is_decode for s in sched.running))
        if engine.core.runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()  # sampling reads the logits back: the step has finished on return
        dt = time.perf_counter() - t0
        if decode_only:
            seen += 1
            if seen > warmup:
                times.append(dt * 1e3)
    # the graph of this batch size, on the caches the run left (contents do not matter for timing)
    return statistics.median(times) if times else float("nan"), graph_latency_ms(engine, batch, reps)


def run_variant(model, name: str, args, device: str, batches: list[int], vocab: int, max_len: int) -> dict:
    cfg = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(512, max(batches)),
                       max_model_len=args.max_model_len or max_len, block_size=16,
                       num_blocks=max(batches) * math.ceil(max_len / 16) + 8, cuda_graphs=not args.no_graphs,
                       kernels=args.policy)
    t0 = time.perf_counter()
    engine = LLMEngine(model, IdsTokenizer(), cfg)
    # wall times of the stages, so a run cut short by a time limit shows where its time went
    print(f"  {name}: engine started in {time.perf_counter() - t0:.1f} s (packing, graph capture)", flush=True)
    row = {"variant": name}
    for b in batches:
        t0 = time.perf_counter()
        step_ms, graph_ms = engine_decode(engine, b, args.prompt_len, args.gen, args.warmup, args.reps, vocab)
        if args.profile and b in args.profile and device == "cuda":
            prof = kernel_profile(engine, b)
            if prof:
                row[f"kernels@{b}"] = prof
                total = sum(r["us_per_step"] for r in prof)
                print(f"  {name}: GPU kernel time {total:.0f} us per step of {1e3 * graph_ms:.0f} us; by kernel:")
                for r in prof[:12]:
                    print(f"    {r['us_per_step']:8.1f} us  {r['calls_per_step']:5.0f} calls  {r['kernel']}")
        row[f"engine_ms@{b}"], row[f"model_ms@{b}"] = step_ms, graph_ms
        lat = graph_ms if graph_ms is not None else step_ms
        row[f"tok_s@{b}"] = 1e3 * b / lat
        print(f"  {name:10s} batch {b:3d}: engine {step_ms:8.3f} ms/step  model "
              f"{'-' if graph_ms is None else f'{graph_ms:8.3f}'} ms/step  {row[f'tok_s@{b}']:9.1f} tok/s"
              f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(results: list[dict], batches: list[int], header: str) -> str:
    lines = [header, "",
             "| model | variant | EC modules | extra memory | ms/token b=1 (model) | ms/token b=1 (engine) | "
             "tok/s b=1 | " + " | ".join(f"tok/s b={b}" for b in batches[1:]) + " | b=1 speed vs FP16 | "
             "b=1 latency vs W4 |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|" * (len(batches) - 1) + "---:|---:|"]
    for r in results:
        model_ms = "—" if r["model_ms@1"] is None else f"{r['model_ms@1']:.3f}"
        lines.append(f"| {r['model']} | {r['variant']} | {r.get('ec_modules', '—')} | "
                     f"{r['extra_pct']:.2f}% | {model_ms} | {r['engine_ms@1']:.3f} | {r['tok_s@1']:.1f} | "
                     + " | ".join(f"{r[f'tok_s@{b}']:.1f}" for b in batches[1:])
                     + (f" | {r['speedup_vs_fp16']:.2f}x" if "speedup_vs_fp16" in r else " | —")
                     + f" | {r.get('latency_vs_w4', float('nan')):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="Llama-2-7B,Llama-3-8B", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's); fewer for a quick run")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU in fp32: smoke check")
    p.add_argument("--batches", default="1,8,32,64", help="concurrent sequences; must start with 1")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=64, help="timed decode steps per run")
    p.add_argument("--max-model-len", type=int,
                   help="the engine's max_model_len, as a server would set it (e.g. 8192): the decode graphs' "
                        "block tables are that wide, which the host pays for at every step; the KV cache stays "
                        "sized for this run (default: prompt + warm-up + timed steps + 1)")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    p.add_argument("--reps", type=int, default=100, help="graph replays per model timing")
    p.add_argument("--ec-rank", type=int, default=16)
    p.add_argument("--ec-hidden", type=int, default=16)
    p.add_argument("--ec-budget", type=float, default=0.01, help="EC bytes / W4 model bytes (default: 1%%)")
    p.add_argument("--ec-all", action="store_true", help="also run ECs on every linear")
    p.add_argument("--no-graphs", action="store_true", help="eager decode on CUDA")
    p.add_argument("--w4-head", action="store_true",
                   help="one more variant, 'w4 head': W4 with the output head quantized too (spear quantize "
                        "--include-lm-head); the head is the largest single matrix of Llama-3-8B (1 GB in fp16)")
    p.add_argument("--w8-head", action="store_true",
                   help="one more variant, 'w4 w8-head': W4 with the output head in W8 per-channel (spear "
                        "quantize --lm-head-bits 8), served by the W8A16 kernel")
    p.add_argument("--fused-max-m", type=int,
                   help="decode: up to this many sequences the ECs run in the one-launch fused kernel, above it "
                        "semi-fused (KernelPolicy.fused_max_m)")
    p.add_argument("--rope-in-attention", action=argparse.BooleanOptionalAction,
                   help="decode: rotary and the new token's cache write inside the attention kernel, or "
                        "(--no-rope-in-attention) in a launch of their own (KernelPolicy.rope_in_attention)")
    p.add_argument("--out", help="folder for results.json and table.md")
    p.add_argument("--u-split-max", type=int,
                   help="fused EC: at most this many u = A x programs per call (KernelPolicy.u_split_max)")
    p.add_argument("--attn-max-splits", type=int,
                   help="decode attention: at most this many context splits (1: one program per sequence and "
                        "kv head; KernelPolicy.attention_max_splits)")
    p.add_argument("--attn-min-split-tiles", type=int,
                   help="decode attention: key tiles per context split at the least "
                        "(KernelPolicy.attention_min_split_tiles)")
    p.add_argument("--pdl", nargs="?", const="wait", choices=PDL_MODES,
                   help="programmatic dependent launch of the decode kernels (Hopper; KernelPolicy.pdl): 'wait' "
                        "(the bare flag) lets a kernel start as the one before it exits; 'auto' (the default) "
                        "'wait' on the decode graphs of up to 32 sequences, 'off' elsewhere")
    p.add_argument("--gate-programs", type=int,
                   help="semi-fused EC (batches above 64): split ec_gate over K up to about this many programs "
                        "(KernelPolicy.gate_programs)")
    p.add_argument("--no-fp16", action="store_true",
                   help="skip the FP16 baseline (A/B runs of the W4 kernels; no ratio to FP16)")
    p.add_argument("--profile", nargs="?", const="1", type=_batch_list, metavar="BATCHES",
                   help="also print and store the GPU time per kernel of a decode step (torch.profiler) at these "
                        "comma-separated batch sizes (default with no value: 1)")
    p.add_argument("--table", help="launch_table.json (spear tune-kernels / bench_kernels.py --tune) for the W4 kernel")
    args = p.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",")]
    try:
        args.policy = policy_from(args)
    except ValueError as e:
        p.error(str(e))
    if batches[0] != 1:
        p.error("--batches must start with 1 (the batch-1 latency columns)")
    if args.tiny:
        device, dtype, models = "cpu", torch.float32, ["tiny"]
        args.gen, args.prompt_len = min(args.gen, 8), min(args.prompt_len, 16)
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: the benchmark needs a GPU (use --tiny for a CPU smoke check)")
        device, dtype, models = "cuda", torch.float16, args.models.split(",")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        p.error(f"unknown model shape(s) {unknown}; known: {sorted(SHAPES)}")
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    if args.pdl == "wait" and device != "cuda":
        p.error("--pdl wait needs a CUDA GPU")
    header = (f"Decode, {datetime.date.today().isoformat()}, {dev_name}, torch {torch.__version__}, "
              f"{dtype}, prompt {args.prompt_len} tokens, median of {args.gen} steps"
              + (f", {args.layers} layers" if args.layers else "")
              + (f", max_model_len {args.max_model_len}" if args.max_model_len else "")
              + (f", fused EC up to {args.fused_max_m} tokens" if args.fused_max_m is not None else "")
              + ({True: ", rotary in the attention kernel", False: ", rotary in its own launch", None: ""}
                 [args.rope_in_attention])
              + (f", attention splits <= {args.attn_max_splits}" if args.attn_max_splits is not None else "")
              + (f", u programs <= {args.u_split_max}" if args.u_split_max is not None else "")
              + (f", ec_gate programs <= {args.gate_programs}" if args.gate_programs is not None else "")
              + (f", programmatic dependent launch ({args.policy.pdl})" if args.policy.pdl != "off" and device == "cuda"
                 else "")
              + (f", launch table {args.table}" if args.table else ""))
    print(header, flush=True)
    max_len = args.prompt_len + args.warmup + args.gen + 1
    if args.max_model_len is not None and args.max_model_len < max_len:
        p.error(f"--max-model-len must be at least prompt + warm-up + timed steps + 1 = {max_len}")
    results = []
    for shape in models:
        print(f"{shape}: building random weights", flush=True)
        t0 = time.perf_counter()
        model = build_model(shape, args.layers, device, dtype)
        print(f"{shape}: weights built in {time.perf_counter() - t0:.1f} s", flush=True)
        vocab = model.config.vocab_size
        rows = []  # the engine reads the model's weights into its own: the model is never changed
        if not args.no_fp16:
            rows.append(dict(run_variant(model, "fp16" if dtype == torch.float16 else "fp32", args, device, batches,
                                         vocab, max_len), extra_pct=0.0))
        t0 = time.perf_counter()
        modules = quantize_model_rtn(model, QuantConfig(bits=4, group_size=GROUP), progress=False)
        print(f"{shape}: RTN W4 in {time.perf_counter() - t0:.1f} s", flush=True)
        rows.append(dict(run_variant(model, "w4", args, device, batches, vocab, max_len), extra_pct=0.0))
        ec_runs = [("w4+ec", args.ec_budget)] + ([("w4+ec-all", None)] if args.ec_all else [])
        for name, budget in ec_runs:
            n, pct = attach_ecs(modules, args.ec_rank, args.ec_hidden, budget, model)
            row = run_variant(model, name, args, device, batches, vocab, max_len)
            rows.append(dict(row, extra_pct=pct, ec_modules=f"{n}/{len(modules)} r{args.ec_rank}"))
            remove_ecs(modules)
        # the output head quantized too (QuantConfig.include_lm_head / head_bits); the rest as in w4
        heads = ([("w4 head", QuantConfig(bits=4, group_size=GROUP, include_lm_head=True))] if args.w4_head else []) \
            + ([("w4 w8-head", QuantConfig(bits=8, group_size=0, include_lm_head=True))] if args.w8_head else [])
        for name, head_cfg in heads:
            fp_head = model.get_output_embeddings()
            head = quantize_model_rtn(model, head_cfg, progress=False)
            rows.append(dict(run_variant(model, name, args, device, batches, vocab, max_len), extra_pct=0.0))
            set_module(model, next(iter(head)), fp_head)  # the fp16 head back for the next variant
        fp = None if args.no_fp16 else rows[0]
        w4 = next(r for r in rows if r["variant"] == "w4")
        for r in rows:
            r["model"] = shape + (f" ({args.layers}L)" if args.layers else "")
            if fp is not None:
                r["speedup_vs_fp16"] = r["tok_s@1"] / fp["tok_s@1"]
            r["latency_vs_w4"] = w4["tok_s@1"] / r["tok_s@1"]
        results += rows
        # this model's rows now, so that a run cut short (a device call's time limit) keeps them
        print(markdown(rows, batches, header), flush=True)
        del model, modules
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    table = markdown(results, batches, header)
    print()
    print(table)
    for r in results:  # the floors
        if r["variant"] == "w4" and "speedup_vs_fp16" in r:
            print(f"{r['model']}: W4 / FP16 batch-1 tokens/s = {r['speedup_vs_fp16']:.2f}x (floor 2.5x)")
        if r["variant"] in ("w4 head", "w4 w8-head") and "speedup_vs_fp16" in r:
            width = "W4" if r["variant"] == "w4 head" else "W8"
            print(f"{r['model']}: W4 with a {width} head / FP16 batch-1 tokens/s = {r['speedup_vs_fp16']:.2f}x")
        if r["variant"] == "w4+ec":
            print(f"{r['model']}: W4+EC / W4 batch-1 latency = {r['latency_vs_w4']:.3f} (ceiling 1.10)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        opts = {k: v for k, v in vars(args).items() if k != "policy"}
        (out / "results.json").write_text(json.dumps({"header": header, "args": opts, "results": results},
                                                     indent=2))
        (out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
