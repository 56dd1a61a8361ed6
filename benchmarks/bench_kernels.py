"""Kernel benchmark: W4A16 GEMM and W4 + error compensator against FP16 cuBLAS and torch int4.

    python benchmarks/bench_kernels.py --out results/kernels            # full sweep (H200: ~8 min)
    python benchmarks/bench_kernels.py --out results/kernels --quick    # 7B/8B shapes, fewer M and ranks
    python benchmarks/bench_kernels.py --out results/kernels --models Llama-2-7B,Llama-3-8B  # every M and rank
    python benchmarks/bench_kernels.py --out results/kernels --tune     # the N-major family's launch sweep
    ... --layout nmajor     # the N-major fallback layout instead of the fragment layout the engine serves
    ... --gate-programs 128 --table t.json   # kernel options build the KernelPolicy the variants run under

Protocol (SPEAR.md §4): random non-zero weights quantized with RTN (4 bit, group 128, asym),
fp16 activations; every variant is first checked against the fp32 reference at real shapes;
each timing is a CUDA graph of back-to-back calls replayed after warm-up, timed with CUDA
events, median over replays. The graph cycles through enough copies of the weights to
exceed twice the L2 cache, so each call streams its weights from HBM as in a real model
(a single weight buffer would be served from the 60 MB L2). All variants of one
(shape, M) are timed in the same run, so the ratios compare like with like.

Variants: fp16 (cuBLAS on the dequantized weight), int4mm (torch._weight_int4pack_mm, bf16),
w4 (spear::w4a16_ec without EC, as planned), w4_no_gluon (the same policy with the Gluon GEMM
off, on Hopper), w4_triton / w4_dqmm (the Triton GEMM and dequantize + cuBLAS), and per rank r
(gate hidden h = 32): fused, semi (side stream), serial (v-epilogue), ec (the op as planned) and
naive (w4 then torch ops for the EC). The fused and semi-fused variants run the planner's launches
for those forms (spear/kernels/planner.py).
Writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH, so a modified copy there wins

from kernel_cases import DEVICE, GROUP, HIDDEN, MODELS, Layer, layer_shapes, make_ec  # noqa: E402
from kernel_timing import ceilings, profile_calls, time_calls  # noqa: E402

from spear.kernels import ops  # noqa: E402
from spear.kernels.dequant import dequantize  # noqa: E402
from spear.kernels.ec import gate_splits  # noqa: E402
from spear.kernels.layout import Layout  # noqa: E402
from spear.kernels.ops import w4a16_linear  # noqa: E402
from spear.kernels.planner import EC, plan, target  # noqa: E402
from spear.kernels.policy import KernelPolicy  # noqa: E402
from spear.kernels.w4a16 import w4a16_matmul  # noqa: E402

M_ALL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
RANKS = [8, 16, 32, 64]
FUSED_MAX_M_TIMED = 64    # the fused kernel is timed up to here (threshold search)
SEMI_MIN_M_TIMED = 16     # the semi-fused path from here
SERIAL_MIN_M_TIMED = 256  # its serial variant (v-epilogue) from here


def naive_ec(y, x, e):
    """What one writes without kernels: W4, then the EC as separate torch ops."""
    u = x @ e.a.t()
    hdn = torch.nn.functional.silu(torch.addmm(e.b1, u, e.w1.t()))
    gamma = 1.0 + e.bound * torch.tanh(torch.addmm(e.b2, hdn, e.w2.t()))
    return torch.addmm(y, gamma * u, e.b.t(), alpha=e.alpha)


def variants(layer, m, ranks, ecs, policy: KernelPolicy):
    """name -> list of zero-arg callables (one per weight copy); x is shared."""
    x = torch.randn(m, layer.k, device=DEVICE).half()
    xb = x.bfloat16()
    table = policy.launch_table
    fmt = layer.w4[0].format
    # the semi-fused path with the W4 part the policy plans without the Gluon GEMM (the Triton GEMM, or
    # cuBLAS from the layout's threshold on; "ec" is the op as planned), and the fused launch the
    # planner gives each rank up to 64 tokens
    w4_plan = plan(m, layer.n, layer.k, 0, fmt, x.device, policy.replace(gluon=False))
    semi = dataclasses.replace(w4_plan, ec=EC.SEMI, gate_splits=gate_splits(m, layer.k, policy.gate_programs))
    fusing = policy.replace(fused_max_m=FUSED_MAX_M_TIMED)
    # default arguments bind each copy (and each rank's EC) at definition time
    v = {
        "fp16": [lambda w=w: torch.nn.functional.linear(x, w) for w in layer.fp16],
        "w4": [lambda w=w: w4a16_linear(x, w, policy=policy) for w in layer.w4],
    }
    if layer.int4 and (m < 1024 or layer.n == layer.k):  # slow at large M: q/o only there
        v["int4mm"] = [lambda w=w: torch._weight_int4pack_mm(xb, w[0], GROUP, w[1]) for w in layer.int4]
    if layer.layout is Layout.FRAGMENT and target(x.device).gluon:  # the policy's path with the Gluon GEMM off
        no_gluon = policy.replace(gluon=False)
        v["w4_no_gluon"] = [lambda w=w: w4a16_linear(x, w, policy=no_gluon) for w in layer.w4]
    if m >= 128 or layer.layout is Layout.FRAGMENT:
        v["w4_triton"] = [lambda w=w: w4a16_matmul(x, w, table=table) for w in layer.w4]
        v["w4_dqmm"] = [lambda w=w: torch.nn.functional.linear(x, dequantize(w, x.dtype)) for w in layer.w4]
    for r in ranks:
        e = ecs[r]
        v[f"ec r{r}"] = [lambda w=w, e=e: w4a16_linear(x, w, None, e, policy=policy) for w in layer.w4]
        v[f"naive r{r}"] = [lambda w=w, e=e: naive_ec(w4a16_linear(x, w, policy=policy), x, e) for w in layer.w4]
        if m <= FUSED_MAX_M_TIMED:
            fused = plan(m, layer.n, layer.k, e.kernel_rank, fmt, x.device, fusing).config
            v[f"fused r{r}"] = [lambda w=w, e=e, c=fused: w4a16_matmul(x, w, None, e, config=c) for w in layer.w4]
        if m >= SEMI_MIN_M_TIMED:
            v[f"semi r{r}"] = [lambda w=w, e=e: ops.run(semi, x, w, None, e, 0, 0, overlap=True) for w in layer.w4]
        if m >= SERIAL_MIN_M_TIMED:
            v[f"serial r{r}"] = [lambda w=w, e=e: ops.run(semi, x, w, None, e, 0, 0, overlap=False) for w in layer.w4]
    return x, v


def check(layer, m, ranks, ecs, log, policy):
    """Every variant against the fp32 reference before any timing."""
    x, v = variants(layer, m, ranks, ecs, policy)
    ok = True
    for name, fns in v.items():
        e = ecs[int(name.split("r")[-1])] if " r" in name else None
        out = fns[0]().float()
        expect = layer.reference(x if name != "int4mm" else x.bfloat16(), e)
        err = float((out - expect).abs().max() / expect.abs().max())
        sq = float(20 * torch.log10(expect.norm() / (out - expect).norm()))
        good = bool(torch.isfinite(out).all()) and sq > 35.0
        ok &= good or name == "int4mm"
        log.append(dict(n=layer.n, k=layer.k, m=m, variant=name, max_rel_err=err, sqnr_db=sq, ok=good))
        if not good:
            print(f"  CHECK FAILED {name} {layer.n}x{layer.k} M={m}: err {err:.2e} sqnr {sq:.1f} dB", flush=True)
    return ok


def floor_us(n, k, m, bw, peak):
    nbytes = n * k / 2 + 3 * n * k / GROUP + 2 * m * k + 2 * m * n
    return max(nbytes / bw, 2 * m * n * k / peak) * 1e6, nbytes, 2 * m * n * k


def _warm_one(m, ranks, n, k, policy, layout):
    """Compile every kernel variant that the sweep will launch at this M (into Triton's disk cache)."""
    layer = Layer(n, k, 0, with_int4=False, layout=Layout(layout))
    ecs = {r: make_ec(n, k, r) for r in ranks}
    _, v = variants(layer, m, ranks, ecs, policy)
    for fns in v.values():
        fns[0]()
    torch.cuda.synchronize()
    return m


def warm_cache(ms, ranks, layout, policy):
    """Triton compiles on one CPU thread per process; compile the sweep's kernels in parallel first."""
    import concurrent.futures as cf
    import multiprocessing as mp
    t = time.time()
    try:
        with cf.ProcessPoolExecutor(max_workers=min(12, len(ms)), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_warm_one, ms, [ranks] * len(ms), [512] * len(ms), [1024] * len(ms),
                          [policy] * len(ms), [layout] * len(ms)))
    except Exception as exc:  # only a speed-up: the sweep compiles on first use anyway
        print(f"parallel compile pass failed ({type(exc).__name__}: {exc}); compiling on first use", flush=True)
    print(f"compile pass for M in {ms}: {time.time() - t:.0f} s", flush=True)


