"""Launch shapes of the W4 GEMMs: the typed config of one launch (``TritonConfig``, ``GluonConfig``)
and the launch table they are picked from by token count.

Runtime autotuning cannot run inside CUDA-graph capture (it times launches), so the choice is a
fixed table. It holds one family per kernel, each mapping token classes (tokens up to the key,
"big" above the last) to launch entries; ``FAMILIES`` declares them once, and ``check_table``
validates a table against that declaration:

  fragment     the Triton GEMM over the fragment layout (w4a16.py, _fragment.py)
  nmajor       the Triton GEMM over the N-major fallback layout (_nmajor.py); class "1" is its
               one-token loop on CUDA cores, the others tensor-core tiles
  gluon        the warp-specialized Gluon GEMM (gluon_w4.py) on Hopper, for the classes the table
  gluon_wide   holds (others keep the Triton GEMM or cuBLAS); "gluon_wide" for layers of at least
  gluon_deep   GLUON_WIDE_N output features, "gluon_deep" for the others of at least GLUON_DEEP_K
               input features (``gluon_family``), whose best tiles differ

``BUILTIN`` is the table chosen on an H200 (Triton) and an H100 (Gluon) with ``spear tune-kernels``,
read-only; a deployment passes its own (``KernelPolicy.launch_table``, the JSON that
``spear tune-kernels`` writes), merged class by class over it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType


@dataclass(frozen=True)
class TritonConfig:
    """One launch of the Triton GEMM (w4a16.py): BM tokens by BN outputs a tile, BK inputs a step.
    split_k (and the fused EC's u_split) are constexpr in the kernel: one compilation per value, so
    the reductions over their partials unroll."""
    BM: int
    BN: int
    BK: int
    split_k: int
    num_warps: int
    num_stages: int
    mv: int = 0       # 1: the N-major layout's one-token loop on CUDA cores (no tensor cores)
    u_split: int = 0  # K ranges of the fused EC's u = A x programs (0: one per K step up to w4a16.U_SPLIT_MAX)

    def __post_init__(self):
        if self.mv not in (0, 1):
            raise ValueError(f"mv is 0 (tensor cores) or 1 (the one-token loop), got {self.mv}")

    def __str__(self) -> str:
        return (f"BM={self.BM} BN={self.BN} BK={self.BK} split={self.split_k} warps={self.num_warps} "
                f"stages={self.num_stages}" + (" one-token loop" if self.mv else "")
                + (f" u_split={self.u_split}" if self.u_split else ""))


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


# ---------------------------------------------------------------------------- the table's schema
@dataclass(frozen=True)
class Entry:
    """A table entry (a JSON object of these fields): BM tokens by BN outputs, BK inputs a step,
    num_warps, num_stages; split-K until about ``programs`` programs run (0: none); the fused EC's
    u programs at most ``u_split`` (0: the policy's u_split_max)."""
    BM: int = 0
    BN: int = 0
    BK: int = 0
    num_warps: int = 0
    num_stages: int = 0
    programs: int = 0
    u_split: int = 0


_POW2 = ("BM", "BN", "BK", "num_warps")


def _fragment_entry(where: str, e: Entry) -> None:
    if e.BK not in (64, 128) or e.BN % 16 or e.BM < 16:
        raise ValueError(f"{where}: the fragment GEMM takes BK 64 or 128, BN a multiple of 16 and BM >= 16; got "
                         f"BK={e.BK}, BN={e.BN}, BM={e.BM}")


def _gluon_entry(where: str, e: Entry) -> None:
    try:
        GluonConfig(e.BN // 2, e.BM, e.BK, e.num_stages)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if e.BN % 2:
        raise ValueError(f"{where}: BN must be 128 or 256")


@dataclass(frozen=True)
class Family:
    """The launches of one kernel: its token classes, the fields an entry must and may hold, and
    the constraint of the kernel an entry must meet."""
    classes: tuple[str, ...]
    required: tuple[str, ...]
    optional: tuple[str, ...]
    check: object = None  # (where, Entry) -> None, raising ValueError

    @property
    def fields(self) -> tuple[str, ...]:
        return self.required + self.optional


FRAGMENT_CLASSES = ("16", "32", "64", "128", "256", "big")
NMAJOR_CLASSES = ("1", "16", "32", "64", "big")
GLUON_CLASSES = ("16", "32", "64", "128", "256", "512", "1024", "big")
_TRITON = ("BM", "BN", "BK", "num_warps", "num_stages"), ("programs", "u_split")
_GLUON = ("BN", "BM", "BK", "num_stages"), ("programs",)
FAMILIES = MappingProxyType({
    "fragment": Family(FRAGMENT_CLASSES, *_TRITON, _fragment_entry),
    "nmajor": Family(NMAJOR_CLASSES, *_TRITON),
    "gluon": Family(GLUON_CLASSES, *_GLUON, _gluon_entry),
    "gluon_wide": Family(GLUON_CLASSES, *_GLUON, _gluon_entry),
    "gluon_deep": Family(GLUON_CLASSES, *_GLUON, _gluon_entry),
})
# Layers of at least GLUON_WIDE_N output features (Llama's gate/up) take the "gluon_wide" classes (BM
# 256 against 128 at 129-256 tokens), the others of at least GLUON_DEEP_K input features (Llama's down)
# "gluon_deep" (BM 128 from 65 tokens, and the Gluon GEMM at 129-256 where q/o keep the Triton GEMM),
# the rest "gluon". A table without one of the first two sends its layers to "gluon".
GLUON_WIDE_N = 16384
GLUON_DEEP_K = 8192


def gluon_family(n: int, k: int, table=None) -> str:
    """The Gluon family of an (n, k) layer: "gluon_wide", "gluon_deep" or "gluon" (above); with
    ``table``, "gluon" where the table lacks the layer's own family."""
    family = "gluon_wide" if n >= GLUON_WIDE_N else "gluon_deep" if k >= GLUON_DEEP_K else "gluon"
    return family if table is None or table.get(family) is not None else "gluon"


def _entry(where: str, family: Family, e) -> Entry:
    if not isinstance(e, (dict, MappingProxyType)):
        raise ValueError(f"{where}: a launch entry must be an object, got {type(e).__name__}")
    unknown = set(e) - set(family.fields)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; expected some of {', '.join(family.fields)}")
    for key, v in e.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}.{key} must be a positive integer, got {v!r}")
        if key in _POW2 and v & (v - 1):
            raise ValueError(f"{where}.{key} must be a power of two, got {v}")
    missing = [f for f in family.required if f not in e]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    entry = Entry(**e)
    if family.check is not None:
        family.check(where, entry)
    return entry


def check_table(table) -> MappingProxyType:
    """A launch table (JSON-like: family -> class -> entry, all optional) validated against
    ``FAMILIES``, as a read-only mapping of ``Entry``."""
    if not isinstance(table, (dict, MappingProxyType)):
        raise ValueError(f"a launch table must be a JSON object, got {type(table).__name__}")
    out = {}
    for key, classes in table.items():
        family = FAMILIES.get(key)
        if family is None:
            raise ValueError(f"unknown launch table key {key!r}; expected some of {', '.join(FAMILIES)}")
        if not isinstance(classes, (dict, MappingProxyType)) or set(classes) - set(family.classes):
            raise ValueError(f"{key} must map token classes among {', '.join(family.classes)} to launch entries, "
                             f"got {classes!r}")
        out[key] = MappingProxyType({c: e if isinstance(e, Entry) else _entry(f"{key}.{c}", family, e)
                                     for c, e in classes.items()})
    return MappingProxyType(out)


def to_json(table) -> dict:
    """A table as the JSON object ``check_table`` reads (entries without their unset fields)."""
    return {key: {c: {f.name: getattr(e, f.name) for f in fields(e) if getattr(e, f.name)} for c, e in classes.items()}
            for key, classes in table.items()}


def read_table(table) -> MappingProxyType:
    """``table`` (a dict, or the path of a JSON file as ``spear tune-kernels`` writes it), checked."""
    if not isinstance(table, (dict, MappingProxyType)):
        from spear.errors import SpearError
        from spear.fileio import read_json

        try:
            table = read_json(Path(table), "the launch table")
        except SpearError as e:  # the policy's errors are ValueErrors
            raise ValueError(str(e)) from None
    return check_table(table)


def merged_table(table=None) -> MappingProxyType:
    """The built-in table with ``table`` (``read_table``'s input) merged over it class by class."""
    if table is None:
        return BUILTIN
    own = read_table(table)
    return MappingProxyType({key: MappingProxyType({**BUILTIN.get(key, {}), **own.get(key, {})})
                             for key in dict.fromkeys([*BUILTIN, *own])})


# Launch shapes by token class, each the best of a sweep for its class. "fragment": `spear
# tune-kernels` on Llama-3-8B's shapes, H200, 2026-12-04 (BENCHMARKS.md, "Kernels: the W4A16 GEMM
# from 1 to 4,096 tokens"). "nmajor": bench_kernels.py --tune (N-major packing), H200: one token on
# CUDA cores; 17-64 tokens with half the programs of 2-16, because at 64 tokens every split writes
# an M x N fp32 partial. "gluon", "gluon_wide", "gluon_deep": `spear tune-kernels --kernel gluon` on
# Llama-3-8B's three shapes, H100, 2026-12-06 (BENCHMARKS.md, "The warp-specialized Gluon GEMM", raw
# run21-h100-2026-12-06/tune/gluon_rows.json): per family, the classes where one launch beat the
# path without it by 5% or more (geometric mean over the token counts). q/o: 128 by 24%, 512 by 17%,
# 1024 by 14%; gate_up: 128 by 22%, 256 by 23%, 512 by 23%, 1024 by 14%; down: 128 by 22%, 256 by
# 11%, 512 by 24%, 1024 by 14%. At 16-64 tokens the Triton GEMM stays within 3% either side (8-15%
# ahead for q/o at 16 and 64), above 1024 dequantize + cuBLAS wins by 2-3%.
BUILTIN = check_table({
    "fragment": {"16": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
                 "32": dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
                 "64": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=132),
                 "128": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=528),
                 "256": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=264),
                 "big": dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3)},
    "nmajor": {"1": dict(BM=16, BN=64, BK=128, num_warps=2, num_stages=2, programs=1024),
               "16": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, programs=512),
               "32": dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3, programs=256),
               "64": dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, programs=256),
               "big": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)},
    "gluon": {"128": dict(BN=128, BM=64, BK=128, num_stages=6),
              "512": dict(BN=128, BM=128, BK=128, num_stages=4),
              "1024": dict(BN=128, BM=256, BK=128, num_stages=2)},
    "gluon_wide": {"128": dict(BN=256, BM=128, BK=128, num_stages=3),
                   "256": dict(BN=128, BM=256, BK=128, num_stages=2),
                   "512": dict(BN=128, BM=128, BK=128, num_stages=4),
                   "1024": dict(BN=128, BM=256, BK=64, num_stages=5)},
    "gluon_deep": {"128": dict(BN=128, BM=128, BK=128, num_stages=4),
                   "256": dict(BN=128, BM=128, BK=128, num_stages=4),
                   "512": dict(BN=128, BM=128, BK=128, num_stages=4),
                   "1024": dict(BN=128, BM=256, BK=128, num_stages=2)},
})


