"""Tensor-parallel decode: TP=1 against TP=2, W4 against W4+EC, the all-reduce against the peer reduction.

    python benchmarks/bench_tp.py --models Llama-3-8B,Llama-2-13B --out OUT     (two CUDA GPUs)
    python benchmarks/bench_tp.py --tiny                                         (CPU, gloo: a smoke check)

For each model shape: random HF-initialised weights (decode_cases.py), RTN W4 g128 on every linear
but the head, saved as spear checkpoints under OUT (each TP rank loads its share from disk): W4,
W4+EC with gated rank-16 ECs spread evenly up to ~1% of the W4 bytes, and W4+EC on every linear.
Each (variant, TP, reduction) runs an engine of its own and times ``engine.step()`` (wall clock,
CUDA synchronized: what a client's next token waits for) over decode-only steps at 1 / 8 / 32
running sequences, median after warm-up steps. Prints a Markdown table (ms/step, tok/s, TP=2
against TP=1, W4+EC against W4 at the same TP and reduction) with date and device, and writes
results.json and table.md to OUT.

The floors it measures (BENCHMARKS.md): TP=2 W4+EC <= 1.10x TP=2 W4 at batch 1; TP=2 W4 <= 0.6x
TP=1 W4 at batch 1 on the 13B shape; the compensator's reduction <= 1 us per row-parallel layer over
W4's own with the peer path (per layer = (W4+EC - W4) / (2 x layers) at TP=2, against the same at TP=1).
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
from spear.models.checkpoint import save_checkpoint  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402
from spear.serve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def write_checkpoints(shape: str, layers: int | None, device: str, dtype, out: Path, ec_budget: float,
                      ec_rank: int, ec_hidden: int) -> dict[str, tuple[Path, float]]:
    """variant -> (checkpoint folder, EC bytes in % of the W4 model)."""
    model = build_model(shape, layers, device, dtype)
    qcfg = QuantConfig(bits=4, group_size=GROUP)
    modules = quantize_model_rtn(model, qcfg, progress=False)
    made = {}
    for name, budget in (("w4", 0.0), ("w4+ec", ec_budget), ("w4+ec-all", None)):
        pct = 0.0
        if name != "w4":
            _, pct = attach_ecs(modules, ec_rank, ec_hidden, budget, model)
        path = out / f"ckpt-{shape}-{name}"
        save_checkpoint(model, IdsTokenizer(), path, qcfg, f"random {shape}", overwrite=True)
        made[name] = (path, pct)
        remove_ecs(modules)
    del model, modules
    gc.collect()
    return made


def time_steps(engine: LLMEngine, batch: int, prompt_len: int, steps: int, warmup: int, vocab: int) -> float:
    """Median wall time (ms) of decode-only ``engine.step()`` at ``batch`` running sequences."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=warmup + steps, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    times, seen = [], 0
    cuda = engine.core.runner.device.type == "cuda"
    while engine.has_unfinished():
        sched = engine.core.scheduler
        decode_only = not sched.waiting and len(sched.running) == batch and all(s.is_decode for s in sched.running)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if decode_only:
            seen += 1
            if seen > warmup:
                times.append(1e3 * dt)
    return statistics.median(times) if times else float("nan")


