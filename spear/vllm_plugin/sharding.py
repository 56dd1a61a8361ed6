"""Where a spear checkpoint's per-module tensors land in one tensor-parallel rank's share of a
vLLM linear layer: pure functions on tensors, no vLLM import (the plugin's glue feeds them the
layer's facts).

vLLM runs q/k/v and gate/up as one merged layer each; its *members* are spear modules, and each
rank holds a slice of the merged layer:

  column-parallel (q/k/v, gate/up; also a replicated layer, with one rank): every member's
      output rows are split across ranks, the input is whole.
        qweight, scales, zeros, B      this rank's rows of the member
        A, alpha, gate, u_scale        whole: u = A·x is complete on every rank
  row-parallel (o_proj, down_proj): the input columns are split, the output is whole and vLLM
      all-reduces it.
        qweight, A                     this rank's input columns
        scales, zeros                  this rank's groups (per-channel: whole)
        B, alpha, gate, u_scale        whole
      Ungated, B·(A_t·x_t) is linear in x_t, so the ranks' partial sums add up in vLLM's own
      all-reduce of the output. Gated, γ is not linear: u = Σ_t A_t·x_t is all-reduced first
      (one extra collective of tokens × rank values per layer, :attr:`Partition.reduces_u`),
      and only rank 0 adds α·B·(γ(u) ⊙ u) (:attr:`Partition.adds_ec`).

The members' compensator tensors load side by side, each into its own segment of one flat
parameter per name (``Partition.ec_shape``); ``merged_layer`` reads each member's back as its
runtime factors and merges them with spear's one merge (``merge_factors``,
spear/serve/model/layers/quant_method.py): A stacks the members' ranks, B and the gate MLPs are
block-diagonal, a member without an EC leaves zero blocks and an ungated member's ranks get γ = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spear.compensate.spec import ECFactors
from spear.errors import SpearError
from spear.quant.primitives import unpack_codes

# Checkpoint tensor suffix of each parameter of the merged layer ("<module>.<suffix>").
SUFFIXES = {
    "qweight": "qweight", "scales": "scales", "zeros": "zeros",
    "ec_A": "compensator.A", "ec_B": "compensator.B", "ec_alpha": "compensator.alpha",
    "ec_w1": "compensator.w1", "ec_b1": "compensator.b1", "ec_w2": "compensator.w2",
    "ec_b2": "compensator.b2", "ec_u_scale": "compensator.u_scale",
}
_EC_KINDS = ("lowrank", "spear-ec")
_GATE = ("ec_w1", "ec_b1", "ec_w2", "ec_b2", "ec_u_scale")
BITS = 4  # the kernels' width; 4-bit codes are two per byte, so input splits stay byte-aligned


@dataclass(frozen=True)
class Member:
    """One spear module as ``spear_config.json`` records it."""

    name: str
    in_features: int
    out_features: int
    group_size: int
    symmetric: bool
    bias: bool
    kind: str | None = None   # compensator kind, None without one
    rank: int = 0
    hidden: int = 0           # gate MLP width; 0 when ungated
    per_rank: bool = True     # False: one γ per token for the whole module (w2 (1, h), b2 (1,))
    bound: float = 1.0

    @classmethod
    def from_entry(cls, name: str, entry: dict) -> "Member":
        if entry.get("bits") != BITS:
            raise SpearError(f"the vLLM plugin serves {BITS}-bit modules; {name} has bits={entry.get('bits')}")
        comp = entry.get("compensator")
        extra = {}
        if comp is not None:
            kind = comp.get("kind")
            if kind not in _EC_KINDS:
                raise SpearError(f"the vLLM plugin runs compensators of kinds {_EC_KINDS}; {name} has {kind!r}")
            gated = bool(comp.get("gated", False))
            extra = dict(kind=kind, rank=int(comp["rank"]), hidden=int(comp.get("hidden", 0)) if gated else 0,
                         per_rank=bool(comp.get("per_rank", True)), bound=float(comp.get("bound", 1.0)))
        return cls(name, int(entry["in_features"]), int(entry["out_features"]), int(entry["group_size"]),
                   bool(entry["symmetric"]), bool(entry.get("bias", False)), **extra)

    @property
    def gated(self) -> bool:
        return self.hidden > 0

    def params(self) -> tuple[str, ...]:
        """The merged layer's parameters this member's checkpoint tensors load into."""
        names = ["qweight", "scales"] + ([] if self.symmetric else ["zeros"])
        if self.kind is not None:
            names += ["ec_A", "ec_B"] + (["ec_alpha"] if self.kind == "spear-ec" else [])
            names += list(_GATE) if self.gated else []
        return tuple(names)

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        """The shape of the member's whole tensor in the checkpoint."""
        n, k, r, h = self.out_features, self.in_features, self.rank, self.hidden
        g = 1 if self.group_size == 0 else k // self.group_size
        gr = r if self.per_rank else 1
        return {"qweight": (n, k * BITS // 8), "scales": (n, g), "zeros": (n, g), "ec_A": (r, k), "ec_B": (n, r),
                "ec_alpha": (), "ec_w1": (h, r), "ec_b1": (h,), "ec_w2": (gr, h), "ec_b2": (gr,),
                "ec_u_scale": (r,)}[param]


@dataclass(frozen=True)
class Partition:
    """One rank's share of a (possibly merged) linear layer."""

    members: tuple[Member, ...]
    rows: tuple[int, ...]        # output rows of each member on this rank
    row_starts: tuple[int, ...]  # the first checkpoint row of each member's share
    cols: int                    # input columns on this rank
    col_start: int               # the first checkpoint column of this rank's share
    row_parallel: bool
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        m0 = self.members[0]
        for m in self.members[1:]:
            if (m.in_features, m.group_size, m.symmetric) != (m0.in_features, m0.group_size, m0.symmetric):
                raise SpearError(f"merged modules {m0.name} and {m.name} differ in in_features, group size or "
                                 "symmetry; vLLM runs them as one layer, so they must agree")
        bounds = {m.bound for m in self.members if m.gated}
        if len(bounds) > 1:
            raise SpearError(f"merged modules {', '.join(m.name for m in self.members)} have gated compensators "
                             f"with different bounds {sorted(bounds)}; the merged gate takes one")
        for m, rows, start in zip(self.members, self.rows, self.row_starts):
            if rows < 1 or start < 0 or start + rows > m.out_features:
                raise SpearError(f"{m.name}: rows {start}..{start + rows} of this rank do not fit its "
                                 f"out_features={m.out_features}")
        if self.col_start < 0 or self.col_start + self.cols > m0.in_features:
            raise SpearError(f"{m0.name}: input columns {self.col_start}..{self.col_start + self.cols} do not fit "
                             f"in_features={m0.in_features}")
        if self.cols * BITS % 8 or self.col_start * BITS % 8:
            raise SpearError(f"{m0.name}: a rank's input columns must start and end on a byte of packed "
                             f"{BITS}-bit codes; got columns {self.col_start}..{self.col_start + self.cols}")
        g = m0.group_size
        if g and (self.cols % g or self.col_start % g):
            raise SpearError(f"{m0.name}: tensor parallelism splits its {m0.in_features} inputs into "
                             f"{self.cols} per rank, which is not a multiple of its group size {g}")

    # ---- merged layout
    @property
    def group_size(self) -> int:
        return self.members[0].group_size

    @property
    def symmetric(self) -> bool:
        return self.members[0].symmetric

    @property
    def out_features(self) -> int:
        return sum(self.rows)

    @property
    def n_groups(self) -> int:
        return 1 if self.group_size == 0 else self.cols // self.group_size

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return _offsets(self.rows)

    @property
    def rank(self) -> int:
        return sum(m.rank for m in self.members)

    @property
    def hidden(self) -> int:
        return sum(m.hidden for m in self.members)

    @property
    def has_ec(self) -> bool:
        return self.rank > 0

    @property
    def gated(self) -> bool:
        return self.hidden > 0

    @property
    def reduces_u(self) -> bool:
        """u = A·x must be all-reduced before γ: a gated EC on a split input."""
        return self.gated and self.row_parallel and self.tp_size > 1

    @property
    def adds_ec(self) -> bool:
        """Whether this rank adds the EC term (with u all-reduced, rank 0 alone does)."""
        return self.has_ec and (not self.reduces_u or self.tp_rank == 0)

    def ec_shape(self, param: str, member: int) -> tuple[int, ...]:
        """This rank's share of member ``member``'s compensator tensor ``param``: the checkpoint's
        shape, with A's input columns and B's output rows those of the share."""
        m = self.members[member]
        if param not in m.params():
            return (0,)
        shape = m.checkpoint_shape(param)
        if param == "ec_A":
            return (shape[0], self.cols)
        if param == "ec_B":
            return (self.rows[member], shape[1])
        return shape

    def ec_offsets(self, param: str) -> tuple[int, ...]:
        """Where each member's share of compensator tensor ``param`` starts in its flat parameter."""
        return _offsets([math.prod(self.ec_shape(param, i)) for i in range(len(self.members))] + [0])

    def param_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, float]]:
        """Name -> (shape, dtype, initial value) of every parameter of this rank's layer: the merged
        weight's, and one flat parameter per compensator tensor holding the members' shares side by
        side; a parameter exists only if a member loads it."""
        n = self.out_features
        f16 = torch.float16  # the checkpoint's storage dtype of scales and compensators
        shapes = {"qweight": ((n, self.cols * BITS // 8), torch.uint8, 0.0), "scales": ((n, self.n_groups), f16, 0.0),
                  "zeros": ((n, self.n_groups), torch.uint8, 0.0)}
        shapes.update({name: ((self.ec_offsets(name)[-1],), f16, 0.0) for name in SUFFIXES if name.startswith("ec_")})
        used = {p for m in self.members for p in m.params()}
        return {k: v for k, v in shapes.items() if k in used}

    def expected_loads(self) -> set[tuple[str, int]]:
        """(parameter, member index) of every checkpoint tensor this rank must load."""
        return {(p, i) for i, m in enumerate(self.members) for p in m.params()}


def _offsets(sizes) -> tuple[int, ...]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


def column_partition(members: tuple[Member, ...], rows: list[int], shard_ranks: list[int], tp_rank: int,
                     tp_size: int) -> Partition:
    """A column-parallel share: member i holds ``rows[i]`` rows starting at ``shard_ranks[i] * rows[i]``
    (``shard_ranks[i]`` is the rank, or for replicated kv heads the rank divided by the replicas)."""
    if len(rows) != len(members) or len(shard_ranks) != len(members):
        raise SpearError(f"a merged layer of {len(rows)} parts got {len(members)} spear modules "
                         f"({', '.join(m.name for m in members)})")
    k = members[0].in_features
    return Partition(tuple(members), tuple(rows), tuple(s * r for s, r in zip(shard_ranks, rows)), k, 0,
                     row_parallel=False, tp_rank=tp_rank, tp_size=tp_size)


def row_partition(member: Member, cols: int, tp_rank: int, tp_size: int) -> Partition:
    """A row-parallel share: ``cols`` input columns starting at ``tp_rank * cols``, every output row."""
    return Partition((member,), (member.out_features,), (0,), cols, tp_rank * cols, row_parallel=True,
                     tp_rank=tp_rank, tp_size=tp_size)


def load(p: Partition, param: str, dst: torch.Tensor, member: int, src: torch.Tensor) -> None:
    """Copy this rank's part of member ``member``'s checkpoint tensor ``src`` into parameter ``dst``."""
    m = p.members[member]
    want = m.checkpoint_shape(param)
    if param not in m.params():
        raise SpearError(f"checkpoint tensor {m.name}.{SUFFIXES[param]} is not part of its module "
                         f"(recorded as {'no compensator' if m.kind is None else m.kind})")
    if tuple(src.shape) != want:
        raise SpearError(f"checkpoint tensor {m.name}.{SUFFIXES[param]}: shape {tuple(src.shape)}, "
                         f"spear_config.json implies {want}")
    r0, nr = p.row_offsets[member], p.rows[member]
    rs = slice(p.row_starts[member], p.row_starts[member] + nr)      # this rank's checkpoint rows
    cs = slice(p.col_start, p.col_start + p.cols)
    if param == "qweight":
        bs = slice(p.col_start * BITS // 8, (p.col_start + p.cols) * BITS // 8)
        dst[r0:r0 + nr].copy_(src[rs, bs])
    elif param in ("scales", "zeros"):
        gs = slice(None) if p.group_size == 0 else slice(p.col_start // p.group_size,
                                                          (p.col_start + p.cols) // p.group_size)
        dst[r0:r0 + nr].copy_(src[rs, gs])
    elif param in SUFFIXES:  # a compensator tensor: the member's share, in its segment
        share = src[:, cs] if param == "ec_A" else (src[rs] if param == "ec_B" else src)
        start = p.ec_offsets(param)[member]
        dst[start:start + share.numel()].copy_(share.reshape(-1))
    else:
        raise SpearError(f"unknown spear parameter {param!r}")


def _member_factors(p: Partition, member: int, params: dict[str, torch.Tensor]) -> ECFactors | None:
    """Member ``member``'s compensator share as runtime factors (``spear.compensate.spec``): alpha
    folded into B, the gate's input scale into W1, a whole-module gate repeated per rank."""
    m = p.members[member]
    if m.kind is None:
        return None

    def share(name):
        start = p.ec_offsets(name)[member]
        shape = p.ec_shape(name, member)
        return params[name][start:start + math.prod(shape)].view(shape).float()

    alpha = float(share("ec_alpha")) if "ec_alpha" in m.params() else 1.0
    if not m.gated:
        return ECFactors(share("ec_A"), share("ec_B"), alpha)
    r, h = m.rank, m.hidden
    return ECFactors(share("ec_A"), share("ec_B"), alpha, share("ec_w1") * share("ec_u_scale")[None, :],
                     share("ec_b1"), share("ec_w2").expand(r, h), share("ec_b2").expand(r), bound=m.bound)


def merged_layer(p: Partition, params: dict[str, torch.Tensor]) -> dict:
    """The loaded parameters as the kernel adapter's ``prepare`` takes them: unpacked codes, zeros
    (8 everywhere when symmetric), and the members' compensators merged into one (``merge_factors``)."""
    from spear.serve.model.layers.quant_method import merge_factors

    codes = unpack_codes(params["qweight"], BITS, p.cols)
    zeros = params.get("zeros")
    if zeros is None:
        zeros = torch.full(params["scales"].shape, 2 ** (BITS - 1), dtype=torch.uint8, device=codes.device)
    ec = merge_factors([_member_factors(p, i, params) for i in range(len(p.members))], list(p.rows), p.cols)
    return dict(codes=codes, scales=params["scales"], zeros=zeros, group_size=p.group_size, symmetric=p.symmetric,
                ec=ec)
