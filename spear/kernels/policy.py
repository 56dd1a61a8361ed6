"""The kernel policy: every threshold and launch choice of the kernels, in one frozen object.

The serving engine holds one (``EngineConfig.kernels``) and hands it to its layers, which pass
it to the ops: nothing the kernels decide is read from a module-level setting, so two engines in
one process may run different policies, and a benchmark variant is another policy object. Which
kernel a W4 call runs under a policy is ``planner.plan``'s answer. The registered op
``spear::w4a16_ec`` receives the policy flattened to integers (``KernelPolicy.op_args``: the
thresholds, then every entry of the launch table in the order ``launch.FAMILIES`` declares) and
reads it back with ``KernelPolicy.of_op_args``, so torch.compile and CUDA graphs see one opaque op
whatever the token count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from functools import lru_cache

from spear.kernels.launch import BUILTIN, FAMILIES, merged_table, to_json

PDL_MODES = ("off", "wait", "auto")


@dataclass(frozen=True)
class KernelPolicy:
    """What the kernels do, validated at construction. Defaults: the choices timed fastest on one
    H200 (BENCHMARKS.md says where each was measured)."""

    fused_max_m: int = 64            # the EC fused into the W4 GEMM up to here, semi-fused above
    # from here the W4 part is dequantize + cuBLAS (0: never). The fragment layout's GEMM ties or
    # beats it at 256 tokens on Llama-3-8B's shapes and loses by 1.1-1.8x at 512 (H200, 2026-12-04,
    # bench_kernels.py: BENCHMARKS.md); the N-major fallback's loses from 128 (0.36-0.52x its time)
    fragment_cublas_min_m: int = 257
    nmajor_cublas_min_m: int = 128
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
    # launch shapes of the W4 GEMMs: a table (dict or JSON path) merged over the built-in one
    launch_table: object = field(default_factory=lambda: BUILTIN, compare=False)
    # the policy as the op's integers (table included): what equality and hashing compare
    _op_args: tuple = field(init=False, repr=False, compare=True, default=())

    def __post_init__(self):
        ints = ("fused_max_m", "fragment_cublas_min_m", "nmajor_cublas_min_m", "u_split_max", "gate_programs",
                "attention_target_programs", "attention_max_splits", "attention_min_split_tiles", "pdl_auto_max_batch")
        for name in ints:
            v = getattr(self, name)
            low = 0 if name in ("fused_max_m", "fragment_cublas_min_m", "nmajor_cublas_min_m") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"KernelPolicy.{name} must be a whole number >= {low}, got {v!r}")
        for name in ("semi_fused_overlap", "rope_in_attention", "gluon"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelPolicy.{name} must be True or False, got {getattr(self, name)!r}")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"KernelPolicy.pdl must be one of {', '.join(PDL_MODES)}, got {self.pdl!r}")
        if self.fused_max_m > 64:
            raise ValueError(f"KernelPolicy.fused_max_m is at most 64 (the fused kernel's tiles), got "
                             f"{self.fused_max_m}")
        if self.launch_table is not BUILTIN:
            object.__setattr__(self, "launch_table", merged_table(self.launch_table))
        object.__setattr__(self, "_op_args", _encode(self))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                                                     if f.compare)))

    def __hash__(self) -> int:  # planned once per W4 call: hashed by value once, here
        return self._hash

    def replace(self, **changes) -> "KernelPolicy":
        return replace(self, **changes)

    def __reduce__(self):
        # the launch table is read-only (MappingProxyType), which pickle cannot take: its JSON form
        # rebuilds the same policy (tensor-parallel ranks receive the engine's policy this way)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if self.launch_table is not BUILTIN:
            fields["launch_table"] = to_json(self.launch_table)
        else:
            del fields["launch_table"]
        return (_rebuild, (fields,))

    @property
    def op_args(self) -> tuple[int, ...]:
        """This policy's thresholds and table as the integer list the registered op takes."""
        return self._op_args

    @staticmethod
    def of_op_args(args) -> "KernelPolicy":
        """The policy ``op_args`` came from, as far as the op reads it (thresholds and table)."""
        return _decode(tuple(int(a) for a in args))

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


# ---------------------------------------------------------------------------- the op's integers
# The thresholds the op reads, then per family of launch.FAMILIES and per class a presence flag and
# the entry's fields.
_HEAD = ("fused_max_m", "fragment_cublas_min_m", "nmajor_cublas_min_m", "semi_fused_overlap", "u_split_max",
         "gate_programs", "gluon")
_VERSION = 6


def _encode(p: KernelPolicy) -> tuple[int, ...]:
    out = [_VERSION] + [int(getattr(p, name)) for name in _HEAD]
    for key, family in FAMILIES.items():
        classes = p.launch_table.get(key, {})
        for cls in family.classes:
            e = classes.get(cls)
            out.append(int(e is not None))
            out += [0 if e is None else getattr(e, f) for f in family.fields]
    return tuple(out)


@lru_cache(maxsize=64)
def _decode(args: tuple[int, ...]) -> KernelPolicy:
    if not args or args[0] != _VERSION:
        raise ValueError(f"op policy arguments of an unknown version: {args[:1]}")
    head = dict(zip(_HEAD, args[1:1 + len(_HEAD)]))
    rest = iter(args[1 + len(_HEAD):])
    table: dict = {}
    for key, family in FAMILIES.items():
        table[key] = {}
        for cls in family.classes:
            present = next(rest)
            values = {f: next(rest) for f in family.fields}
            if present:
                table[key][cls] = {f: v for f, v in values.items() if v}
    for name in ("semi_fused_overlap", "gluon"):
        head[name] = bool(head[name])
    return KernelPolicy(**head, launch_table=table)
