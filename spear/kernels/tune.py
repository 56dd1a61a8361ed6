"""Launch shapes of the W4 kernel's one-token loops, measured on the GPU at hand.

The built-in table (``launch.BUILTIN``) was chosen on an H200. ``tune`` times a layout's CUDA-core
loop (M = 1, 2, 4 tokens; the K-major loop, or the fragment layout's of _frag_fma.py) over a grid of tile widths, warps, program counts and the
register prefetch, on the layer shapes of a model, against the tensor-core tiles, and
returns a table in ``BUILTIN``'s structure: per token class the launch with the best geometric mean over the shapes, and the
largest token count up to which the loop beats the tiles. ``spear tune-kernels`` writes it;
``spear serve --launch-table`` and ``KernelPolicy.launch_table`` read it
(``launch.read_table``).

Protocol: RTN 4-bit, asymmetric, random non-zero weights; every launch checked against the
fp32 reference first (SQNR > 40 dB); CUDA graphs cycling through weight copies beyond 2x L2,
median of replays (``timing.time_calls``). Runtime autotuning is not an option here: it
times launches, which cannot happen inside CUDA-graph capture, so the table is fixed
before serving.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from spear.kernels import reference
from spear.kernels.layout import pack
from spear.kernels.launch import MMA_CLASSES, Config, _split_for, merged_table, pick_config
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.w4a16 import w4a16_matmul

GROUP = 128
LAYOUTS = {"nmajor": "fma", "kmajor": "fma_kmajor", "mma": "fma_mma"}  # layout: its CUDA-core loop's table entries
# The sweep's grid (each key a list of values)
GRID = dict(BN=[32, 64, 128, 256], num_warps=[2, 4, 8], programs=[528, 1056, 2112], prefetch=[0], num_stages=[1])
# ``spear tune-kernels``'s default grid: the widths, warps and program counts that won somewhere
# in the H200 sweeps, with and without the register prefetch
TUNE_GRID = dict(BN=[64, 128], num_warps=[2, 4], programs=[264, 528, 1056], prefetch=[0, 1], num_stages=[1])


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - out.float()).norm()))


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else float("inf")


def _layout(kmajor) -> str:
    """A layout name from ``kmajor``: True / False (the K- / N-major layout) or the name itself."""
    return kmajor if isinstance(kmajor, str) else ("kmajor" if kmajor else "nmajor")


def tc_config(m: int, n: int, k: int, kmajor) -> Config:
    """The tensor-core launch pick_config makes when the CUDA-core loop is switched off
    (``kmajor``: see ``_layout``)."""
    layout = _layout(kmajor)
    return pick_config(m, n, k, GROUP, layout, merged_table({LAYOUTS[layout] + "_max_m": 0}))


def fma_configs(m: int, n: int, k: int, kmajor, grid=GRID):
    """The CUDA-core launches of the sweep (the register prefetch exists in the K-major and the
    fragment layout's loops)."""
    mv = 1 if m == 1 else (2 if m == 2 else 4)
    for bn, nw, prog, pf, ns in itertools.product(grid["BN"], grid["num_warps"], grid["programs"],
                                                  grid["prefetch"], grid["num_stages"]):
        if pf and _layout(kmajor) == "nmajor":
            continue
        yield (dict(BN=bn, num_warps=nw, programs=prog, prefetch=bool(pf), num_stages=ns),
               Config(16, bn, 128, _split_for(-(-n // bn), k, 128, prog), nw, ns, mv=mv, prefetch=bool(pf)))


def launch_key(launch: dict) -> str:
    """The sweep's name of a launch (a sweep launch or a table entry: absent fields take their defaults)."""
    stages = launch.get("num_stages", 1)
    return (f"BN{launch['BN']}_w{launch['num_warps']}_p{launch['programs']}" + ("_pf" if launch.get("prefetch") else "")
            + (f"_s{stages}" if stages != 1 else ""))


def _launch_entry(c: dict) -> dict:
    e = dict(BN=c["BN"], BK=128, num_warps=c["num_warps"], num_stages=c.get("num_stages", 1), programs=c["programs"])
    if c.get("prefetch"):
        e["prefetch"] = True
    return e


def _best(rows, layout, m):
    """(key, geomean µs, rows at M = m) of the CUDA-core launch with the best geometric mean over
    the shapes at M = m; key and µs None when no launch was timed on every shape."""
    rs = [r for r in rows if r["m"] == m and r[layout].get("sweep")]
    if not rs:
        return None, None, []
    keys = set.intersection(*(set(k for k, v in r[layout]["sweep"].items() if "us" in v) for r in rs))
    if not keys:
        return None, None, rs
    best = min(keys, key=lambda kk: geomean(r[layout]["sweep"][kk]["us"] for r in rs))
    return best, geomean(r[layout]["sweep"][best]["us"] for r in rs), rs


def launch_table(rows, layouts=LAYOUTS) -> dict:
    """Per layout (the names in ``layouts``): the CUDA-core launch with the best geometric mean at
    M = 1; for M = 2 and 4 the best launch of that token class (kept when it differs from M = 1's);
    and the largest M up to which the class's launch beats the tensor-core tiles."""
    table = {}
    for layout in layouts:
        prefix = LAYOUTS[layout]
        best1, _, ones = _best(rows, layout, 1)
        if best1 is None:
            continue
        table[prefix] = _launch_entry(ones[0][layout]["sweep"][best1]["launch"])
        table[prefix + "_by_mv"] = {}
        table[prefix + "_max_m"] = 0
        for m in (1, 2, 4):
            best, us, rs = _best(rows, layout, m)
            if best is None or us >= geomean(r[layout]["tc_us"] for r in rs):
                break
            if best != best1:
                table[prefix + "_by_mv"][str(m)] = _launch_entry(rs[0][layout]["sweep"][best]["launch"])
            table[prefix + "_max_m"] = m
    return table


def random_layer(n: int, k: int, seed: int = 0):
    """RTN 4-bit codes, fp16 scales and zero points of a random (n, k) weight on the GPU."""
    from spear.quant.primitives import rtn

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    codes, scales, zeros = rtn(w, 4, GROUP, symmetric=False)
    return codes, scales.half(), zeros


def sweep_loop(x: torch.Tensor, ws: list, ref: torch.Tensor, m: int, n: int, k: int, kmajor, grid,
               deadline: float = math.inf, on_launch=None) -> dict:
    """The CUDA-core loop over ``grid`` and the tensor-core tiles at one shape and token count:
    {"tc_us": µs, "sweep": {key: {"launch", "us" or "error"}}}; launches not started past
    ``deadline`` (time.time()) are left out. ``ws``: packed copies of the weight."""

    def timed(cfg):
        s_ = sqnr(ref, w4a16_matmul(x, ws[0], config=cfg))
        if s_ < 40:
            return dict(error=f"SQNR {s_:.1f} dB")
        return dict(us=time_calls([lambda w_=w_: w4a16_matmul(x, w_, config=cfg) for w_ in ws]))

    r = dict(tc_us=timed(tc_config(m, n, k, kmajor)).get("us", float("inf")), sweep={})
    for launch, c in fma_configs(m, n, k, kmajor, grid):
        if time.time() > deadline:
            break
        try:
            r["sweep"][launch_key(launch)] = dict(launch=launch, **timed(c))
        except Exception as e:  # out of resources for a tile shape: record and go on
            r["sweep"][launch_key(launch)] = dict(launch=launch, error=f"{type(e).__name__}: {str(e)[:100]}")
        if on_launch is not None:
            on_launch()
    return r


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


def tune(shapes, tokens=(1, 2, 4), grid=TUNE_GRID, layout: str = "kmajor", budget_s: float = 600,
         progress: bool = True) -> tuple[dict, list]:
    """Sweep ``layout``'s CUDA-core loop ("kmajor", "nmajor" or "mma") on ``shapes`` [(label, n, k)]
    at each token count in ``tokens``: (the table entries for ``layout``, the timed rows). Needs a
    CUDA GPU."""
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise RuntimeError("tuning times the W4 kernel on a CUDA GPU; none is available")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_launch = sum(1 for m in tokens for _ in fma_configs(m, 4096, 4096, layout, grid)) * len(shapes)
    deadline = time.time() + budget_s
    rows = []
    with tqdm(total=n_launch, desc="tune-kernels", unit="launch", disable=not progress) as bar:
        for label, n, k in shapes:
            codes, scales, zeros = random_layer(n, k)
            ws = [pack(codes, scales, zeros, GROUP, layout=layout)
                  for _ in range(copies_for(n * k // 2, l2))]
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
                rows.append({"m": m, "shape": label, "n": n, "k": k,
                             layout: sweep_loop(x, ws, ref, m, n, k, layout, grid, deadline, bar.update)})
            del ws
            torch.cuda.empty_cache()
    table = launch_table(rows, (layout,))
    if table and layout != "nmajor":
        table[LAYOUTS[layout] + "_narrow"] = narrow_launch(rows, table[LAYOUTS[layout]], layout=layout)
    return table, rows


def narrow_launch(rows, one_token: dict, max_n: int = 4096, layout: str = "kmajor") -> dict | None:
    """``layout``'s one-token launch for layers of at most ``max_n`` output features (launch.BUILTIN's
    "fma_kmajor_narrow", "fma_mma_narrow"): the sweep's best on those shapes at M = 1 when it beats
    ``one_token`` there, else None (the one-token launch serves them too)."""
    narrow = [r for r in rows if r["m"] == 1 and r["n"] <= max_n and r[layout].get("sweep")]
    if not narrow:
        return None
    best, us, _ = _best(narrow, layout, 1)
    current = [r[layout]["sweep"].get(launch_key(one_token), {}).get("us") for r in narrow]
    if best is None or (all(current) and geomean(current) <= us):
        return None
    return dict(max_n=max_n, **_launch_entry(narrow[0][layout]["sweep"][best]["launch"]))



# ---------------------------------------------------------------------------- the fragment layout
# Token counts timed per "mma" class (launch.MMA_CLASSES), and each class's launch grid: split-K
# ("programs") where the tiles alone leave SMs idle, wider token tiles and 8 warps as M grows.
MMA_TOKENS = {"16": (1, 16), "32": (32,), "64": (64,), "128": (96, 128), "256": (192, 256),
              "big": (512, 1024, 2048, 4096)}


def _mma_grid(cls: str) -> list[dict]:
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


def mma_launch_key(e: dict) -> str:
    return (f"BM{e['BM']}_BN{e['BN']}_BK{e['BK']}_w{e['num_warps']}_s{e['num_stages']}"
            + (f"_p{e['programs']}" if e.get("programs") else ""))


def mma_config(m: int, n: int, k: int, e: dict) -> Config:
    """The launch ``pick_config`` makes for table entry ``e`` (class of m) at an (m, n, k) GEMM: the
    tensor-core tiles, also at 1-4 tokens (the CUDA-core loop is ``tune(..., layout="mma")``'s)."""
    return pick_config(m, n, k, GROUP, "mma", merged_table({"mma": {"16": e, "32": e, "64": e, "128": e, "256": e,
                                                                     "big": e}, "fma_mma_max_m": 0}))


def _compile_one(args) -> int:
    """Compile (into Triton's disk cache) the launches of ``args`` = [(m, n, k, entry)], on small
    tensors of the same specialisation (a worker process of ``warm_mma``)."""
    launches, = args
    from spear.quant.primitives import rtn

    for m, n, k, e in launches:
        cfg = mma_config(m, n, k, dict(e))
        nn_, kk = max(cfg.BN, 64), 128 * cfg.split_k * 2
        codes, scales, zeros = rtn(torch.randn(nn_, kk, device="cuda") * 0.02, 4, GROUP, symmetric=False)
        w = pack(codes, scales.half(), zeros, GROUP, layout="mma")
        x = torch.randn(m, kk, device="cuda", dtype=torch.float16)
        try:
            w4a16_matmul(x, w, config=cfg)
        except Exception:  # out of resources: the sweep records it
            pass
    torch.cuda.synchronize()
    return len(launches)


def warm_mma(launches, workers: int = 12) -> None:
    """Triton compiles on one thread per process: compile the sweep's launches in parallel first."""
    import concurrent.futures as cf
    import multiprocessing as mp

    chunks = [launches[i::workers] for i in range(workers) if launches[i::workers]]
    try:
        with cf.ProcessPoolExecutor(max_workers=len(chunks), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_compile_one, [(c,) for c in chunks]))
    except Exception as exc:  # only a speed-up: the sweep compiles on first use anyway
        print(f"parallel compile pass failed ({type(exc).__name__}: {exc}); compiling on first use", flush=True)


def tune_mma(shapes, classes=None, budget_s: float = 900, progress: bool = True,
             baselines: bool = True) -> tuple[dict, list]:
    """Sweep the fragment layout's launches (``_mma_grid``) on ``shapes`` [(label, n, k)] at each
    class's token counts (``MMA_TOKENS``): ({"mma": {class: best entry}}, rows). Each row holds the
    timings of one (shape, M) in µs, and with ``baselines`` cuBLAS FP16 and the K-major path the
    default policy takes. Best = the geometric mean over the class's shapes and token counts."""
    from tqdm.auto import tqdm

    from spear.kernels.dequant import dequantize
    from spear.kernels.ops import w4a16_linear

    if not torch.cuda.is_available():
        raise RuntimeError("tuning times the W4 kernel on a CUDA GPU; none is available")
    classes = list(classes or MMA_TOKENS)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    todo = [(cls, m, e) for cls in classes for m in MMA_TOKENS[cls] for e in _mma_grid(cls)]
    warm_mma(sorted({(m, n, k, tuple(sorted(e.items()))) for cls, m, e in todo for _, n, k in shapes}))
    deadline = time.time() + budget_s
    rows = []
    with tqdm(total=len(todo) * len(shapes), desc="tune-kernels mma", unit="launch", disable=not progress) as bar:
        for label, n, k in shapes:
            codes, scales, zeros = random_layer(n, k)
            nbytes = n * k // 2
            ws = [pack(codes, scales, zeros, GROUP, layout="mma") for _ in range(copies_for(nbytes, l2))]
            base = {}
            if baselines:
                wk = [pack(codes, scales, zeros, GROUP, layout="kmajor") for _ in range(copies_for(nbytes, l2))]
                fp16 = fp16_copies(dequantize(wk[0], torch.float16), l2)
            for cls in classes:
                for m in MMA_TOKENS[cls]:
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
                    row = {"m": m, "class": cls, "shape": label, "n": n, "k": k, "sweep": {}}
                    if baselines:
                        row["fp16_us"] = time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp16])
                        row["kmajor_us"] = time_calls([lambda w_=w_: w4a16_linear(x, w_) for w_ in wk])
                    for e in _mma_grid(cls):
                        key = mma_launch_key(e)
                        if time.time() > deadline:
                            break
                        try:
                            cfg = mma_config(m, n, k, e)
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
            del ws, base
            if baselines:
                del wk, fp16, w16
            torch.cuda.empty_cache()
    return {"mma": mma_table(rows)}, rows


def mma_table(rows) -> dict:
    """Per class: the launch with the best geometric mean over its rows (shapes x token counts)."""
    out = {}
    for cls in MMA_CLASSES:
        rs = [r for r in rows if r["class"] == cls]
        if not rs:
            continue
        keys = set.intersection(*(set(kk for kk, v in r["sweep"].items() if "us" in v) for r in rs))
        if keys:
            best = min(keys, key=lambda kk: geomean(r["sweep"][kk]["us"] for r in rs))
            out[cls] = dict(rs[0]["sweep"][best]["launch"])
    return out
