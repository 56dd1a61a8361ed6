"""Launch shapes of the W4A16 GEMM (``w4a16.py``): the ``Config`` of one launch and the table
``pick_config`` reads by token count.

Runtime autotuning cannot run inside CUDA-graph capture (it times launches), so the choice is
a fixed table, picked from sweeps on one H200 (``benchmarks/bench_kernels.py --tune`` and
``spear tune-kernels`` write the same structure as ``launch_table.json``). ``BUILTIN`` is that
table, read-only; a deployment passes its own through ``KernelPolicy.launch``
(``spear.kernels.policy``), merged key by key over it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType



@dataclass(frozen=True)
class GluonConfig:
    """One launch of the Gluon GEMM (gluon_w4.py): BNC output rows per consumer warpgroup (two of
    them a tile), BM tokens a tile, BK inputs a stage (64 or 128), ``stages`` stages in the
    ring, and the K split (1: none)."""
    BNC: int
    BM: int
    BK: int
    stages: int
    split_k: int = 1

    def __post_init__(self):
        if self.BNC not in (64, 128):
            raise ValueError(f"BNC must be 64 or 128, got {self.BNC}")
        if self.BM not in (16, 32, 64, 128, 256):
            raise ValueError(f"BM must be a power of two from 16 to 256, got {self.BM}")
        if self.BK not in (64, 128):
            raise ValueError(f"BK must be 64 or 128, got {self.BK}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"stages must be 2..8, got {self.stages}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"split_k must be 1..64, got {self.split_k}")
        if self.BNC * self.BM > 128 * 128:
            raise ValueError(f"a consumer's fp32 accumulator BNC x BM is at most 128 x 128 (or 64 x 256); got "
                             f"{self.BNC} x {self.BM}")

    @property
    def BN(self) -> int:
        return 2 * self.BNC

    def __str__(self) -> str:
        return f"BN={self.BN} BM={self.BM} BK={self.BK} stages={self.stages} split={self.split_k}"


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


# Launch shapes by token count, each the best of a sweep on the H200 for its token class
# (``spear tune-kernels``, ``benchmarks/bench_kernels.py --tune``).
_BUILTIN = {
    "fma_max_m": 1,                                       # CUDA-core main loop up to here
    "fma": dict(BN=64, BK=128, num_warps=2, num_stages=2, programs=1024),
    # K-major layout, one token: with the next K step's loads issued before the current step's
    # math, fewer and longer programs win; 528, since ~396 were as fast alone but slower in the
    # engine (BENCHMARKS.md, "Tried, measured, dropped").
    "fma_kmajor": dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True),
    # per token class (MV "2", "4"; JSON keys) its own best launch, with which the CUDA-core loop
    # beats the tensor-core tiles up to M = 4; classes not listed use the M = 1 launch above.
    "fma_kmajor_by_mv": {"2": dict(BN=64, BK=128, num_warps=2, num_stages=3, programs=528),
                         "4": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=264, prefetch=True)},
    "fma_kmajor_max_m": 4,
    # one token, layers of at most max_n output features (N = 4096: only 64 column tiles): fewer,
    # longer programs (split 8 of four K steps instead of 16 of two) with 4 warps, faster there in
    # the engine (bench_decode.py on the H200)
    "fma_kmajor_narrow": dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=2, programs=264, prefetch=True),
    "tc": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=512),    # split-K tensor-core decode
    # 17 to DECODE_MAX_M tokens (batched decode of 32-64 sequences): half the programs of "tc", so
    # split-K 2-8 instead of 4-16, because at 64 tokens every split writes an M x N fp32 partial
    "tc_wide": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=256),
    "prefill": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3),
    # the fragment layout's CUDA-core loop (_frag_fma.py) at 1-4 tokens, same structure as the
    # K-major entries: until `spear tune-kernels --layout mma` has timed it, the K-major loop's
    # launches (its own word products and register prefetch, over a layout of the same bytes), and
    # off (fma_mma_max_m 0: the tensor-core tiles serve 1-4 tokens, as measured on the H200) until a
    # table of one's own turns it on where it wins
    "fma_mma": dict(BN=64, BK=128, num_warps=2, num_stages=1, programs=528, prefetch=True),
    "fma_mma_by_mv": {"2": dict(BN=64, BK=128, num_warps=2, num_stages=3, programs=528),
                      "4": dict(BN=64, BK=128, num_warps=4, num_stages=3, programs=264, prefetch=True)},
    "fma_mma_max_m": 0,
    "fma_mma_narrow": dict(max_n=4096, BN=64, BK=128, num_warps=4, num_stages=2, programs=264, prefetch=True),
    # the fragment layout's tensor-core loop (_mma.py) by token class (tokens up to the key; "big"
    # above 256): BM tokens a tile, split-K until about ``programs`` programs run (absent: none).
    # `spear tune-kernels --layout mma` on Llama-3-8B's shapes, H200, 2026-12-04 (BENCHMARKS.md,
    # "Kernels: the W4A16 GEMM from 1 to 4,096 tokens")
    "mma": {"16": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
            "32": dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
            "64": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=132),
            "128": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=528),
            "256": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
            "big": dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3)},
}
MMA_CLASSES = ("16", "32", "64", "128", "256", "big")  # the "mma" entries' token classes, in order
# The Gluon GEMM's (gluon_w4.py) token classes: tokens up to the key, "big" above 1024. A class the
# table holds runs the Gluon kernel on Hopper (the fragment layout; KernelPolicy.gluon); the
# others keep the Triton kernel or dequantize + cuBLAS. Entries: BN output rows a tile (two
# consumer warpgroups of BN / 2), BM tokens a tile, BK inputs a stage, num_stages ring stages,
# programs: the K split brings the tiles up to about this many units.
GLUON_CLASSES = ("16", "32", "64", "128", "256", "512", "1024", "big")
# Layers of at least GLUON_WIDE_N output features (Llama's gate/up) take the "gluon_wide" classes,
# the others "gluon": the best tile differs between them (BM 256 against 128 at 129-256 tokens).
# A table without "gluon_wide" sends every layer to its "gluon" classes.
GLUON_WIDE_N = 16384
# `spear tune-kernels --layout gluon` on Llama-3-8B's three shapes, H100, 2026-12-06 (BENCHMARKS.md,
# "The warp-specialized Gluon GEMM", raw run21-h100-2026-12-06/tune/gluon_rows.json): per width, the
# classes where one launch beat the path without it by 5% or more (geometric mean over the shapes
# and token counts). q/o and down: 128 by 19%, 512 by 21%, 1024 by 14%; gate_up: 128 by 22%, 256
# by 23%, 512 by 23%, 1024 by 14%. At 16-64 tokens the Triton GEMM stays within 3% either side,
# above 1024 dequantize + cuBLAS wins by 2-3%.
_BUILTIN["gluon"] = {"128": dict(BN=128, BM=64, BK=128, num_stages=6),
                     "512": dict(BN=128, BM=128, BK=128, num_stages=4),
                     "1024": dict(BN=128, BM=256, BK=128, num_stages=2)}
_BUILTIN["gluon_wide"] = {"128": dict(BN=256, BM=128, BK=128, num_stages=3),
                          "256": dict(BN=128, BM=256, BK=128, num_stages=2),
                          "512": dict(BN=128, BM=128, BK=128, num_stages=4),
                          "1024": dict(BN=128, BM=256, BK=64, num_stages=5)}


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
        elif key in ("gluon", "gluon_wide"):
            if not isinstance(v, (dict, MappingProxyType)) or set(v) - set(GLUON_CLASSES):
                raise ValueError(f"{key} must map token classes among {', '.join(GLUON_CLASSES)} to launch entries, "
                                 f"got {v!r}")
            for cls, e in v.items():
                _check_entry(f"{key}.{cls}", e)
                missing = {"BN", "BM", "BK", "num_stages"} - set(e)
                if missing:
                    raise ValueError(f"{key}.{cls}: missing {sorted(missing)}")
                try:
                    GluonConfig(e["BN"] // 2, e["BM"], e["BK"], e["num_stages"])
                except ValueError as err:
                    raise ValueError(f"{key}.{cls}: {err}") from None
                if e["BN"] % 2:
                    raise ValueError(f"{key}.{cls}: BN must be 128 or 256")
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
    for key in ("mma", "gluon", "gluon_wide"):  # per token class: a table may tune some classes only
        if key in own:
            merged[key] = {**_thaw(BUILTIN[key]), **own[key]}
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


SPLIT_OVERHEAD_STEPS = 2  # a split unit's partial store and share of the reduction, in K steps


def pick_split(tiles: int, steps: int, programs: int, min_steps: int = 2) -> int:
    """The K split of ``tiles`` output tiles of ``steps`` K steps each over a persistent grid of
    ``programs`` programs: the one with the shortest critical path, ceil(tiles x split / programs)
    units a program of ceil(steps / split) steps each, plus SPLIT_OVERHEAD_STEPS a unit when split
    (the smallest such split), among the splits whose ranges are all at least ``min_steps`` steps
    long (or the whole K) and none empty."""
    best, best_cost = 1, -(-tiles // programs) * steps
    for s in range(2, 65):
        per = -(-steps // s)
        if per < min_steps:
            break
        if (s - 1) * per >= steps:  # the last split would be empty
            continue
        cost = -(-(tiles * s) // programs) * (per + SPLIT_OVERHEAD_STEPS)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def gluon_class(m: int) -> str:
    """The "gluon" table class of ``m`` tokens."""
    return next((c for c in GLUON_CLASSES[:-1] if m <= int(c)), "big")


GLUON_PROGRAMS = 132  # the K split's default target: one unit per SM of an H100/H200


# Shared memory one block may take on sm_90 (227 KB), and what the Gluon kernel's epilogue takes
# beside its ring and the compensator's v tiles: the scratch of its layout conversions (the store;
# with a compensator its B tile too), in the compiled kernels' totals 4.0 KB beside a compensator
# of rank 16, 16.0-16.3 KB beside ranks 32 and 64 (H100, 2026-12-06; tests/kernels/test_gluon.py).
GLUON_SMEM_LIMIT = 232_448
GLUON_EPILOGUE_SCRATCH = 4 * 1024
GLUON_EC_SCRATCH = 17 * 1024


def gluon_smem(cfg: GluonConfig, group_size: int, rank: int = 0) -> int:
    """Shared memory of the Gluon kernel under ``cfg`` (bytes): per ring stage the activations, the
    codes, a scale and a zero point per row and group, two mbarriers; the two consumers' v tiles of
    a compensator of ``rank``; the epilogue's scratch."""
    kb = cfg.BK // 64
    groups = _cdiv(cfg.BK, group_size) if group_size else 1
    stage = kb * cfg.BM * 64 * 2 + cfg.BN // 16 * 128 * kb * 4 + groups * cfg.BN * 3 + 16
    return cfg.stages * stage + (2 * cfg.BM * rank * 2 + GLUON_EC_SCRATCH if rank else GLUON_EPILOGUE_SCRATCH)


