"""Decode GEMV study: the K-major W4 GEMV (spear/kernels/gemv.py) against the current decode path.

    python benchmarks/bench_gemv.py --out results/gemv     # H200: ~3 min

For M = 1, 2, 4 and the Llama-2-7B / Llama-3-8B layer shapes: FP16 cuBLAS, the current
W4 kernel as dispatched (spear/kernels/w4a16.py), and the K-major GEMV over a sweep of tile
shapes, warps, stages and split-K. Same protocol as bench_kernels.py (RTN 4-bit, group 128,
asymmetric, random non-zero weights; each variant checked against the fp32 reference at the
real shape first; CUDA graph cycling through weight copies beyond 2x L2; median of replays).
Writes results.json (every timing) and prints the best configuration per (shape, M).
"""

from __future__ import annotations

import argparse
import itertools
import json
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
from spear.kernels.w4a16 import w4a16_matmul  # noqa: E402
from spear.quant.primitives import rtn  # noqa: E402

SHAPES = [("q/o", 4096, 4096), ("7B gate_up", 22016, 4096), ("7B down", 4096, 11008),
          ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336)]
GROUP = 128


def sqnr(ref, out):
    return float(20 * torch.log10(ref.norm() / (ref - out.float()).norm()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="1,2,4")
    p.add_argument("--budget-s", type=float, default=360, help="stop sweeping after this many seconds")
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
            cands = sweep if m == 1 else best.get((label, 1), {}).get("top", sweep[:4])
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
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m and "best_us" in r]
        if rs:
            print(f"M={m}: median FP16/W4 {statistics.median(r['fp16_us'] / r['w4_us'] for r in rs):.2f}x, "
                  f"FP16/gemv {statistics.median(r['fp16_us'] / r['best_us'] for r in rs):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
