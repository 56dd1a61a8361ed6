"""Launch shapes of the W4A16 GEMM (``w4a16.py``): the ``Config`` of one launch and the table
``pick_config`` reads by token count.

Runtime autotuning cannot run inside CUDA-graph capture (it times launches), so the choice is
a fixed table, picked from sweeps on one H200 (``benchmarks/bench_kernels.py --tune`` and
``spear tune-kernels`` write the same structure as ``launch_table.json``). ``BUILTIN`` is that
table, read-only; a deployment passes its own through ``KernelPolicy.launch``
(``spear.kernels.policy``), merged key by key over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType



@dataclass(frozen=True)
class Config:
    """One launch shape. split_k (and the fused EC's u_split) are constexpr in the kernel: one
    compilation per value, so the reductions over their partials unroll."""
    BM: int
    BN: int
    BK: int
    split_k: int
    num_warps: int
    num_stages: int
    mv: int = 0       # 1, 2 or 4: CUDA-core main loop for M <= mv tokens (no tensor cores)
    u_split: int = 0  # K ranges of the fused u = A x programs; 0: one per K step, at most w4a16.U_SPLIT_MAX
    ptx: bool = True  # CUDA-core loop with fp16 activations: the fp16x2 PTX word product
    prefetch: bool = False  # K-major CUDA-core loop: issue step k + 1's loads before step k's math


# Launch shapes by token count, each the best measured on the H200 for its token class
# (BENCHMARKS.md, "Where the built-in choices come from").
_BUILTIN = {
    "fma_max_m": 1,                                       # CUDA-core main loop up to here
    "fma": dict(BN=64, BK=128, num_warps=2, num_stages=2, programs=1024),
    # K-major layout, one token: with the next K step's loads issued before the current step's
    # math, fewer and longer programs win; 528, since ~396 were as fast alone but slower in the
    # engine (BENCHMARKS.md, "Where the built-in choices come from", "Tried, measured, dropped").
    "fma_kmajor": dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True),
    # per token class (MV "2", "4"; JSON keys) its own best launch, with which the CUDA-core loop
    # beats the tensor-core tiles up to M = 4; classes not listed use the M = 1 launch above.
    "fma_kmajor_by_mv": {"2": dict(BN=64, BK=128, num_warps=2, num_stages=3, programs=528),
                         "4": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=264, prefetch=True)},
    "fma_kmajor_max_m": 4,
    # one token, layers of at most max_n output features (N = 4096: only 64 column tiles): fewer,
    # longer programs (split 8 of four K steps instead of 16 of two) with 4 warps, faster there in
    # the engine (BENCHMARKS.md, "Where the built-in choices come from")
    "fma_kmajor_narrow": dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=2, programs=264, prefetch=True),
    "tc": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=512),    # split-K tensor-core decode
    # 17 to DECODE_MAX_M tokens (batched decode of 32-64 sequences): half the programs of "tc", so
    # split-K 2-8 instead of 4-16, because at 64 tokens every split writes an M x N fp32 partial
    "tc_wide": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=256),
    "prefill": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3),
    # the fragment layout's CUDA-core loop (_frag_fma.py) at 1-4 tokens, same structure as the
    # K-major entries: until `spear tune-kernels --layout mma` has timed it, the K-major loop's
    # launches (its own word products and register prefetch, over a layout of the same bytes)
    "fma_mma": dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True),
    "fma_mma_by_mv": {"2": dict(BN=64, BK=128, num_warps=2, num_stages=3, programs=528),
                      "4": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=264, prefetch=True)},
    "fma_mma_max_m": 4,
    "fma_mma_narrow": dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=2, programs=264, prefetch=True),
    # the fragment layout's tensor-core loop (_mma.py) by token class (tokens up to the key; "big"
    # above 256): BM tokens a tile, split-K until about ``programs`` programs run (absent: none).
    # `spear tune-kernels --layout mma` on Llama-3-8B's shapes, H200, 2026-12-04 (BENCHMARKS.md)
    "mma": {"16": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
            "32": dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
            "64": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=132),
            "128": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=528),
            "256": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
            "big": dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3)},
}
MMA_CLASSES = ("16", "32", "64", "128", "256", "big")  # the "mma" entries' token classes, in order


def _frozen(v):
    return MappingProxyType({k: _frozen(x) for k, x in v.items()}) if isinstance(v, dict) else v


BUILTIN = _frozen(_BUILTIN)  # read-only: a table of one's own is merged over it (merged_table)
DECODE_MAX_M = 64      # split-K tensor-core tiles up to here, prefill tiles above

# What a launch entry of the table may hold (the sweeps write a subset; BM is the prefill tile's)
_ENTRY_INTS = ("BM", "BN", "BK", "num_warps", "num_stages", "programs", "max_n", "u_split")
_POW2 = ("BM", "BN", "BK", "num_warps")


def _check_entry(where: str, e) -> dict:
    if not isinstance(e, (dict, MappingProxyType)):
        raise ValueError(f"{where}: a launch entry must be an object, got {type(e).__name__}")
    unknown = set(e) - set(_ENTRY_INTS) - {"prefetch"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; expected some of "
                         f"{', '.join(_ENTRY_INTS)}, prefetch")
    for key in _ENTRY_INTS:
        v = e.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{where}.{key} must be a positive integer, got {v!r}")
        if v is not None and key in _POW2 and v & (v - 1):
            raise ValueError(f"{where}.{key} must be a power of two, got {v}")
    if not isinstance(e.get("prefetch", False), bool):
        raise ValueError(f"{where}.prefetch must be true or false, got {e['prefetch']!r}")
    return e


def check_table(table) -> dict:
    """Validate a launch table (the structure of ``BUILTIN``, all keys optional) and return it."""
    if not isinstance(table, (dict, MappingProxyType)):
        raise ValueError(f"a launch table must be a JSON object, got {type(table).__name__}")
    for key, v in table.items():
        if key not in BUILTIN:
            raise ValueError(f"unknown launch table key {key!r}; expected some of {', '.join(BUILTIN)}")
        if key.endswith("_max_m"):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 4:
                raise ValueError(f"{key} must be an integer from 0 to 4 (the CUDA-core loop's token counts), "
                                 f"got {v!r}")
        elif key == "mma":
            if not isinstance(v, (dict, MappingProxyType)) or set(v) - set(MMA_CLASSES):
                raise ValueError(f"mma must map token classes among {', '.join(MMA_CLASSES)} to launch entries, "
                                 f"got {v!r}")
            for cls, e in v.items():
                _check_entry(f"mma.{cls}", e)
                if e.get("BK", 64) not in (64, 128) or e.get("BN", 16) % 16:
                    raise ValueError(f"mma.{cls}: the fragment loop takes BK 64 or 128 and BN a multiple of 16")
        elif key.endswith("_by_mv"):
            if not isinstance(v, (dict, MappingProxyType)) or set(v) - {"2", "4"}:
                raise ValueError(f"{key} must map token classes \"2\" and \"4\" to launch entries, got {v!r}")
            for mv, e in v.items():
                _check_entry(f"{key}.{mv}", e)
        elif v is None and key.endswith("_narrow"):
            pass  # off
        else:
            _check_entry(key, v)
        if key.startswith("fma_mma") and not key.endswith("_max_m"):
            entries = [(f"{key}.{mv}", e) for mv, e in v.items()] if key.endswith("_by_mv") else [(key, v or {})]
            for where, e in entries:
                if e.get("BK", 64) % 64 or e.get("BN", 16) < 16:
                    raise ValueError(f"{where}: the fragment layout's CUDA-core loop takes BK a multiple of 64 "
                                     f"and BN of at least 16, got {dict(e)}")
    return table


def read_table(table) -> dict:
    """``table`` (a dict, or the path of a JSON file as ``spear tune-kernels`` and
    ``benchmarks/bench_kernels.py --tune`` write it), checked."""
    if not isinstance(table, (dict, MappingProxyType)):
        from spear.errors import SpearError
        from spear.fileio import read_json

        try:
            table = read_json(Path(table), "the launch table")
        except SpearError as e:  # the policy's errors are ValueErrors
            raise ValueError(str(e)) from None
    return check_table(table)


def merged_table(table=None):
    """The built-in table with ``table`` (``read_table``'s input) merged over it key by key,
    read-only."""
    if table is None:
        return BUILTIN
    own = _thaw(read_table(table))
    merged = {**{k: _thaw(v) for k, v in BUILTIN.items()}, **own}
    if "mma" in own:  # per token class: a table may tune some classes only
        merged["mma"] = {**_thaw(BUILTIN["mma"]), **own["mma"]}
    return _frozen(merged)


def _thaw(v):
    return {k: _thaw(x) for k, x in v.items()} if isinstance(v, (dict, MappingProxyType)) else v


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_for(tiles: int, k: int, bk: int, programs: int) -> int:
    """Smallest power-of-two split-K giving ``programs`` programs, keeping >= 2 K steps each."""
    split = 1
    while tiles * split < programs and k // (bk * split * 2) >= 2:
        split *= 2
    return split


def mma_class(m: int) -> str:
    """The "mma" table class of ``m`` tokens."""
    return next((c for c in MMA_CLASSES[:-1] if m <= int(c)), "big")


def pick_config(m: int, n: int, k: int, group_size: int, layout: str = "nmajor", table=BUILTIN) -> Config:
    """The launch of an (m, n, k) W4 GEMM over a weight of ``layout`` under ``table``
    (``merged_table``'s result)."""
    if layout == "mma" and m <= table["fma_mma_max_m"]:
        return _frag_fma_config(m, n, k, table)
    if layout == "mma":
        mma = table["mma"]
        cls = mma_class(m)
        # a class the table leaves out takes the nearest smaller one that it holds
        c = mma.get(cls) or next(mma[x] for x in reversed(MMA_CLASSES[:MMA_CLASSES.index(cls)]) if x in mma)
        # BK 128 where it divides K and no group ends inside a step (the loop's scales are per step)
        bk = c["BK"] if k % c["BK"] == 0 and (group_size == 0 or group_size >= c["BK"]) else 64
        split = 1
        if c.get("programs"):
            split = _split_for(_cdiv(m, c["BM"]) * _cdiv(n, c["BN"]), k, bk, c["programs"])
        return Config(c["BM"], c["BN"], bk, split, c["num_warps"], c["num_stages"], u_split=c.get("u_split", 0))
    kmajor = layout == "kmajor"
    kmax = group_size if group_size else k  # BK must divide a group (one scale per step)
    fma = "fma_kmajor" if kmajor else "fma"
    if m <= table[fma + "_max_m"]:
        mv = 1 if m == 1 else (2 if m == 2 else 4)
        c = table.get(fma + "_by_mv", {}).get(str(mv), table[fma])
        narrow = table.get(fma + "_narrow")
        if mv == 1 and narrow and n <= narrow["max_n"]:
            c = narrow
        bk = min(c["BK"], kmax)
        split = _split_for(_cdiv(n, c["BN"]), k, bk, c["programs"])
        return Config(16, c["BN"], bk, split, c["num_warps"], c["num_stages"], mv=mv,
                      prefetch=bool(kmajor and c.get("prefetch", False)), u_split=c.get("u_split", 0))
    if m <= DECODE_MAX_M:
        c = table["tc"] if m <= 16 else table.get("tc_wide", table["tc"])
        bk = min(c["BK"], kmax)
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        split = _split_for(_cdiv(m, bm) * _cdiv(n, c["BN"]), k, bk, c["programs"])
        return Config(bm, c["BN"], bk, split, c["num_warps"], c["num_stages"], u_split=c.get("u_split", 0))
    c = table["prefill"]
    return Config(c["BM"], c["BN"], min(c["BK"], kmax), 1, c["num_warps"], c["num_stages"])


def _frag_fma_config(m: int, n: int, k: int, table) -> Config:
    """The fragment layout's CUDA-core launch for m <= 4 tokens (entries "fma_mma*"): by token
    class, the narrow launch at one token on layers of at most its max_n features."""
    mv = 1 if m == 1 else (2 if m == 2 else 4)
    c = table.get("fma_mma_by_mv", {}).get(str(mv), table["fma_mma"])
    narrow = table.get("fma_mma_narrow")
    if mv == 1 and narrow and n <= narrow["max_n"]:
        c = narrow
    # any group size: the loop reads the scales of each 64-input block (of each half at groups of 32)
    bk = c["BK"] if k % c["BK"] == 0 else 64
    split = _split_for(_cdiv(n, c["BN"]), k, bk, c["programs"])
    return Config(16, c["BN"], bk, split, c["num_warps"], c["num_stages"], mv=mv, prefetch=bool(c.get("prefetch", False)),
                  u_split=c.get("u_split", 0))