# ---------------------------------------------------------------------------- picking a launch
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_class(m: int, classes: tuple[str, ...]) -> str:
    """The class of ``m`` tokens: the first whose bound is at least m, else "big"."""
    return next((c for c in classes if c != "big" and m <= int(c)), "big")


def _split_for(tiles: int, k: int, bk: int, programs: int) -> int:
    """Smallest power-of-two split-K giving ``programs`` programs, keeping >= 2 K steps each."""
    split = 1
    while tiles * split < programs and k // (bk * split * 2) >= 2:
        split *= 2
    return split


def pick_triton(m: int, n: int, k: int, fragment: bool, group_size: int, table=BUILTIN) -> TritonConfig:
    """The Triton GEMM's launch for an (m, n, k) product over the fragment layout (``fragment``)
    or the N-major one, under ``table`` (``merged_table``'s result)."""
    if fragment:
        e = table["fragment"][token_class(m, FRAGMENT_CLASSES)]
        # BK 128 where it divides K and no group ends inside a step (the loop's scales are per step)
        bk = e.BK if k % e.BK == 0 and (group_size == 0 or group_size >= e.BK) else 64
        mv = 0
    else:
        cls = token_class(m, NMAJOR_CLASSES)
        e = table["nmajor"][cls]
        bk = min(e.BK, group_size or k)  # one scale per step: BK divides a group
        mv = int(cls == "1")
    split = _split_for(_cdiv(m, e.BM) * _cdiv(n, e.BN), k, bk, e.programs) if e.programs else 1
    return TritonConfig(e.BM, e.BN, bk, split, e.num_warps, e.num_stages, mv=mv, u_split=e.u_split)


