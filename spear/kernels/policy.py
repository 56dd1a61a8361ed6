"""The kernel policy: every threshold and launch choice of the kernels, in one frozen object.

The serving engine holds one (``EngineConfig.kernels``) and hands it to its layers, which pass
it to the ops: nothing the kernels decide is read from a module-level setting, so two engines in
one process may run different policies, and a benchmark variant is another policy object.

``plan(tokens, n, k, group_size, layout, rank, policy)`` answers which path a W4 layer call
takes and with which launch. The registered op ``spear::w4a16_ec`` receives the same policy
flattened to integers (``KernelPolicy.op_args``) and plans inside, so torch.compile and CUDA
graphs see one opaque op whatever the token count.

Paths of a W4 layer (CUDA; everywhere else the fp32 torch reference of reference.py runs):

  gemm            the Triton W4 GEMM (split-K at decode)                no EC, M < dequant_mm_min_m
                                                                         (fragment layout: M < mma_cublas_min_m)
  dequant_cublas  dequantize the weight, then cuBLAS                     no EC, M >= that threshold
  gluon           the warp-specialized Gluon GEMM (gluon_w4.py)          no EC, fragment layout on Hopper,
                                                                         M in a class of the table's "gluon"
                                                                         ("gluon_wide" for N >= GLUON_WIDE_N)
  fused_ec        the GEMM with u = A x, the gate and alpha B v fused    EC, M <= fused_max_m
  semi_fused_ec   ec_gate beside the W4 part (one of the two above       EC, M > fused_max_m
                  by M), then ec_up adds alpha v Bᵀ
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import MappingProxyType

from spear.kernels.launch import (BUILTIN, GLUON_CLASSES, MMA_CLASSES, GluonConfig, _frozen, _thaw, check_table,
                                  merged_table, pick_config, pick_gluon)
from spear.kernels.layout import LAYOUTS

PATHS = ("reference", "gemm", "dequant_cublas", "gluon", "fused_ec", "semi_fused_ec")
PDL_MODES = ("off", "wait", "auto")


@dataclass(frozen=True)
class KernelPolicy:
    """What the kernels do, validated at construction. Defaults: the choices timed fastest on one
    H200 (BENCHMARKS.md says where each was measured)."""

    fused_max_m: int = 64            # the EC fused into the W4 GEMM up to here, semi-fused above
    dequant_mm_min_m: int = 128      # from here the W4 part is dequantize + cuBLAS (0.36-0.52x the GEMM's time)
    # the same threshold for the fragment layout's tensor-core GEMM (_mma.py; 0: never cuBLAS). At
    # 256 tokens the GEMM ties or beats dequantize + cuBLAS on Llama-3-8B's shapes, at 512 it loses
    # by 1.1-1.8x (H200, 2026-12-04, bench_kernels.py: BENCHMARKS.md)
    mma_cublas_min_m: int = 257
    # the packed layout W4 layers take where their shape allows it (layout.layout_for): "mma", the
    # fragment layout of the tensor-core GEMM; "kmajor"; "nmajor"
    w4_layout: str = "mma"
    semi_fused_overlap: bool = True  # ec_gate on a side stream beside the W4 part (else before it)
    u_split_max: int = 32            # fused EC: u = A x programs per m-tile at most
    gate_programs: int = 264         # ec_gate splits K until about this many programs run
    attention_target_programs: int = 256  # decode attention splits the context until this many programs
    attention_max_splits: int = 32
    attention_min_split_tiles: int = 1    # key tiles per split at the least
    rope_in_attention: bool = True   # decode: the attention kernel rotates q and writes the new k, v
    # programmatic dependent launch of the decode kernels (Hopper or newer): "wait" lets a kernel
    # load its weights while the one before it finishes; "auto" uses it on decode graphs of up
    # to pdl_auto_max_batch sequences (faster there, slower at 64 sequences with ECs)
    pdl: str = "auto"
    pdl_auto_max_batch: int = 32
    # the warp-specialized Gluon GEMM for the token classes the launch table gives it, where the GPU
    # is a Hopper and Triton has Gluon (elsewhere the Triton kernels run whatever this says)
    gluon: bool = True
    # launch shapes of the W4 GEMM: a table (dict or JSON path) merged over the built-in one
    launch_table: object = field(default_factory=lambda: BUILTIN, compare=False)
    # the policy as the op's integers (table included): what equality and hashing compare
    _op_args: tuple = field(init=False, repr=False, compare=True, default=())

    def __post_init__(self):
        ints = ("fused_max_m", "dequant_mm_min_m", "mma_cublas_min_m", "u_split_max", "gate_programs", "attention_target_programs",
                "attention_max_splits", "attention_min_split_tiles", "pdl_auto_max_batch")
        for name in ints:
            v = getattr(self, name)
            low = 0 if name in ("fused_max_m", "mma_cublas_min_m") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"KernelPolicy.{name} must be a whole number >= {low}, got {v!r}")
        for name in ("semi_fused_overlap", "rope_in_attention", "gluon"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelPolicy.{name} must be True or False, got {getattr(self, name)!r}")
        if self.w4_layout not in LAYOUTS:
            raise ValueError(f"KernelPolicy.w4_layout must be one of {', '.join(LAYOUTS)}, got {self.w4_layout!r}")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"KernelPolicy.pdl must be one of {', '.join(PDL_MODES)}, got {self.pdl!r}")
        if self.fused_max_m > 64:
            raise ValueError(f"KernelPolicy.fused_max_m is at most 64 (the fused kernel's tiles), got "
                             f"{self.fused_max_m}")
        table = self.launch_table
        if table is not BUILTIN:
            object.__setattr__(self, "launch_table", merged_table(table))
        object.__setattr__(self, "_op_args", _encode(self))
        object.__setattr__(self, "_settings", None)

    def replace(self, **changes) -> "KernelPolicy":
        return replace(self, **changes)

    def __reduce__(self):
        # the launch table is read-only (MappingProxyType), which pickle cannot take: a plain copy of
        # it rebuilds the same policy (tensor-parallel ranks receive the engine's policy this way)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if self.launch_table is not BUILTIN:
            fields["launch_table"] = _thaw(self.launch_table)
        else:
            del fields["launch_table"]
        return (_rebuild, (fields,))

    @property
    def op_args(self) -> tuple[int, ...]:
        """This policy as the integer list the registered op takes."""
        return self._op_args

    @property
    def settings(self) -> "_Settings":
        """What the op reads of this policy, decoded once."""
        if self._settings is None:
            object.__setattr__(self, "_settings", _settings(self._op_args))
        return self._settings

    def pdl_level(self, decode_batch: int | None, available: bool) -> int:
        """The PDL level (0 or 1) of a step: ``decode_batch`` sequences of a decode graph, None for
        eager steps; ``available``: the GPU and Triton have programmatic dependent launch."""
        if not available or self.pdl == "off":
            return 0
        if self.pdl == "wait":
            return 1
        return int(decode_batch is not None and decode_batch <= self.pdl_auto_max_batch)


def _rebuild(fields: dict) -> KernelPolicy:
    return KernelPolicy(**fields)


@dataclass(frozen=True)
class Plan:
    path: str                   # one of PATHS
    # the W4 part's launch: a Config (the Triton GEMM), a GluonConfig (the Gluon GEMM) or None
    # (dequantize + cuBLAS); for semi_fused_ec, the W4 part beside the compensator's kernels
    config: object | None

    @property
    def w4(self) -> str:
        """Which kernel computes the W4 product: "triton", "gluon", "cublas" or "reference"."""
        if self.path == "reference":
            return "reference"
        if isinstance(self.config, GluonConfig):
            return "gluon"
        return "cublas" if self.config is None else "triton"

    def __str__(self) -> str:
        return f"{self.path} ({self.w4}{': ' + str(self.config) if self.config is not None else ''})"


def plan(tokens: int, n: int, k: int, group_size: int, layout: str, rank: int, policy: KernelPolicy,
         cuda: bool = True, gluon: bool = False) -> Plan:
    """Which path a W4 layer call of ``tokens`` rows over a weight of ``layout`` (layout.LAYOUTS)
    takes under ``policy`` (module docstring); ``rank`` 0 means no compensator. ``gluon``: the
    device runs the Gluon GEMM (a Hopper GPU, a Triton with Gluon: ``gluon_w4.available``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return _plan(tokens, n, k, group_size, layout, rank, _settings(policy.op_args), cuda, gluon)


@lru_cache(maxsize=4096)
def _plan(tokens, n, k, group_size, layout, rank, s: "_Settings", cuda: bool, gluon: bool = False) -> Plan:
    if not cuda:
        return Plan("reference", None)
    cublas_from = s.mma_cublas_min_m if layout == "mma" else s.dequant_mm_min_m
    g = pick_gluon(tokens, n, k, s.table, group_size, rank) if gluon and s.gluon and layout == "mma" else None
    if g is not None:
        config, w4 = g, "gluon"
    elif not cublas_from or tokens < cublas_from:
        config, w4 = pick_config(tokens, n, k, group_size, layout, s.table), "gemm"
    else:
        config, w4 = None, "dequant_cublas"
    if rank == 0:
        return Plan(w4, config)
    if tokens <= s.fused_max_m:  # the Triton GEMM's fused compensator, whatever the W4 part would be
        return Plan("fused_ec", pick_config(tokens, n, k, group_size, layout, s.table))
    return Plan("semi_fused_ec", config)


# ---------------------------------------------------------------------------- the op's integers
# The launch table flattened: its scalar keys, then each entry as a presence flag and its fields.
_SCALARS = ("fma_max_m", "fma_kmajor_max_m", "fma_mma_max_m")
_ENTRIES = (("fma", "fma_kmajor", "fma_kmajor_by_mv.2", "fma_kmajor_by_mv.4", "fma_kmajor_narrow", "tc", "tc_wide",
             "prefill") + tuple(f"mma.{c}" for c in MMA_CLASSES)
            + ("fma_mma", "fma_mma_by_mv.2", "fma_mma_by_mv.4", "fma_mma_narrow")
            + tuple(f"gluon.{c}" for c in GLUON_CLASSES) + tuple(f"gluon_wide.{c}" for c in GLUON_CLASSES))
_FIELDS = ("BM", "BN", "BK", "num_warps", "num_stages", "programs", "max_n", "u_split", "prefetch")
_VERSION = 5


def _entry(table, key):
    if "." in key:
        outer, inner = key.split(".")
        return (table.get(outer) or {}).get(inner)
    return table.get(key)


def _encode(p: KernelPolicy) -> tuple[int, ...]:
    out = [_VERSION, p.fused_max_m, p.dequant_mm_min_m, int(p.semi_fused_overlap), p.u_split_max, p.gate_programs,
           p.mma_cublas_min_m, int(p.gluon)]
    table = p.launch_table
    out += [int(table[key]) for key in _SCALARS]
    for key in _ENTRIES:
        e = _entry(table, key)
        out.append(0 if e is None else 1)
        out += [0 if e is None else int(e.get(f, 0)) for f in _FIELDS]
    return tuple(out)


@dataclass(frozen=True, eq=False)
class _Settings:
    """The op's view of a policy (from its integers); hashed by them, so plans can be cached."""
    key: tuple
    fused_max_m: int
    dequant_mm_min_m: int
    mma_cublas_min_m: int
    semi_fused_overlap: bool
    u_split_max: int
    gate_programs: int
    gluon: bool
    table: MappingProxyType

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Settings) and self.key == other.key


