"""Device experiment: the Gluon GEMM with 64-token activation boxes: SQNR against the reference at odd token counts and BM 32-256, then timing against cuBLAS FP16 (python benchmarks/exp/check_xboxes.py)."""
import torch, sys
from spear.kernels import reference
from spear.kernels.gluon_w4 import gluon_w4a16
from spear.kernels.launch import GluonConfig, pick_gluon, pick_split
from spear.kernels.layout import Layout, pack
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.tune import GROUP, random_layer, sqnr, fp16_copies
from spear.kernels.dequant import dequantize
torch.manual_seed(0)
l2 = torch.cuda.get_device_properties(0).L2_cache_size
worst = 99.0
for label, n, k, act in (("q/o", 4096, 4096, 0), ("gate_up", 28672, 4096, 1), ("down", 4096, 14336, 0)):
    codes, scales, zeros = random_layer(n, k)
    w = pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT)
    for m in (1, 16, 33, 65, 96, 130, 144, 160, 200, 256, 300, 600, 1100):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
        if act:
            ref = reference.silu_mul_pairs(ref.float())
        cfgs = [c for c in (pick_gluon(m, n, k), GluonConfig(64, 256, 128, 2, 2), GluonConfig(64, 128, 128, 4, 3),
                            GluonConfig(64, 64, 128, 6, 1), GluonConfig(64, 32, 128, 6, 1)) if c is not None]
        for c in cfgs:
            out = gluon_w4a16(x, w, None, c, act=act)
            s = sqnr(ref, out)
            worst = min(worst, s)
            if s < 40 or not torch.isfinite(out).all():
                print(f"BAD {label} m={m} {c}: SQNR {s:.1f}", flush=True)
print(f"correctness: worst SQNR {worst:.1f} dB", flush=True)
for label, n, k, act in (("gate_up", 28672, 4096, 1), ("down", 4096, 14336, 0), ("q/o", 4096, 4096, 0)):
    codes, scales, zeros = random_layer(n, k)
    ws = [pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT) for _ in range(copies_for(n * k // 2, l2))]
    fp16 = fp16_copies(dequantize(ws[0], torch.float16), l2)
    line = []
    for m in (96, 128, 144, 160, 176, 192, 224, 256, 300, 512):
        c = pick_gluon(m, n, k)
        if c is None:
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        us = time_calls([lambda w_=w_: gluon_w4a16(x, w_, None, c, act=act) for w_ in ws])
        f = time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp16])
        line.append(f"{m}: {us:.1f} us ({f / us:.2f}x)")
    print(label, " | ".join(line), flush=True)
