"""Launches of the warp-specialized Gluon GEMM (gluon_w4.py), measured on the Hopper GPU at hand.

``tune_gluon`` sweeps each token class's launches (``_gluon_grid``) on a model's layer shapes
against what the policy runs without the Gluon GEMM (the Triton fragment kernel or dequantize +
cuBLAS) and cuBLAS FP16; ``gluon_table`` keeps, per family of layer shapes and class,
the best launch where it wins by GLUON_MIN_GAIN. ``spear tune-kernels --kernel gluon`` writes the
table. The protocol is tune.py's.
"""

from __future__ import annotations

import itertools
import time

import torch

from spear.kernels import reference
from spear.kernels.launch import GLUON_EPILOGUE_SCRATCH, GluonConfig, gluon_smem
from spear.kernels.layout import Layout, pack
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.tune import GROUP, fp16_copies, geomean, random_layer, sqnr

# Token counts timed per "gluon" class (launch.GLUON_CLASSES) and the grid of its launches: tiles
# of two consumer warpgroups (BN = 128 or 256 rows) by BM tokens, 64 or 128 inputs a stage, as many
# ring stages as fit in GLUON_SMEM (at most GLUON_MAX_STAGES), the K split for one unit per SM.
GLUON_TOKENS = {"16": (16,), "32": (32,), "64": (64,), "128": (96, 128), "256": (192, 256), "512": (512,),
                "1024": (1024,), "big": (2048, 4096)}
GLUON_SMEM = 200 * 1024
GLUON_MAX_STAGES = 6


def _gluon_grid(cls: str) -> list[dict]:
    bms = {"16": (16,), "32": (32,), "64": (64,), "128": (64, 128), "256": (128, 256)}.get(cls, (128, 256))
    out = []
    for bm, bn, bk in itertools.product(bms, (128, 256), (64, 128)):
        if bn // 2 * bm > 128 * 128:
            continue
        # the ring's stages with room for a scale and a zero point per row and 32 inputs
        stages = max(s for s in range(2, GLUON_MAX_STAGES + 1)
                     if gluon_smem(GluonConfig(bn // 2, bm, bk, s), 32) - GLUON_EPILOGUE_SCRATCH <= GLUON_SMEM)
        out.append(dict(BN=bn, BM=bm, BK=bk, num_stages=stages))
    return out


def gluon_launch_key(e: dict) -> str:
    return f"BN{e['BN']}_BM{e['BM']}_BK{e['BK']}_s{e['num_stages']}" + (f"_p{e['programs']}" if e.get("programs") else "")


def tune_gluon(shapes, classes=None, budget_s: float = 900, progress: bool = True) -> tuple[dict, list]:
    """Sweep the Gluon GEMM's launches (``_gluon_grid``) on ``shapes`` [(label, n, k)] at each class's
    token counts (``GLUON_TOKENS``) against what the policy runs without it (the Triton fragment
    kernel or dequantize + cuBLAS) and cuBLAS FP16: (the Gluon families' classes that
    ``gluon_table`` keeps, rows). Needs a Hopper GPU and a Triton with Gluon."""
    from tqdm.auto import tqdm

    from spear.kernels import gluon_w4
    from spear.kernels.dequant import dequantize
    from spear.kernels.launch import GLUON_CLASSES, check_table, pick_gluon
    from spear.kernels.ops import w4a16_linear
    from spear.kernels.planner import target
    from spear.kernels.policy import KernelPolicy

    if not target(torch.device("cuda")).gluon:
        raise RuntimeError("the Gluon GEMM needs a Hopper GPU (sm_90) and a Triton with Gluon")
    classes = [c for c in GLUON_CLASSES if c in (classes or GLUON_TOKENS)]
    without = KernelPolicy(gluon=False)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    todo = [(cls, m, e) for cls in classes for m in GLUON_TOKENS[cls] for e in _gluon_grid(cls)]
    deadline = time.time() + budget_s
    rows = []
    with tqdm(total=len(todo) * len(shapes), desc="tune-kernels gluon", unit="launch", disable=not progress) as bar:
        for label, n, k in shapes:
            codes, scales, zeros = random_layer(n, k)
            ws = [pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT) for _ in range(copies_for(n * k // 2, l2))]
            w16 = dequantize(ws[0], torch.float16)
            fp16 = fp16_copies(w16, l2)
            for cls in classes:
                for m in GLUON_TOKENS[cls]:
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
                    row = {"m": m, "class": cls, "shape": label, "n": n, "k": k, "sweep": {},
                           "fp16_us": time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp16]),
                           "without_us": time_calls([lambda w_=w_: w4a16_linear(x, w_, policy=without) for w_ in ws])}
                    for e in _gluon_grid(cls):
                        if time.time() > deadline:
                            break
                        key = gluon_launch_key(e)
                        try:
                            cfg = pick_gluon(m, n, k, check_table({"gluon": {cls: e}}))
                            s_ = sqnr(ref, gluon_w4.gluon_w4a16(x, ws[0], None, cfg))
                            if s_ < 40:
                                row["sweep"][key] = dict(launch=e, error=f"SQNR {s_:.1f} dB")
                            else:
                                row["sweep"][key] = dict(launch=e, split=cfg.split_k, us=time_calls(
                                    [lambda w_=w_: gluon_w4.gluon_w4a16(x, w_, None, cfg) for w_ in ws]))
                        except Exception as exc:  # out of resources for a tile shape: record and go on
                            row["sweep"][key] = dict(launch=e, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                        bar.update()
                    rows.append(row)
            del ws, fp16, w16
            torch.cuda.empty_cache()
    return gluon_table(rows), rows


GLUON_MIN_GAIN = 0.05  # a class takes the Gluon GEMM where it is this much faster, beyond run-to-run noise


def gluon_table(rows) -> dict:
    """Per family of layer shapes (``launch.gluon_family``: "gluon_wide" by output features,
    "gluon_deep" by input features, "gluon" the rest; a family without rows is left out) and class:
    the launch with the best geometric mean over its rows, where it beats the path without Gluon over
    the same rows by GLUON_MIN_GAIN."""
    from spear.kernels.launch import gluon_family

    out = {}
    for key in ("gluon", "gluon_wide", "gluon_deep"):
        some = [r for r in rows if gluon_family(r["n"], r["k"]) == key]
        if not some:
            continue
        out[key] = {}
        for cls in dict.fromkeys(r["class"] for r in some):
            rs = [r for r in some if r["class"] == cls]
            keys = set.intersection(*(set(kk for kk, v in r["sweep"].items() if "us" in v) for r in rs))
            if not keys:
                continue
            best = min(keys, key=lambda kk: geomean(r["sweep"][kk]["us"] for r in rs))
            if geomean(r["sweep"][best]["us"] for r in rs) < (1 - GLUON_MIN_GAIN) * geomean(r["without_us"] for r in rs):
                out[key][cls] = dict(rs[0]["sweep"][best]["launch"])
    return out
