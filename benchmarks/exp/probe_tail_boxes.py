"""Device experiment: the Gluon GEMM at 128-256 tokens with its tile past the last token, against the same launch on activations padded with zero rows to the tile (python benchmarks/exp/probe_tail_boxes.py)."""
import torch, sys
from spear.kernels.gluon_w4 import gluon_w4a16
from spear.kernels.launch import GluonConfig, pick_gluon
from spear.kernels.layout import Layout, pack
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.tune import GROUP, random_layer
l2 = torch.cuda.get_device_properties(0).L2_cache_size
for n, k, act in ((28672, 4096, 1), (4096, 14336, 0)):
    codes, scales, zeros = random_layer(n, k)
    ws = [pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT) for _ in range(copies_for(n * k // 2, l2))]
    for m in (128, 144, 160, 176, 192, 208, 224, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        xp = torch.zeros(256, k, device="cuda", dtype=torch.float16); xp[:m] = x
        res = []
        for cfg in (pick_gluon(m, n, k), GluonConfig(64, 256, 128, 2, 1), GluonConfig(64, 128, 128, 4, 1), GluonConfig(128, 128, 128, 3, 1)):
            if cfg is None: res.append("-"); continue
            try:
                us = time_calls([lambda w_=w_: gluon_w4a16(x, w_, None, cfg, act=act) for w_ in ws])
                res.append(f"{us:6.1f}")
            except Exception as e:
                res.append("err")
        usp = time_calls([lambda w_=w_: gluon_w4a16(xp, w_, None, GluonConfig(64, 256, 128, 2, 1), act=act) for w_ in ws])
        print(f"n={n} k={k} m={m}: table {res[0]} | BN128/BM256 {res[1]} | BN128/BM128 {res[2]} | BN256/BM128 {res[3]} | x padded to 256, BM256 {usp:6.1f}", flush=True)
