"""Launch shapes of the W4 kernel's one-token loops, measured on the GPU at hand.

The built-in table (``launch.BUILTIN``) was chosen on an H200. ``tune`` times the CUDA-core
loop (M = 1, 2, 4 tokens) over a grid of tile widths, warps, program counts and the
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
from spear.kernels.launch import Config, _split_for, merged_table, pick_config
from spear.kernels.timing import copies_for, time_calls
from spear.kernels.w4a16 import w4a16_matmul

GROUP = 128
LAYOUTS = {"nmajor": False, "kmajor": True}
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


def tc_config(m: int, n: int, k: int, kmajor: bool) -> Config:
    """The tensor-core launch pick_config makes when the CUDA-core loop is switched off."""
    key = "fma_kmajor_max_m" if kmajor else "fma_max_m"
    return pick_config(m, n, k, GROUP, kmajor, merged_table({key: 0}))


def fma_configs(m: int, n: int, k: int, kmajor: bool, grid=GRID):
    """The CUDA-core launches of the sweep (the register prefetch only exists in the K-major loop)."""
    mv = 1 if m == 1 else (2 if m == 2 else 4)
    for bn, nw, prog, pf, ns in itertools.product(grid["BN"], grid["num_warps"], grid["programs"],
                                                  grid["prefetch"], grid["num_stages"]):
        if pf and not kmajor:
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
    """Per layout: the CUDA-core launch with the best geometric mean at M = 1; for M = 2 and 4 the
    best launch of that token class (kept when it differs from M = 1's); and the largest M up to
    which the class's launch beats the tensor-core tiles."""
    table = {}
    for layout, kmajor in layouts.items():
        prefix = "fma_kmajor" if kmajor else "fma"
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


def sweep_loop(x: torch.Tensor, ws: list, ref: torch.Tensor, m: int, n: int, k: int, kmajor: bool, grid,
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
    """Sweep the CUDA-core loop on ``shapes`` [(label, n, k)] at each token count in ``tokens``:
    (the table entries for ``layout``, the timed rows). Needs a CUDA GPU."""
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise RuntimeError("tuning times the W4 kernel on a CUDA GPU; none is available")
    kmajor = LAYOUTS[layout]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_launch = sum(1 for m in tokens for _ in fma_configs(m, 4096, 4096, kmajor, grid)) * len(shapes)
    deadline = time.time() + budget_s
    rows = []
    with tqdm(total=n_launch, desc="tune-kernels", unit="launch", disable=not progress) as bar:
        for label, n, k in shapes:
            codes, scales, zeros = random_layer(n, k)
            ws = [pack(codes, scales, zeros, GROUP, kmajor=kmajor)
                  for _ in range(copies_for(n * k // 2, l2))]
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
                rows.append({"m": m, "shape": label, "n": n, "k": k,
                             layout: sweep_loop(x, ws, ref, m, n, k, kmajor, grid, deadline, bar.update)})
            del ws
            torch.cuda.empty_cache()
    table = launch_table(rows, {layout: kmajor})
    if table and kmajor:
        table["fma_kmajor_narrow"] = narrow_launch(rows, table["fma_kmajor"])
    return table, rows


def narrow_launch(rows, one_token: dict, max_n: int = 4096) -> dict | None:
    """The K-major one-token launch for layers of at most ``max_n`` output features (launch.BUILTIN's
    "fma_kmajor_narrow"): the sweep's best on those shapes at M = 1 when it beats ``one_token`` there,
    else None (the one-token launch serves them too)."""
    narrow = [r for r in rows if r["m"] == 1 and r["n"] <= max_n and r["kmajor"].get("sweep")]
    if not narrow:
        return None
    best, us, _ = _best(narrow, "kmajor", 1)
    current = [r["kmajor"]["sweep"].get(launch_key(one_token), {}).get("us") for r in narrow]
    if best is None or (all(current) and geomean(current) <= us):
        return None
    return dict(max_n=max_n, **_launch_entry(narrow[0]["kmajor"]["sweep"][best]["launch"]))

