"""Launch shapes of the W4 GEMMs, measured on the GPU at hand: the Triton GEMM of the fragment
layout here, the Gluon GEMM in tune_gluon.py.

The built-in table (``launch.BUILTIN``) was chosen on an H200. ``tune_fragment`` times each token
class's launch grid (``_fragment_grid``) on the layer shapes of a model, beside cuBLAS FP16 and the
op under the default policy, and returns the table's "fragment" family: per class the launch with
the best geometric mean over the shapes and the class's token counts. ``spear tune-kernels`` writes
it; ``spear serve --launch-table`` and ``KernelPolicy.launch_table`` read it (``launch.read_table``).

Protocol: RTN 4-bit, asymmetric, random non-zero weights; every launch checked against the fp32
reference first (SQNR > 40 dB); CUDA graphs cycling through weight copies beyond 2x L2, median of
replays (``timing.time_calls``). Runtime autotuning is not an option here: it times launches,
which cannot happen inside CUDA-graph capture, so the table is fixed before serving.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from spear.kernels import reference
from spear.kernels.launch import FRAGMENT_CLASSES, TritonConfig, merged_table, pick_triton
from spear.kernels.layout import Layout, pack
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.w4a16 import w4a16_matmul

GROUP = 128


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - out.float()).norm()))


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else float("inf")


def random_layer(n: int, k: int, seed: int = 0):
    """RTN 4-bit codes, fp16 scales and zero points of a random (n, k) weight on the GPU."""
    from spear.quant.primitives import rtn

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    codes, scales, zeros = rtn(w, 4, GROUP, symmetric=False)
    return codes, scales.half(), zeros


def fp16_copies(w16: torch.Tensor, l2: int) -> list[torch.Tensor]:
    """``w16`` and clones of it, enough that cycling through them reads beyond 2x L2 (cuBLAS FP16's
    baseline as a server sees it)."""
    return [w16] + [w16.clone() for _ in range(copies_for(w16.numel() * w16.element_size(), l2) - 1)]


def model_shapes(config) -> list[tuple[str, int, int]]:
    """(label, out_features, in_features) of a Llama-family decoder layer's W4 GEMMs as the engine
    runs them (q/k/v and gate/up fused) from an HF config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden), ("o", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


# Token counts timed per class (launch.FRAGMENT_CLASSES), and each class's launch grid: split-K
# ("programs") where the tiles alone leave SMs idle, wider token tiles and 8 warps as M grows.
FRAGMENT_TOKENS = {"16": (1, 16), "32": (32,), "64": (64,), "128": (96, 128), "256": (192, 256),
                   "big": (512, 1024, 2048, 4096)}


def _fragment_grid(cls: str) -> list[dict]:
    p = itertools.product
    if cls in ("16", "32"):
        return [dict(BM=int(cls), BN=bn, BK=128, num_warps=4, num_stages=st, programs=pr)
                for bn, st, pr in p((64, 128), (3, 4), (264, 528, 1056))]
    if cls == "64":
        return [dict(BM=64, BN=bn, BK=bk, num_warps=4, num_stages=st, programs=pr)
                for bn, bk, st, pr in p((64, 128), (64, 128), (3, 4), (132, 264, 528))]
    if cls in ("128", "256"):
        # narrow column tiles with split-K keep 2-4 programs on each SM (one 8-warp program per SM
        # left the H200 at 12% occupancy, ncu 2026-12-04); wide ones (8 warps) re-read the
        # activations from L2 fewer times
        return ([dict(BM=bm, BN=64, BK=128, num_warps=4, num_stages=3, programs=pr)
                 for bm, pr in p((64, 128), (264, 528))]
                + [dict(BM=bm, BN=bn, BK=bk, num_warps=8, num_stages=3, **({"programs": pr} if pr else {}))
                   for bm, bn, bk, pr in p((64, 128), (128, 256), (64, 128), (0, 264))])
    return [dict(BM=bm, BN=bn, BK=bk, num_warps=8, num_stages=st)
            for bm, bn, bk, st in ((256, 128, 64, 3), (256, 128, 64, 4), (256, 128, 128, 3), (128, 256, 64, 3),
                                   (128, 256, 128, 3), (128, 128, 64, 4), (128, 128, 128, 3))]


def launch_key(e: dict) -> str:
    return (f"BM{e['BM']}_BN{e['BN']}_BK{e['BK']}_w{e['num_warps']}_s{e['num_stages']}"
            + (f"_p{e['programs']}" if e.get("programs") else ""))


def fragment_config(m: int, n: int, k: int, e: dict) -> TritonConfig:
    """The launch ``pick_triton`` makes from table entry ``e`` for an (m, n, k) GEMM."""
    return pick_triton(m, n, k, True, GROUP, merged_table({"fragment": {c: e for c in FRAGMENT_CLASSES}}))


def _compile_one(args) -> int:
    """Compile (into Triton's disk cache) the launches of ``args`` = [(m, n, k, entry)], on small
    tensors of the same specialisation (a worker process of ``_warm``)."""
    launches, = args
    from spear.quant.primitives import rtn

    for m, n, k, e in launches:
        cfg = fragment_config(m, n, k, dict(e))
        nn_, kk = max(cfg.BN, 64), 128 * cfg.split_k * 2
        codes, scales, zeros = rtn(torch.randn(nn_, kk, device="cuda") * 0.02, 4, GROUP, symmetric=False)
        w = pack(codes, scales.half(), zeros, GROUP, layout=Layout.FRAGMENT)
        x = torch.randn(m, kk, device="cuda", dtype=torch.float16)
        try:
            w4a16_matmul(x, w, config=cfg)
        except Exception:  # out of resources: the sweep records it
            pass
    torch.cuda.synchronize()
    return len(launches)


def _warm(launches, workers: int = 12) -> None:
    """Triton compiles on one thread per process: compile the sweep's launches in parallel first."""
    import concurrent.futures as cf
    import multiprocessing as mp

    chunks = [launches[i::workers] for i in range(workers) if launches[i::workers]]
    try:
        with cf.ProcessPoolExecutor(max_workers=len(chunks), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_compile_one, [(c,) for c in chunks]))
    except Exception as exc:  # only a speed-up: the sweep compiles on first use anyway
        print(f"parallel compile pass failed ({type(exc).__name__}: {exc}); compiling on first use", flush=True)


