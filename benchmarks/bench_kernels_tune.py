"""``bench_kernels.py --tune``: the launch-table sweep of the W4 kernel (both loops and the
tensor-core tiles at 4-16 and at 32-64 tokens, N-major packing) that chose the built-in table's
CUDA-core and tensor-core entries; writes tune.json and launch_table.json. The K-major one-token loop's own sweep is
``spear.kernels.tune`` (``spear tune-kernels``)."""

from __future__ import annotations

import json
import math

import torch
import triton

from kernel_cases import DEVICE, GROUP, Layer, make_ec
from kernel_timing import time_calls
from spear.kernels.dequant import dequantize
from spear.kernels.launch import BUILTIN, Config, _split_for, _thaw, pick_config
from spear.kernels.w4a16 import w4a16_matmul

TUNE_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): q/o, 8B gate_up, 8B down


KINDS = ("fma", "tc", "tc_wide")
KIND_MS = {"fma": (1, 2, 4), "tc": (4, 8, 16), "tc_wide": (32, 64)}


def tune(out_dir, kinds=KINDS, base_table=BUILTIN):
    """Launch-table sweep for w4a16.pick_config; writes tune.json and launch_table.json.

    Candidates are scored by the geometric mean of their time over TUNE_SHAPES (and over M
    within a class); split-K follows from the candidate's target program count. ``kinds`` picks
    the entries swept (the others keep their values in ``base_table``); the full sweep also times
    128-256 tokens and the fused EC.
    """
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    fma = [dict(BN=bn, BK=128, num_warps=wp, num_stages=st, programs=pg)
           for bn in (32, 64, 128) for wp in (2, 4) for st in (2,) for pg in (256, 512, 1024, 2048)]
    tc = [dict(BN=bn, BK=128, num_warps=4, num_stages=st, programs=pg)
          for bn in (64, 128) for st in (3, 4) for pg in (256, 512, 1024)]
    # 32 and 64 tokens: fewer splits too (each split writes an M x N fp32 partial) and 8 warps
    tc_wide = [dict(BN=bn, BK=128, num_warps=wp, num_stages=3, programs=pg)
               for bn in (64, 128) for wp in (4, 8) for pg in (64, 128, 256, 512)]

    def cfg_of(kind, c, m, n, k):
        bk = min(c["BK"], GROUP)
        if kind == "fma":
            split = _split_for(triton.cdiv(n, c["BN"]), k, bk, c["programs"])
            return Config(16, c["BN"], bk, split, c["num_warps"], c["num_stages"], mv=1 if m == 1 else (2 if m == 2 else 4))
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        split = _split_for(triton.cdiv(m, bm) * triton.cdiv(n, c["BN"]), k, bk, c["programs"])
        return Config(bm, c["BN"], bk, split, c["num_warps"], c["num_stages"])

    full = set(kinds) == set(KINDS)
    ms = (1, 2, 4, 8, 16, 32, 64, 128, 256) if full else sorted({m for kd in kinds for m in KIND_MS[kd]})
    for n, k in TUNE_SHAPES:
        layer = Layer(n, k, l2, with_int4=False)
        for m in ms:
            x = torch.randn(m, k, device=DEVICE).half()
            base = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in layer.fp16])
            cands = ([("fma", c) for c in fma] if m <= 4 else []) + ([("tc", c) for c in tc] if m <= 16 else [])
            if 16 < m <= 64:
                cands = [("tc_wide", c) for c in tc_wide]
            if m >= 128:
                cands = [("tc", dict(tc[0]))]
            cands = [(kd, c) for kd, c in cands if kd in kinds or m >= 128]
            for kind, c in cands:
                cfg = cfg_of(kind, c, m, n, k) if m <= 64 else Config(64, 64, 128, 1, 4, 4)
                try:
                    t = time_calls([lambda w=w: w4a16_matmul(x, w, config=cfg) for w in layer.w4])
                except Exception as exc:  # out of registers/shared memory: record and go on
                    print(f"  {kind} {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                rows.append(dict(n=n, k=k, m=m, kind=kind, cand=c, cfg=cfg.__dict__, us=t, fp16_us=base))
            if m >= 128:
                for label, fn in (("prefill", lambda w: w4a16_matmul(x, w, config=pick_config(512, n, k, GROUP))),
                                  ("dequant+cublas", lambda w: torch.nn.functional.linear(x, dequantize(w, x.dtype)))):
                    t = time_calls([lambda w=w: fn(w) for w in layer.w4])
                    rows.append(dict(n=n, k=k, m=m, kind=label, cand=None, cfg=None, us=t, fp16_us=base))
            best = min((r for r in rows if r["n"] == n and r["k"] == k and r["m"] == m), key=lambda r: r["us"])
            print(f"tune {n}x{k} M={m}: fp16 {base:.1f} us, best {best['us']:.1f} us {best['kind']} {best['cfg']}",
                  flush=True)
        for m in (1, 4, 16) if full else ():
            x = torch.randn(m, k, device=DEVICE).half()
            w4 = time_calls([lambda w=w: w4a16_matmul(x, w) for w in layer.w4])
            for r in (16, 32):
                e = make_ec(n, k, r)
                t = time_calls([lambda w=w: w4a16_matmul(x, w, None, e, ec_mode=1) for w in layer.w4])
                rows.append(dict(n=n, k=k, m=m, kind=f"fused r{r}", cand=None, cfg=None, us=t, w4_us=w4))
                print(f"tune fused r{r} {n}x{k} M={m}: {t:.1f} us (w4 {w4:.1f})", flush=True)
        (out_dir / "tune.json").write_text(json.dumps(rows, indent=1))
        del layer
        torch.cuda.empty_cache()

    def score(kind, c, ms):
        ts = [r["us"] for r in rows if r["kind"] == kind and r["cand"] == c and r["m"] in ms]
        want = len(TUNE_SHAPES) * len(ms)
        return math.exp(sum(map(math.log, ts)) / len(ts)) if len(ts) == want else float("inf")

    table = {key: _thaw(v) for key, v in base_table.items()}
    if "fma" in kinds:  # the CUDA-core loop is a decode (M = 1) path
        table["fma"] = min(fma, key=lambda c: score("fma", c, (1,)))
    if "tc" in kinds:
        table["tc"] = min(tc, key=lambda c: score("tc", c, KIND_MS["tc"]))
    if "tc_wide" in kinds:
        table["tc_wide"] = min(tc_wide, key=lambda c: score("tc_wide", c, KIND_MS["tc_wide"]))
    if {"fma", "tc"} <= set(kinds):
        table["fma_max_m"] = 0
        for m in (1, 2, 4):  # kept up to the last M where it beats the tensor-core tiles
            if score("fma", table["fma"], (m,)) < score("tc", table["tc"], (m,)):
                table["fma_max_m"] = m
    (out_dir / "launch_table.json").write_text(json.dumps(table, indent=1))
    print("launch table:", json.dumps(table), flush=True)
