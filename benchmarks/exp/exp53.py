"""Device experiment (issue 53): Gluon GEMM variants against cuBLAS FP16 and the product's dispatch.

Variants of the consumer loop (exp_gluon.py, a copy of spear/kernels/gluon_w4.py with switches):
  base   LAG 0 (one wgmma in flight per consumer), scales read per 64-input block
  lag1   one more wgmma in flight (wait(num_outstanding=1)), stage freed one block later
  hoist  the block's scales and zero points read once per stage (GROUP >= BK)
  lh     lag1 + hoist
  sm2    lh with two programs per SM (80 registers a thread, consumers 104/112, producer 24),
         stages cut to fit half the shared memory
"""
import itertools
import json
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, "benchmarks/exp")
import exp_gluon as E  # noqa: E402

from spear.kernels import reference  # noqa: E402
from spear.kernels.dequant import dequantize  # noqa: E402
from spear.kernels.launch import GluonConfig, gluon_smem, pick_gluon, pick_split  # noqa: E402
from spear.kernels.layout import Layout, pack  # noqa: E402
from spear.kernels.ops import w4a16_linear  # noqa: E402
from spear.kernels.planner import plan  # noqa: E402
from spear.kernels.policy import KernelPolicy  # noqa: E402
from spear.kernels.timing import copies_for, time_calls  # noqa: E402
from spear.kernels.tune import GROUP, fp16_copies, random_layer, sqnr  # noqa: E402

out_path = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 300
deadline = time.time() + budget
SHAPES = [("q/o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
MS = [128, 96, 256, 512, 192]
VARIANTS = {"base": dict(lag=0, hoist=False), "lag1": dict(lag=1, hoist=False), "lh": dict(lag=1, hoist=True)}
SM2 = dict(lag=1, hoist=True, regs=(80, 104, 24), per_sm=2)
policy = KernelPolicy()
l2 = torch.cuda.get_device_properties(0).L2_cache_size
sms = torch.cuda.get_device_properties(0).multi_processor_count


def configs(m, n, k):
    """The table's launch (or its nearest where the table keeps m off Gluon) and one alternative."""
    out = {}
    t = pick_gluon(m, n, k)
    shapes = [(128, 64, 128), (256, 128, 128)] if m <= 128 else [(256, 128, 128), (128, 128, 128)]
    if t is not None:
        out["table"] = t
        shapes = [s for s in shapes if (2 * t.BNC, t.BM, t.BK) != s][:1]
    for bn, bm, bk in shapes:
        stages = max(s for s in range(2, 7) if gluon_smem(GluonConfig(bn // 2, bm, bk, s), 32) <= 204 * 1024)
        tiles = -(-m // bm) * -(-n // bn)
        out[f"BN{bn}_BM{bm}_BK{bk}"] = GluonConfig(bn // 2, bm, bk, stages, pick_split(tiles, -(-k // bk), sms))
    return out


def sm2_config(cfg, m, n, k):
    if cfg.BNC != 64 or cfg.BM > 64:
        return None
    st = max((s for s in range(2, 9) if gluon_smem(replace(cfg, stages=s), GROUP) <= 110 * 1024), default=None)
    if st is None:
        return None
    tiles = -(-m // cfg.BM) * -(-n // (2 * cfg.BNC))
    return replace(cfg, stages=st, split_k=pick_split(tiles, -(-k // cfg.BK), 2 * sms))


rows = []
t_start = time.time()
for si, (label, n, k) in enumerate(SHAPES):
    shape_deadline = t_start + budget * (si + 1) / len(SHAPES)
    codes, scales, zeros = random_layer(n, k)
    ws = [pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT) for _ in range(copies_for(n * k // 2, l2))]
    fp16 = fp16_copies(dequantize(ws[0], torch.float16), l2)
    for m in MS:
        if time.time() > shape_deadline:
            break
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
        row = dict(shape=label, m=m, n=n, k=k, runs={},
                   fp16=time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp16]),
                   product=time_calls([lambda w_=w_: w4a16_linear(x, w_, policy=policy) for w_ in ws]),
                   plan=str(plan(m, n, k, 0, ws[0].format, x.device, policy)))
        for cname, cfg in configs(m, n, k).items():
            todo = [(v, cfg, kw) for v, kw in VARIANTS.items()]
            c2 = sm2_config(cfg, m, n, k)
            if c2 is not None:
                todo.append(("sm2", c2, SM2))
            for vname, c, kw in todo:
                key = f"{cname}/{vname}"
                try:
                    s_ = sqnr(ref, E.gluon_w4a16(x, ws[0], None, c, **kw))
                    if s_ < 40:
                        row["runs"][key] = dict(cfg=str(c), error=f"SQNR {s_:.1f}")
                        continue
                    us = time_calls([lambda w_=w_: E.gluon_w4a16(x, w_, None, c, **kw) for w_ in ws])
                    s2 = sqnr(ref, E.gluon_w4a16(x, ws[0], None, c, **kw))
                    row["runs"][key] = dict(cfg=str(c), us=us, sqnr=round(min(s_, s2), 1))
                except Exception as exc:
                    row["runs"][key] = dict(cfg=str(c), error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
        best = {}
        for key, r in row["runs"].items():
            if "us" in r:
                v = key.split("/")[1]
                if v not in best or r["us"] < best[v][0]:
                    best[v] = (r["us"], key.split("/")[0])
        print(f"{label:8s} m={m:5d} fp16 {row['fp16']:7.1f} product {row['product']:7.1f} "
              f"({row['fp16'] / row['product']:.2f}x) | " + " ".join(
                  f"{v} {row['fp16'] / u:.2f}x[{c}]" for v, (u, c) in best.items()), flush=True)
        json.dump(rows, open(out_path, "w"), indent=1)
    del ws, fp16
    torch.cuda.empty_cache()
