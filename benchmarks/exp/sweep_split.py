"""Device experiment: the Gluon GEMM's tiles x K splits at the sizes where W4 trails FP16, against cuBLAS FP16 and the planner's dispatch (python benchmarks/exp/sweep_split.py OUT.json SECONDS)."""
import json, sys, time
import torch
from spear.kernels import reference
from spear.kernels.dequant import dequantize
from spear.kernels.gluon_w4 import gluon_w4a16, split_range, k_steps
from spear.kernels.launch import GluonConfig, gluon_smem, pick_gluon
from spear.kernels.layout import Layout, pack
from spear.kernels.ops import w4a16_linear
from spear.kernels.planner import plan
from spear.kernels.policy import KernelPolicy
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.tune import GROUP, fp16_copies, random_layer, sqnr

out_path, budget = sys.argv[1], float(sys.argv[2])
deadline = time.time() + budget
SH = {"q/o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CASES = [("q/o", 128), ("q/o", 96), ("q/o", 256), ("gate_up", 256), ("q/o", 192), ("gate_up", 512),
         ("gate_up", 192), ("q/o", 512), ("down", 256), ("down", 192), ("down", 512)]
TILES = [(128, 64, 128), (128, 128, 128), (256, 64, 128), (256, 128, 128), (128, 256, 128)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
policy = KernelPolicy()
l2 = torch.cuda.get_device_properties(0).L2_cache_size
rows, cache = [], {}
for label, m in CASES:
    if time.time() > deadline:
        break
    n, k = SH[label]
    if label not in cache:
        cache.clear(); torch.cuda.empty_cache()
        codes, scales, zeros = random_layer(n, k)
        ws = [pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT) for _ in range(copies_for(n * k // 2, l2))]
        cache[label] = (codes, scales, zeros, ws, fp16_copies(dequantize(ws[0], torch.float16), l2))
    codes, scales, zeros, ws, fp16 = cache[label]
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
    row = dict(shape=label, m=m, n=n, k=k, runs={},
               fp16=time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp16]),
               product=time_calls([lambda w_=w_: w4a16_linear(x, w_, policy=policy) for w_ in ws]),
               plan=str(plan(m, n, k, 0, ws[0].format, x.device, policy)))
    for bn, bm, bk in TILES:
        if bn // 2 * bm > 128 * 128:
            continue
        stages = max(s for s in range(2, 7) if gluon_smem(GluonConfig(bn // 2, bm, bk, s), 32) <= 204 * 1024)
        steps = k_steps(k, bk)
        for sp in SPLITS:
            if time.time() > deadline:
                break
            per = -(-steps // sp)
            if per < 2 or (sp - 1) * per >= steps:
                continue
            c = GluonConfig(bn // 2, bm, bk, stages, sp)
            key = f"BN{bn}_BM{bm}_s{stages}_k{sp}"
            try:
                s_ = sqnr(ref, gluon_w4a16(x, ws[0], None, c))
                if s_ < 40:
                    row["runs"][key] = dict(error=f"SQNR {s_:.1f}"); continue
                row["runs"][key] = dict(us=time_calls([lambda w_=w_: gluon_w4a16(x, w_, None, c) for w_ in ws]),
                                        sqnr=round(s_, 1))
            except Exception as exc:
                row["runs"][key] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
    rows.append(row)
    ok = sorted((r["us"], kk) for kk, r in row["runs"].items() if "us" in r)
    print(f"{label:8s} m={m:4d} fp16 {row['fp16']:6.1f} product {row['product']:6.1f} ({row['fp16']/row['product']:.2f}x, "
          f"{row['plan']}) best: " + " ".join(f"{kk} {row['fp16']/u:.2f}x" for u, kk in ok[:4]), flush=True)
    json.dump(rows, open(out_path, "w"), indent=1)