@lru_cache(maxsize=64)
def _settings(args: tuple[int, ...]) -> _Settings:
    """``op_args`` back into what the op reads (cached: a policy's integers are decoded once)."""
    if not args or args[0] != _VERSION:
        raise ValueError(f"op policy arguments of an unknown version: {args[:1]}")
    head, rest = args[1:8], list(args[8:])
    table: dict = {key: rest.pop(0) for key in _SCALARS}
    table["fma_kmajor_by_mv"] = {}
    table["fma_mma_by_mv"] = {}
    table["mma"] = {}
    table["gluon"] = {}
    table["gluon_wide"] = {}
    for key in _ENTRIES:
        present, values = rest[0], rest[1:1 + len(_FIELDS)]
        del rest[:1 + len(_FIELDS)]
        e = None
        if present:
            e = {f: v for f, v in zip(_FIELDS, values) if v and f != "prefetch"}
            if values[_FIELDS.index("prefetch")]:
                e["prefetch"] = True
        if "." in key:
            outer, inner = key.split(".")
            if e is not None:
                table[outer][inner] = e
        else:
            table[key] = e
    return _Settings(args, head[0], head[1], head[5], bool(head[2]), head[3], head[4], bool(head[6]),
                     _frozen(check_table(table)))


def settings(args) -> _Settings:
    return _settings(tuple(int(a) for a in args))


def describe(policy: KernelPolicy, n: int, k: int, group_size: int, layout: str, rank: int = 0, gluon: bool = False,
             tokens=(1, 2, 4, 16, 32, 64, 96, 128, 256, 512, 1024, 4096)) -> str:
    """One line per run of token counts that share a path: which kernel a W4 layer (n, k) takes
    under ``policy`` (``plan``), e.g. for the engine's log and ``spear tune-kernels``."""
    lines, start, last = [], None, None
    for t in tokens:
        p = plan(t, n, k, group_size, layout, rank, policy, gluon=gluon)
        d = f"{p.path} ({p.w4})"
        if last is not None and d != last[1]:
            lines.append(f"{start}-{last[0]} tokens: {last[1]}" if start != last[0] else f"{start} tokens: {last[1]}")
            start = t
        elif last is None:
            start = t
        last = (t, d)
    if last is not None:
        lines.append(f"{start}-{last[0]} tokens: {last[1]}" if start != last[0] else f"{start} tokens: {last[1]}")
    return "; ".join(lines)
