"""Sweep of the Gluon W4A16 GEMM's launches against cuBLAS FP16 and the Triton fragment kernel.

    python benchmarks/bench_gluon.py --out OUT [--models Llama-3-8B] [--ms 16,64,128,...]

For each layer shape and token count: cuBLAS FP16 on the dequantized weight, the W4 op as the
default policy dispatches it today, the Triton fragment GEMM, dequantize + cuBLAS, and the Gluon
kernel (spear/kernels/gluon_w4.py) under every candidate launch (tile BNC x BM, stage depth BK,
ring stages, K split for 132 or 264 programs). Every Gluon output is first checked against the
FP16 path (SQNR > 40 dB). Timing protocol of bench_kernels.py (CUDA graphs over weight copies
beyond 2x L2, median of replays). Writes results.json and table.md under --out; the best launch
per token class is what ``spear tune-kernels`` would put in the launch table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

from kernel_cases import MODELS, Layer, layer_shapes  # noqa: E402
from kernel_timing import time_calls  # noqa: E402

from spear.kernels import gluon_w4 as G  # noqa: E402
from spear.kernels.dequant import dequantize  # noqa: E402
from spear.kernels.ops import w4a16_linear  # noqa: E402
from spear.kernels.policy import KernelPolicy  # noqa: E402
from spear.kernels.w4a16 import w4a16_matmul  # noqa: E402

M_ALL = [16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096]
SMEM = 200 * 1024  # shared memory the ring may take


def stage_bytes(bnc, bm, bk, group):
    kb, bn = bk // 64, G.NCONS * bnc
    gs = -(-bk // group) if group else 1
    return kb * bm * 128 + bn // 16 * 512 * kb + gs * bn * 3


def candidates(m, n, k, group, programs=(132, 264)):
    """Gluon launches worth timing at (m, n, k)."""
    pow2 = max(16, 1 << (m - 1).bit_length())
    bms = sorted({min(pow2, 256)} | ({128} if m > 128 else set()) | ({64} if 64 < m <= 128 else set()))
    out = []
    for bm in bms:
        for bnc in (64, 128):
            if bnc * bm > 128 * 128:
                continue
            for bk in (64, 128):
                stages = min(8, SMEM // stage_bytes(bnc, bm, bk, group))
                if stages < 2:
                    continue
                tiles = -(-m // bm) * -(-n // (G.NCONS * bnc))
                splits = sorted({G.pick_split(tiles, -(-k // bk), p) for p in programs})
                out += [G.GluonConfig(bnc, bm, bk, stages, s) for s in splits]
    return out


def sqnr(ref, out):
    return float(20 * torch.log10(ref.float().norm() / (ref.float() - out.float()).norm()))


def key(cfg):
    return f"g{cfg.BNC}x{cfg.BM}k{cfg.BK}s{cfg.stages}p{cfg.split_k}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default="Llama-3-8B")
    p.add_argument("--ms", default=",".join(map(str, M_ALL)))
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    args = p.parse_args()
    if not G.available():
        raise SystemExit("bench_gluon.py needs a Hopper GPU and a Triton with Gluon")
    args.out.mkdir(parents=True, exist_ok=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    policy = KernelPolicy()
    ms = [int(v) for v in args.ms.split(",")]
    rows, bad = [], []
    t0 = time.time()
    for model, proj, n, k in layer_shapes(args.models.split(",")):
        if time.time() - t0 > args.budget_s:
            break
        layer = Layer(n, k, l2, with_int4=False, layout="mma")
        for m in ms:
            if time.time() - t0 > args.budget_s:
                break
            x = torch.randn(m, k, device="cuda").half()
            row = dict(model=model, proj=proj, n=n, k=k, m=m)
            ref = torch.nn.functional.linear(x, layer.fp16[0])
            row["fp16"] = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in layer.fp16])
            row["w4"] = time_calls([lambda w=w: w4a16_linear(x, w, policy=policy) for w in layer.w4])
            row["triton"] = time_calls([lambda w=w: w4a16_matmul(x, w) for w in layer.w4])
            row["dqmm"] = time_calls([lambda w=w: torch.nn.functional.linear(x, dequantize(w, x.dtype))
                                      for w in layer.w4])
            gl_times = {}
            for cfg in candidates(m, n, k, layer.w4[0].group_size):
                try:
                    s = sqnr(ref, G.gluon_w4a16(x, layer.w4[0], None, cfg))
                    if not s > 40:
                        bad.append(dict(proj=proj, m=m, cfg=key(cfg), sqnr=s))
                        print(f"  CHECK FAILED {proj} M={m} {key(cfg)}: SQNR {s:.1f} dB", flush=True)
                        continue
                    gl_times[key(cfg)] = time_calls([lambda w=w, c=cfg: G.gluon_w4a16(x, w, None, c)
                                                     for w in layer.w4])
                except Exception as exc:  # record and go on: one launch must not end the sweep
                    bad.append(dict(proj=proj, m=m, cfg=key(cfg), error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                    print(f"  ERROR {proj} M={m} {key(cfg)}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            row["gluon"] = gl_times
            if gl_times:
                best = min(gl_times, key=gl_times.get)
                row["gluon_best"], row["gluon_best_us"] = best, gl_times[best]
            rows.append(row)
            gb = row.get("gluon_best_us", float("nan"))
            print(f"{proj:8s} {n:6d}x{k:<6d} M={m:5d} fp16 {row['fp16']:7.1f} w4 {row['w4']:7.1f} "
                  f"triton {row['triton']:7.1f} dqmm {row['dqmm']:7.1f} gluon {gb:7.1f} "
                  f"({row.get('gluon_best', '-')})  fp16/gluon {row['fp16'] / gb:.2f} fp16/w4 "
                  f"{row['fp16'] / row['w4']:.2f}", flush=True)
        del layer
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                triton=__import__("triton").__version__)
    (args.out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, failures=bad), indent=1))
    lines = [f"{meta['device']}, {meta['date']}, Triton {meta['triton']}; fp16 / variant (above 1: faster "
             f"than cuBLAS FP16)", "", "| shape | M | fp16 µs | w4 today | gluon best | launch |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        gb = r.get("gluon_best_us")
        lines.append(f"| {r['proj']} | {r['m']} | {r['fp16']:.1f} | {r['fp16'] / r['w4']:.2f} | "
                     f"{r['fp16'] / gb if gb else float('nan'):.2f} | {r.get('gluon_best', '-')} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"failures: {len(bad)}")


if __name__ == "__main__":
    main()