def run(path: Path, tp: int, reduce: str, args, device: str, dtype, vocab: int) -> dict:
    max_len = args.prompt_len + args.warmup + args.steps + 1
    cfg = EngineConfig(max_num_seqs=max(args.batches), max_num_batched_tokens=max(512, max(args.batches)),
                       max_model_len=max_len, num_blocks=max(args.batches) * math.ceil(max_len / 16) + 8,
                       cuda_graphs=device == "cuda", tensor_parallel_size=tp, tp_reduce=reduce)
    t0 = time.perf_counter()
    row = {"tp": tp, "reduce": reduce if tp > 1 else "-"}
    with LLMEngine.from_pretrained(str(path), cfg, dtype=dtype, device=device, tokenizer=IdsTokenizer()) as engine:
        row["start_s"] = time.perf_counter() - t0
        for b in args.batches:
            ms = time_steps(engine, b, args.prompt_len, args.steps, args.warmup, vocab)
            row[f"ms@{b}"], row[f"tok_s@{b}"] = ms, 1e3 * b / ms
            print(f"    TP={tp} {row['reduce']:9s} batch {b:3d}: {ms:8.3f} ms/step {row[f'tok_s@{b}']:10.1f} tok/s",
                  flush=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(results: list[dict], batches: list[int], header: str) -> str:
    lines = [header, "", "| model | variant | EC % | TP | reduction | " + " | ".join(f"ms b={b}" for b in batches)
             + " | tok/s b=" + str(batches[-1]) + " | TP=2 / TP=1 (b=1) | vs W4 (b=1) |",
             "|" + "---|" * (7 + len(batches))]
    for r in results:
        one = next((x for x in results if x["model"] == r["model"] and x["variant"] == r["variant"]
                    and x["tp"] == 1), None)
        w4 = next((x for x in results if x["model"] == r["model"] and x["variant"] == "w4" and x["tp"] == r["tp"]
                   and x["reduce"] == r["reduce"]), None)
        b1 = f"ms@{batches[0]}"
        lines.append(f"| {r['model']} | {r['variant']} | {r['ec_pct']:.2f} | {r['tp']} | {r['reduce']} | "
                     + " | ".join(f"{r[f'ms@{b}']:.3f}" for b in batches)
                     + f" | {r[f'tok_s@{batches[-1]}']:,.0f} | "
                     + (f"{r[b1] / one[b1]:.3f}×" if one and r["tp"] > 1 else "—") + " | "
                     + (f"{r[b1] / w4[b1]:.3f}×" if w4 and r["variant"] != "w4" else "—") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="Llama-3-8B,Llama-2-13B", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    p.add_argument("--batches", default="1,8,32", help="running sequences (default: %(default)s)")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes (default: %(default)s)")
    p.add_argument("--reduce", default="allreduce,peer", help="reductions at TP > 1 (default: %(default)s)")
    p.add_argument("--variants", default="w4,w4+ec,w4+ec-all", help="of w4, w4+ec, w4+ec-all")
    p.add_argument("--ec-budget", type=float, default=0.01, help="W4+EC: EC bytes / W4 bytes (default: 1%%)")
    p.add_argument("--ec-rank", type=int, default=16)
    p.add_argument("--ec-hidden", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU over gloo: smoke check")
    p.add_argument("--out", help="folder for the checkpoints, results.json and table.md (default: a temporary one)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    tps = [int(t) for t in args.tp.split(",")]
    reduces = [r.strip() for r in args.reduce.split(",") if r.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - {"w4", "w4+ec", "w4+ec-all"} or set(reduces) - {"allreduce", "peer"}:
        p.error("--variants: of w4, w4+ec, w4+ec-all; --reduce: of allreduce, peer")
    if args.tiny:
        device, dtype, models = "cpu", torch.float32, ["tiny"]
        args.batches, args.steps, args.warmup, args.prompt_len = [1, 2], 4, 1, 8
        tps, reduces = [t for t in tps if t <= 2], ["allreduce"]
    else:
        if not torch.cuda.is_available() or torch.cuda.device_count() < max(tps):
            p.error(f"needs {max(tps)} CUDA GPUs (use --tiny for a CPU smoke check)")
        device, dtype = "cuda", torch.float16
        models = [m.strip() for m in args.models.split(",")]
        unknown = [m for m in models if m not in SHAPES]
        if unknown:
            p.error(f"unknown model shape(s) {unknown}; known: {sorted(SHAPES)}")
    import tempfile

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-tp-"))
    out.mkdir(parents=True, exist_ok=True)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    header = (f"Tensor-parallel decode, {datetime.date.today().isoformat()}, {dev_name}, {dtype}, engine.step() "
              f"median over {args.steps} decode steps after {args.warmup}, prompts of {args.prompt_len} tokens, "
              f"RTN W4 g{GROUP}, gated ECs rank {args.ec_rank} hidden {args.ec_hidden}")
    print(header, flush=True)
    results = []
    for shape in models:
        t0 = time.perf_counter()
        ckpts = write_checkpoints(shape, args.layers, device, dtype, out, args.ec_budget, args.ec_rank, args.ec_hidden)
        print(f"{shape}: checkpoints written in {time.perf_counter() - t0:.1f} s", flush=True)
        for variant in variants:
            path, pct = ckpts[variant]
            for tp in tps:
                for reduce in (reduces if tp > 1 else ["allreduce"]):
                    row = run(path, tp, reduce, args, device, dtype, SHAPES[shape]["vocab_size"])
                    results.append(dict(row, model=shape + (f" ({args.layers}L)" if args.layers else ""),
                                        variant=variant, ec_pct=pct))
        (out / "results.json").write_text(json.dumps(results, indent=1))  # kept if a later shape is cut short
    table = markdown(results, args.batches, header)
    print(table)
    (out / "table.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