def tune_fragment(shapes, classes=None, budget_s: float = 900, progress: bool = True,
                  baselines: bool = True) -> tuple[dict, list]:
    """Sweep the fragment GEMM's launches (``_fragment_grid``) on ``shapes`` [(label, n, k)] at each
    class's token counts (``FRAGMENT_TOKENS``): ({"fragment": {class: best entry}}, rows). Each row
    holds the timings of one (shape, M) in µs, and with ``baselines`` cuBLAS FP16 and the op under
    the default policy. Best = the geometric mean over the class's shapes and token counts."""
    from tqdm.auto import tqdm

    from spear.kernels.dequant import dequantize
    from spear.kernels.ops import w4a16_linear

    if not torch.cuda.is_available():
        raise RuntimeError("tuning times the W4 kernel on a CUDA GPU; none is available")
    classes = list(classes or FRAGMENT_TOKENS)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    todo = [(cls, m, e) for cls in classes for m in FRAGMENT_TOKENS[cls] for e in _fragment_grid(cls)]
    _warm(sorted({(m, n, k, tuple(sorted(e.items()))) for cls, m, e in todo for _, n, k in shapes}))
    deadline = time.time() + budget_s
    rows = []
    with tqdm(total=len(todo) * len(shapes), desc="tune-kernels", unit="launch", disable=not progress) as bar:
        for label, n, k in shapes:
            codes, scales, zeros = random_layer(n, k)
            ws = [pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT) for _ in range(copies_for(n * k // 2, l2))]
            fp16 = fp16_copies(dequantize(ws[0], torch.float16), l2) if baselines else []
            for cls in classes:
                for m in FRAGMENT_TOKENS[cls]:
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
                    row = {"m": m, "class": cls, "shape": label, "n": n, "k": k, "sweep": {}}
                    if baselines:
                        row["fp16_us"] = time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp16])
                        row["default_us"] = time_calls([lambda w_=w_: w4a16_linear(x, w_) for w_ in ws])
                    for e in _fragment_grid(cls):
                        key = launch_key(e)
                        if time.time() > deadline:
                            break
                        try:
                            cfg = fragment_config(m, n, k, e)
                            s_ = sqnr(ref, w4a16_matmul(x, ws[0], config=cfg))
                            if s_ < 40:
                                row["sweep"][key] = dict(launch=e, error=f"SQNR {s_:.1f} dB")
                            else:
                                row["sweep"][key] = dict(launch=e, us=time_calls(
                                    [lambda w_=w_: w4a16_matmul(x, w_, config=cfg) for w_ in ws]))
                        except Exception as exc:
                            row["sweep"][key] = dict(launch=e, error=f"{type(exc).__name__}: {str(exc)[:100]}")
                        bar.update()
                    rows.append(row)
            del ws, fp16
            torch.cuda.empty_cache()
    return {"fragment": fragment_table(rows)}, rows


def fragment_table(rows) -> dict:
    """Per class: the launch with the best geometric mean over its rows (shapes x token counts)."""
    out = {}
    for cls in FRAGMENT_CLASSES:
        rs = [r for r in rows if r["class"] == cls]
        if not rs:
            continue
        keys = set.intersection(*(set(kk for kk, v in r["sweep"].items() if "us" in v) for r in rs))
        if keys:
            best = min(keys, key=lambda kk: geomean(r["sweep"][kk]["us"] for r in rs))
            out[cls] = dict(rs[0]["sweep"][best]["launch"])
    return out