def fit_gluon(cfg: GluonConfig, group_size: int, rank: int = 0) -> GluonConfig | None:
    """``cfg`` with as many ring stages as fit beside a compensator of ``rank`` (at most its own),
    or None where not even two do."""
    for stages in range(cfg.stages, 1, -1):
        fitted = replace(cfg, stages=stages)
        if gluon_smem(fitted, group_size, rank) <= GLUON_SMEM_LIMIT:
            return fitted
    return None


def pick_gluon(m: int, n: int, k: int, table=BUILTIN, group_size: int = 128, rank: int = 0) -> GluonConfig | None:
    """The Gluon launch of an (m, n, k) GEMM over the fragment layout under ``table`` (its
    "gluon_wide" classes from GLUON_WIDE_N output features), with the compensator of ``rank`` in its
    epilogue (0: none), or None when the table keeps ``m`` tokens of such a layer off the Gluon
    kernel or its tile leaves no room for two stages beside the compensator."""
    classes = table.get("gluon_wide") if n >= GLUON_WIDE_N and table.get("gluon_wide") is not None else \
        table.get("gluon")
    e = (classes or {}).get(gluon_class(m))
    if e is None:
        return None
    tiles = _cdiv(m, e["BM"]) * _cdiv(n, e["BN"])
    split = pick_split(tiles, _cdiv(k, e["BK"]), e.get("programs", GLUON_PROGRAMS))
    return fit_gluon(GluonConfig(e["BN"] // 2, e["BM"], e["BK"], e["num_stages"], split), group_size, rank)


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
