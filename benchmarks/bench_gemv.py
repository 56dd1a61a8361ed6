"""Decode GEMV study: the K-major W4 GEMV (spear/kernels/gemv.py) against the current decode path.

    python benchmarks/bench_gemv.py --out results/gemv     # H200: ~3 min

For M = 1, 2, 4 and the Llama-2-7B / Llama-3-8B layer shapes: FP16 cuBLAS, the current
W4 kernel as dispatched (spear/kernels/w4a16.py), and the K-major GEMV over a sweep of tile
shapes, warps, stages and split-K. Same protocol as bench_kernels.py (RTN 4-bit, group 128,
asymmetric, random non-zero weights; each variant checked against the fp32 reference at the
real shape first; CUDA graph cycling through weight copies beyond 2x L2; median of replays).
It also sweeps the op's own CUDA-core decode loop (N-major layout, fp16x2 PTX word
product, spear/kernels/_common.py) over BN, warps and split-K, and writes
``launch_table.json``: the loop's launch shape with the best geometric mean at M = 1 and
the largest M in (1, 2, 4) up to which it beats the tensor-core split-K tiles
(``bench_kernels.py --table`` and ``bench_decode.py --table`` read it).
Writes gemv.json (every timing) and prints the best configuration per (shape, M).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import copies_for, time_calls  # noqa: E402

from spear.kernels import pack, reference  # noqa: E402
from spear.kernels.dequant import dequantize  # noqa: E402
from spear.kernels.gemv import GemvConfig, pack_kmajor, pick_gemv_config, w4_gemv  # noqa: E402
from spear.kernels.w4a16 import Config, _split_for, w4a16_matmul  # noqa: E402
from spear.quant.primitives import rtn  # noqa: E402

SHAPES = [("q/o", 4096, 4096), ("7B gate_up", 22016, 4096), ("7B down", 4096, 11008),
          ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336)]
GROUP = 128


def sqnr(ref, out):
    return float(20 * torch.log10(ref.norm() / (ref - out.float()).norm()))


def _geomean(xs):
    xs = list(xs)
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else float("inf")


def launch_table(rows) -> dict | None:
    """The decode dispatch's CUDA-core entry from the N-major sweep (see the module docstring)."""
    from spear.kernels import w4a16

    ones = [r for r in rows if r["m"] == 1 and r.get("nmajor")]
    if not ones:
        return None
    shape_of = lambda key: key.rsplit("_sk", 1)[0]  # noqa: E731  (split-K follows from programs)
    cands = {}
    for r in ones:
        for key, v in r["nmajor"].items():
            if "us" in v and v["ptx"]:
                cands.setdefault(shape_of(key), {}).setdefault(r["shape"], []).append(v)
    # per candidate (BN, warps): best programs count by geomean is approximated by the best per shape
    best_key = min((c for c in cands if len(cands[c]) == len(ones)),
                   key=lambda c: _geomean(min(v["us"] for v in cands[c][sh]) for sh in cands[c]), default=None)
    if best_key is None:
        return None
    v0 = cands[best_key][ones[0]["shape"]][0]
    split_n = [min(cands[best_key][r["shape"]], key=lambda v: v["us"]) for r in ones]
    programs = int(_geomean(-(-r["n"] // v["BN"]) * v["split_k"] for r, v in zip(ones, split_n)))
    table = dict(w4a16.LAUNCH)
    table["fma"] = dict(BN=v0["BN"], BK=128, num_warps=v0["num_warps"], num_stages=1, programs=programs)
    table["fma_max_m"] = 1
    for m in (2, 4):
        rs = [r for r in rows if r["m"] == m and r.get("nmajor")]
        loop = [min((v["us"] for k_, v in r["nmajor"].items() if "us" in v and shape_of(k_) == best_key),
                    default=float("inf")) for r in rs]
        if rs and _geomean(loop) < _geomean(r["w4_us"] for r in rs):
            table["fma_max_m"] = m
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="1,2,4")
    p.add_argument("--budget-s", type=float, default=360, help="stop sweeping after this many seconds")
    p.add_argument("--no-kmajor", action="store_true", help="only the N-major loop of the op")
    args = p.parse_args(argv)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    t_start = time.time()
    # num_stages did not matter in the first sweep (the loop has no dot to pipeline): fixed at 1
    sweep = [dict(BN=bn, BK=bk, num_warps=nw, num_stages=1, half=True, asm=True)
             for bn, bk, nw in itertools.product([64, 128, 256], [64, 128, 256], [2, 4, 8])]
    sweep += [dict(BN=64, BK=128, num_warps=nw, num_stages=1, half=half, asm=False)
              for nw in (2, 4) for half in (True, False)]
    programs = [264, 528, 1056, 2112]
    rows, best = [], {}
    for m in [int(v) for v in args.ms.split(",")]:
        for label, n, k in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(n, k, device="cuda", generator=g) * 0.02
            codes, scales, zeros = rtn(w, 4, GROUP, symmetric=False)
            scales = scales.half()
            del w
            base = pack(codes, scales, zeros, GROUP)
            nbytes = base.qweight.numel() * 4
            w4 = [base] + [pack(codes, scales, zeros, GROUP) for _ in range(copies_for(nbytes, l2) - 1)]
            wk = [pack_kmajor(codes, scales, zeros, GROUP) for _ in range(copies_for(nbytes, l2))]
            w16 = dequantize(base, torch.float16)
            fp = [w16] + [w16.clone() for _ in range(copies_for(w16.numel() * 2, l2) - 1)]
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
            t_fp = time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp])
            assert sqnr(ref, w4a16_matmul(x, base)) > 40
            t_w4 = time_calls([lambda w_=w_: w4a16_matmul(x, w_) for w_ in w4])
            rec = dict(m=m, shape=label, n=n, k=k, fp16_us=t_fp, w4_us=t_w4, gemv={})
            cands = [] if args.no_kmajor else (sweep if m == 1 else best.get((label, 1), {}).get("top", sweep[:4]))
            for c in cands:
                for prog in programs:
                    if time.time() - t_start > args.budget_s:
                        break
                    cfg = pick_gemv_config(m, n, k, GROUP, programs=prog, **c)
                    mode = "asm" if cfg.asm else ("half" if cfg.half else "f32")
                    key = f"{mode}_BN{cfg.BN}_BK{cfg.BK}_w{cfg.num_warps}_sk{cfg.split_k}"
                    if key in rec["gemv"]:
                        continue
                    try:
                        s = sqnr(ref, w4_gemv(x, wk[0], cfg))
                        if s < 40:
                            rec["gemv"][key] = dict(error=f"SQNR {s:.1f} dB")
                            continue
                        rec["gemv"][key] = dict(us=time_calls([lambda w_=w_: w4_gemv(x, w_, cfg) for w_ in wk]),
                                                cfg=cfg.__dict__ if hasattr(cfg, "__dict__") else str(cfg), **c)
                    except Exception as e:  # out of resources for a tile shape: record and go on
                        rec["gemv"][key] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
            # the N-major op's CUDA-core loop (what the decode dispatch runs), PTX and fp32 forms
            mv = 1 if m == 1 else (2 if m == 2 else 4)
            rec["nmajor"] = {}
            for bn, nw, prog, ptx in itertools.product([32, 64, 128], [2, 4, 8], [528, 1056, 2112], [True, False]):
                if (not ptx and (bn, nw) != (64, 2)) or time.time() - t_start > args.budget_s:
                    continue
                split = _split_for(-(-n // bn), k, 128, prog)
                cfg = Config(16, bn, 128, split, nw, 1, mv=mv, ptx=ptx)
                key = f"{'ptx' if ptx else 'f32'}_BN{bn}_w{nw}_sk{split}"
                if key in rec["nmajor"]:
                    continue
                s_ = sqnr(ref, w4a16_matmul(x, base, config=cfg))
                if s_ < 40:
                    rec["nmajor"][key] = dict(error=f"SQNR {s_:.1f} dB")
                    continue
                rec["nmajor"][key] = dict(us=time_calls([lambda w_=w_: w4a16_matmul(x, w_, config=cfg) for w_ in w4]),
                                          BN=bn, num_warps=nw, split_k=split, ptx=ptx)
            nm = {kk: v for kk, v in rec["nmajor"].items() if "us" in v}
            if nm:
                kbest = min(nm, key=lambda kk: nm[kk]["us"])
                rec["nmajor_best"], rec["nmajor_best_us"] = kbest, nm[kbest]["us"]
                print(f"M={m} {label:11s} N-major loop best {nm[kbest]['us']:7.1f} us "
                      f"({t_fp / nm[kbest]['us']:.2f}x fp16) {kbest}", flush=True)
            ok = {kk: v for kk, v in rec["gemv"].items() if "us" in v}
            if ok:
                order = sorted(ok, key=lambda kk: ok[kk]["us"])
                bk_ = order[0]
                rec["best"] = bk_
                rec["best_us"] = ok[bk_]["us"]
                top = []
                for kk in order:
                    c = {f: ok[kk][f] for f in ("BN", "BK", "num_warps", "num_stages", "half", "asm")}
                    if c not in top:
                        top.append(c)
                best[(label, m)] = dict(top=top[:6])
                bytes_ = n * k / 2 + 3 * n * k / GROUP + 2 * m * k + 2 * m * n
                print(f"M={m} {label:11s} fp16 {t_fp:7.1f} us  w4 {t_w4:7.1f} us ({t_fp / t_w4:.2f}x)  "
                      f"gemv best {ok[bk_]['us']:7.1f} us ({t_fp / ok[bk_]['us']:.2f}x fp16, "
                      f"{bytes_ / ok[bk_]['us'] / 1e6:.2f} TB/s) {bk_}", flush=True)
            rows.append(rec)
            del w4, wk, fp, base, w16
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv.json").write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                                                   torch=torch.__version__, rows=rows), indent=1))
    table = launch_table(rows)
    if table:
        (out / "launch_table.json").write_text(json.dumps(table, indent=1))
        print("launch table:", json.dumps(table), flush=True)
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m and "best_us" in r]
        if rs:
            nm = [r for r in rs if "nmajor_best_us" in r]
            print(f"M={m}: median FP16/W4 {statistics.median(r['fp16_us'] / r['w4_us'] for r in rs):.2f}x, "
                  f"FP16/gemv {statistics.median(r['fp16_us'] / r['best_us'] for r in rs):.2f}x"
                  + (f", FP16/N-major loop {statistics.median(r['fp16_us'] / r['nmajor_best_us'] for r in nm):.2f}x"
                     if nm else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