def split_overhead_steps(rows: int) -> float:
    """What a split unit adds to its program's path, in K steps of its tile: its partial's store and its share
    of the reduction, which grow with the tile's rows: 12 steps per 128 rows, at least 2 (the constant the
    tuner's small-token classes were measured with; at BM 64, 6 steps, no plan of the built-in table at
    65-128 tokens changes). The Gluon GEMM's BM 128 units took 12-13 steps more than
    their K range (q/o and down at 300 tokens split 4: 58.2 / 110.3 us against 30.8 / 100.3 us unsplit at
    512; down at 256 split 2: 60.8 us; H100, 2026-12-07, benchmarks/data/run30-h100-2026-12-07/kernels)."""
    return max(2.0, 12.0 * rows / 128)


def pick_split(tiles: int, steps: int, programs: int, rows: int = 16, min_steps: int = 2) -> int:
    """The K split of ``tiles`` output tiles of ``rows`` tokens and ``steps`` K steps each over a persistent
    grid of ``programs`` programs: the one with the shortest critical path, ceil(tiles x split / programs)
    units a program of ceil(steps / split) steps each, plus :func:`split_overhead_steps` a unit when split
    (the smallest such split), among the splits whose ranges are all at least ``min_steps`` steps long (or
    the whole K) and none empty."""
    overhead = split_overhead_steps(rows)
    best, best_cost = 1, -(-tiles // programs) * steps
    for s in range(2, 65):
        per = -(-steps // s)
        if per < min_steps:
            break
        if (s - 1) * per >= steps:  # the last split would be empty
            continue
        cost = -(-(tiles * s) // programs) * (per + overhead)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


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
    """The Gluon launch of an (m, n, k) GEMM over the fragment layout under ``table`` (the classes of
    its ``gluon_family``), with the compensator of ``rank`` in its
    epilogue (0: none), or None when the table keeps ``m`` tokens of such a layer off the Gluon
    kernel or its tile leaves no room for two stages beside the compensator."""
    classes = table.get(gluon_family(n, k, table))
    e = (classes or {}).get(token_class(m, GLUON_CLASSES))
    if e is None:
        return None
    tiles = _cdiv(m, e.BM) * _cdiv(n, e.BN)
    split = pick_split(tiles, _cdiv(k, e.BK), e.programs or GLUON_PROGRAMS, e.BM)
    return fit_gluon(GluonConfig(e.BN // 2, e.BM, e.BK, e.num_stages, split), group_size, rank)
