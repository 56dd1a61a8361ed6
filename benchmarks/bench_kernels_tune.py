"""``bench_kernels.py --tune``: the launch sweep of the N-major fallback layout's Triton GEMM (the
table's "nmajor" family: class 1 its one-token loop on CUDA cores, 16 / 32 / 64 the split-K
tensor-core tiles) that chose the built-in entries; writes tune.json and launch_table.json. The
fragment layout's sweep is ``spear.kernels.tune`` (``spear tune-kernels``)."""

from __future__ import annotations

import json
import math

import torch

from kernel_cases import DEVICE, GROUP, Layer, make_ec
from kernel_timing import time_calls
from spear.kernels.dequant import dequantize
from spear.kernels.launch import BUILTIN, merged_table, pick_triton, to_json
from spear.kernels.layout import Layout
from spear.kernels.w4a16 import w4a16_matmul

TUNE_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): q/o, 8B gate_up, 8B down

KINDS = ("1", "16", "32", "64")
KIND_MS = {"1": (1,), "16": (4, 8, 16), "32": (32,), "64": (64,)}


def _candidates(kind: str) -> list[dict]:
    if kind == "1":
        return [dict(BM=16, BN=bn, BK=128, num_warps=wp, num_stages=2, programs=pg)
                for bn in (32, 64, 128) for wp in (2, 4) for pg in (256, 512, 1024, 2048)]
    if kind == "16":
        return [dict(BM=16, BN=bn, BK=128, num_warps=4, num_stages=st, programs=pg)
                for bn in (64, 128) for st in (3, 4) for pg in (256, 512, 1024)]
    # 32 and 64 tokens: fewer splits too (each split writes an M x N fp32 partial) and 8 warps
    return [dict(BM=int(kind), BN=bn, BK=128, num_warps=wp, num_stages=3, programs=pg)
            for bn in (64, 128) for wp in (4, 8) for pg in (64, 128, 256, 512)]


def tune(out_dir, kinds=KINDS, base_table=BUILTIN):
    """The "nmajor" family's sweep; writes tune.json and launch_table.json.

    Candidates are scored by the geometric mean of their time over TUNE_SHAPES (and over M within a
    class); split-K follows from the candidate's target program count. ``kinds`` picks the classes
    swept (the others keep their entries in ``base_table``); the full sweep also times 128-256
    tokens (the prefill tiles against dequantize + cuBLAS) and the fused EC.
    """
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    full = set(kinds) == set(KINDS)
    ms = (1, 2, 4, 8, 16, 32, 64, 128, 256) if full else sorted({m for kd in kinds for m in KIND_MS[kd]})
    for n, k in TUNE_SHAPES:
        layer = Layer(n, k, l2, with_int4=False, layout=Layout.NMAJOR)
        for m in ms:
            x = torch.randn(m, k, device=DEVICE).half()
            base = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in layer.fp16])
            for kind in (kd for kd in kinds if m in KIND_MS[kd]):
                for c in _candidates(kind):
                    cfg = pick_triton(m, n, k, False, GROUP, merged_table({"nmajor": {kind: c}}))
                    try:
                        t = time_calls([lambda w=w: w4a16_matmul(x, w, config=cfg) for w in layer.w4])
                    except Exception as exc:  # out of registers/shared memory: record and go on
                        print(f"  {kind} {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    rows.append(dict(n=n, k=k, m=m, kind=kind, cand=c, cfg=cfg.__dict__, us=t, fp16_us=base))
            if m >= 128:
                for label, fn in (("prefill", lambda w: w4a16_matmul(x, w)),
                                  ("dequant+cublas", lambda w: torch.nn.functional.linear(x, dequantize(w, x.dtype)))):
                    t = time_calls([lambda w=w: fn(w) for w in layer.w4])
                    rows.append(dict(n=n, k=k, m=m, kind=label, cand=None, cfg=None, us=t, fp16_us=base))
            timed = [r for r in rows if r["n"] == n and r["k"] == k and r["m"] == m]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                print(f"tune {n}x{k} M={m}: fp16 {base:.1f} us, best {best['us']:.1f} us {best['kind']} {best['cfg']}",
                      flush=True)
        for m in (1, 4, 16) if full else ():
            x = torch.randn(m, k, device=DEVICE).half()
            w4 = time_calls([lambda w=w: w4a16_matmul(x, w) for w in layer.w4])
            for r in (16, 32):
                e = make_ec(n, k, r)
                t = time_calls([lambda w=w: w4a16_matmul(x, w, None, e) for w in layer.w4])
                rows.append(dict(n=n, k=k, m=m, kind=f"fused r{r}", cand=None, cfg=None, us=t, w4_us=w4))
                print(f"tune fused r{r} {n}x{k} M={m}: {t:.1f} us (w4 {w4:.1f})", flush=True)
        (out_dir / "tune.json").write_text(json.dumps(rows, indent=1))
        del layer
        torch.cuda.empty_cache()

    def score(kind, c):
        ts = [r["us"] for r in rows if r["kind"] == kind and r["cand"] == c]
        want = len(TUNE_SHAPES) * len(KIND_MS[kind])
        return math.exp(sum(map(math.log, ts)) / len(ts)) if len(ts) == want else float("inf")

    table = to_json(base_table)
    for kind in kinds:
        table["nmajor"][kind] = min(_candidates(kind), key=lambda c: score(kind, c))
    (out_dir / "launch_table.json").write_text(json.dumps(table, indent=1))
    print("launch table:", json.dumps(table), flush=True)