# ----------------------------------------------------------------------------- sweep
def sweep(args, out_dir, policy):
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    models = args.models.split(",") if args.models else (["Llama-2-7B", "Llama-3-8B"] if args.quick else list(MODELS))
    if any(m not in MODELS for m in models):
        raise SystemExit(f"--models: choose from {', '.join(MODELS)}; got {args.models}")
    ms = [int(v) for v in args.ms.split(",")] if args.ms else ([1, 4, 16, 64, 512, 2048] if args.quick else M_ALL)
    ranks = [int(v) for v in args.ranks.split(",")] if args.ranks else ([16, 32] if args.quick else RANKS)
    if not args.no_warm:
        warm_cache(ms, ranks, args.layout, policy)
    bw, peak = ceilings()
    print("kernels from", Path(ops.__file__).parent, f"({policy})", flush=True)
    print(f"device {props.name}, L2 {l2 >> 20} MB; measured copy {bw / 1e12:.2f} TB/s, fp16 mm {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    has_int4 = hasattr(torch, "_weight_int4pack_mm")
    results, checks = [], []
    t_start = time.time()
    for model, proj, n, k in layer_shapes(models):
        if time.time() - t_start > args.budget_s:
            break
        layer = Layer(n, k, l2, with_int4=has_int4, layout=Layout(args.layout))
        ecs = {r: make_ec(n, k, r) for r in ranks}
        for m in (1, 512):
            check(layer, m, ranks, ecs, checks, policy)
        for m in ms:
            if time.time() - t_start > args.budget_s:
                print("time budget reached: stopping the sweep", flush=True)
                break
            _, v = variants(layer, m, ranks, ecs, policy)
            row = dict(model=model, proj=proj, n=n, k=k, m=m)
            for name, fns in v.items():
                try:
                    row[name] = time_calls(fns)
                except Exception as exc:  # a baseline may not support a shape; record why
                    row[name] = None
                    row[f"{name} error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            for name in (args.profile.split(",") if args.profile else []):
                if name in v:
                    row[f"{name} kernels"] = prof = profile_calls(v[name])
                    print(f"  {name} at M={m}: {row[name]:.1f} us per call, kernels "
                          + ", ".join(f"{k} {us:.1f} us x{c:.0f}" for k, us, c in prof), flush=True)
            row["floor_us"], row["bytes"], row["flops"] = floor_us(n, k, m, bw, peak)
            results.append(row)
            ec32 = row.get("ec r32") or row.get(f"ec r{ranks[-1]}")
            print(f"{model:13s} {proj:8s} {n:6d}x{k:<6d} M={m:5d} fp16 {row['fp16']:8.1f} w4 {row['w4']:8.1f} "
                  f"int4 {row.get('int4mm') or float('nan'):8.1f} ec {ec32:8.1f} floor {row['floor_us']:7.1f} us",
                  flush=True)
        del layer, ecs
        torch.cuda.empty_cache()
    meta = dict(device=props.name, l2_bytes=l2, copy_bw=bw, fp16_peak=peak, torch=torch.__version__,
                group_size=GROUP, gate_hidden=HIDDEN, fused_max_m=policy.fused_max_m,
                fragment_cublas_min_m=policy.fragment_cublas_min_m, nmajor_cublas_min_m=policy.nmajor_cublas_min_m,
                gate_programs=policy.gate_programs, quick=args.quick,
                layout=args.layout,
                date=time.strftime("%Y-%m-%d"))
    (out_dir / "results.json").write_text(json.dumps(dict(meta=meta, results=results, checks=checks), indent=1))
    (out_dir / "table.md").write_text(report(meta, results, checks, ranks))
    print(report(meta, results, checks, ranks))


def _median(vals):
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else float("nan")


def report(meta, results, checks, ranks):
    lines = [f"device {meta['device']}, {meta['date']}; copy {meta['copy_bw'] / 1e12:.2f} TB/s, "
             f"fp16 mm {meta['fp16_peak'] / 1e12:.0f} TFLOP/s; g{meta['group_size']} asym, h={meta['gate_hidden']}, "
             f"{meta.get('layout', 'fragment')} weights; "
             f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} pass (int4mm excluded from the gate)", ""]
    base = ["fp16", "int4mm", "w4", "w4_no_gluon", "w4_triton", "w4_dqmm"]
    per_rank = ["fused", "semi", "serial", "ec", "naive"]
    cols = base + [f"{p} r{r}" for r in ranks for p in per_rank]
    lines.append("| model | proj | N×K | M | floor | " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * (5 + len(cols)))
    for r in results:
        cells = [f"{r[c]:.1f}" if r.get(c) is not None else "–" for c in cols]
        lines.append(f"| {r['model']} | {r['proj']} | {r['n']}×{r['k']} | {r['m']} | {r['floor_us']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Per shape, FP16 / W4 and FP16 / W4+EC (the op as dispatched; speed-ups above 1 beat cuBLAS):", "",
              "| shape | " + " | ".join(str(m) for m in sorted({r['m'] for r in results})) + " |",
              "|---|" + "---:|" * len({r['m'] for r in results})]
    for proj in dict.fromkeys(r["proj"] for r in results):
        for name in ["w4"] + [f"ec r{k}" for k in ranks[:1]]:
            cells = [f"{r['fp16'] / r[name]:.2f}" if r.get(name) else "–"
                     for r in sorted((r for r in results if r["proj"] == proj), key=lambda r: r["m"])]
            lines.append(f"| {proj} {name} | " + " | ".join(cells) + " |")
    lines += ["", "Medians over the Llama-2-7B and Llama-3-8B shapes (q and o counted separately):", ""]
    lines.append("| M | fp16/w4 | fp16/int4mm | w4 % of floor | " + " | ".join(f"ec r{r}/w4 − 1" for r in ranks) +
                 " | fused/semi r32 | dqmm/triton |")
    lines.append("|" + "---|" * (6 + len(ranks)))
    for m in sorted({r["m"] for r in results}):
        rows = [r for r in results if r["m"] == m and r["model"] in ("Llama-2-7B", "Llama-3-8B")]
        rows = rows + [r for r in rows if r["proj"] == "q/o"]
        if not rows:
            continue
        sp = _median([r["fp16"] / r["w4"] for r in rows])
        sp4 = _median([r["fp16"] / r["int4mm"] for r in rows if r.get("int4mm")])
        eff = _median([r["floor_us"] / r["w4"] for r in rows])
        ovh = [_median([r[f"ec r{k}"] / r["w4"] - 1 for r in rows if r.get(f"ec r{k}")]) for k in ranks]
        fs = _median([r["fused r32"] / r["semi r32"] for r in rows if r.get("fused r32") and r.get("semi r32")])
        dq = _median([r["w4_dqmm"] / r["w4_triton"] for r in rows if r.get("w4_dqmm")])
        lines.append(f"| {m} | {sp:.2f}× | {sp4:.2f}× | {100 * eff:.0f}% | " +
                     " | ".join(f"{100 * o:+.1f}%" for o in ovh) + f" | {fs:.2f} | {dq:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and table.md")
    p.add_argument("--quick", action="store_true", help="7B/8B shapes, M in {1,4,16,64,512,2048}, ranks 16/32")
    p.add_argument("--tune", action="store_true", help="sweep launch shapes of the W4 kernel instead")
    p.add_argument("--tune-kinds", default="1,16,32,64",
                   help="with --tune: comma-separated N-major classes to sweep (1: the one-token loop, 16: 2-16 "
                        "tokens, 32, 64; default all, which also times 128-256 tokens and the fused EC)")
    p.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)} (default: all; --quick: 7B, 8B)")
    p.add_argument("--ms", help="comma-separated token counts (default: all; --quick: 1,4,16,64,512,2048)")
    p.add_argument("--ranks", help="comma-separated EC ranks (default: 8,16,32,64; --quick: 16,32)")
    p.add_argument("--table", type=Path, help="launch_table.json from --tune to use instead of the built-in one")
    p.add_argument("--no-warm", action="store_true", help="skip the parallel compile pass")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    p.add_argument("--gate-programs", type=int,
                   help="semi-fused EC: split ec_gate over K up to about this many programs "
                        "(KernelPolicy.gate_programs)")
    p.add_argument("--profile", help="comma-separated variants (e.g. 'w4,ec r32') whose GPU time per call is also "
                                     "split by kernel (torch.profiler over graph replays) and printed per row")
    p.add_argument("--layout", choices=[x.value for x in Layout], default=Layout.FRAGMENT.value,
                   help="packed weight layout of the W4 variants (default: the fragment layout the engine serves; "
                        "nmajor: the fallback of the shapes it refuses; --tune times the N-major family)")
    args = p.parse_args()
    try:
        policy = KernelPolicy(**({} if args.gate_programs is None else {"gate_programs": args.gate_programs}),
                              **({} if args.table is None else {"launch_table": str(args.table)}))
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tune:
        from bench_kernels_tune import KINDS, tune

        kinds = tuple(s.strip() for s in args.tune_kinds.split(",") if s.strip())
        if not kinds or not set(kinds) <= set(KINDS):
            p.error(f"--tune-kinds: expected some of {', '.join(KINDS)}, got {args.tune_kinds!r}")
        tune(args.out, kinds, policy.launch_table)
    else:
        sweep(args, args.out, policy)


if __name__ == "__main__":
    main()
