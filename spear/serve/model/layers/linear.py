"""The engine's linear layers: each owns its weight in the form it runs, and its compensator.

A layer stands for one or more of the checkpoint's linears that read the same input, side by
side along the output features ("members"): q/k/v as one layer, gate/up as one layer. The
loader hands each member's tensors to ``load(member, weights)``; ``finalize`` then builds what
runs, once, on the layer's device:

  "w4"     CUDA, every member 4-bit with the kernel's shape rules met: the members' codes packed
           side by side (``PackedW4``; gate/up with their output features interleaved, so the
           GEMM's epilogue applies SiLU·mul), their compensators merged into one (A stacked, B and
           the gate MLPs block-diagonal: exactly the members' ECs); forward is one
           ``w4a16_linear`` call under the engine's kernel policy.
  "w8"     CUDA, an 8-bit per-channel symmetric layer without compensator (an 8-bit output head).
  "dense"  everything else: the CPU, unquantized checkpoints, W2/W3 and group sizes the kernels
           do not take, a compensator beyond the kernels' limits. The weight is dequantized once
           and rounded to the compute dtype (as QuantLinear does), the compensator runs in torch.
           A quantized layer that runs dense on CUDA is listed in the load report with the reason.

Tensor parallelism (spear/parallel): ``split="column"`` keeps this rank's share of every
member's output features (q/k/v heads, gate/up features, the head's vocabulary), ``split="row"``
its share of the input features (o, down); ``load`` cuts each member's tensors as they arrive
(spear/parallel/shard.py) and ``finalize`` builds the runtime form of the share. A row-parallel
layer's forward computes its partial output (and, for a gated compensator, its partial u = A x)
and hands them to the rank's collectives (``comm.reduce``), which sum them and then add the bias
and alpha · B (gamma(u) ⊙ u); an ungated compensator is linear and runs inside the partials. With
one rank both splits are the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spear.compensate.spec import ECFactors
from spear.errors import SpearError
from spear.kernels.policy import KernelPolicy
from spear.parallel.shard import TPRank, column_share, row_share

_KERNEL_GROUPS = (0, 32, 64, 128, 256)


@dataclass
class QuantTensors:
    """A member's quantized weight in spear's layout (spear.quant.primitives)."""

    codes: torch.Tensor   # (out, in) uint8
    scales: torch.Tensor  # (out, groups) fp16
    zeros: torch.Tensor   # (out, groups) uint8
    bits: int
    group_size: int
    symmetric: bool

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        from spear.quant.primitives import dequantize

        return dequantize(self.codes, self.scales, self.zeros, self.group_size, dtype)


@dataclass
class MemberWeights:
    """What the checkpoint holds for one member: a dense weight or a quantized one, a bias, an EC."""

    name: str                                 # the checkpoint's module name, for messages
    weight: torch.Tensor | None = None        # (out, in), dense checkpoints
    quant: QuantTensors | None = None
    bias: torch.Tensor | None = None
    ec: ECFactors | None = None


@dataclass
class Context:
    """What a forward needs beyond its inputs: the kernel policy and this step's PDL level."""

    policy: KernelPolicy
    pdl: int = 0


def w4_reason(q: QuantTensors | None, in_features: int) -> str | None:
    """Why the W4 kernel cannot take this member (None when it can)."""
    if q is None:
        return "not quantized"
    if q.bits != 4:
        return f"{q.bits}-bit (the kernel takes 4-bit codes)"
    if in_features % 32:
        return f"in_features {in_features} is not a multiple of 32"
    if q.group_size not in _KERNEL_GROUPS or (q.group_size and in_features % q.group_size):
        return f"group size {q.group_size} (the kernel takes 0, 32, 64, 128, 256)"
    return None


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Two equal halves of ``t`` along ``dim`` >= 0 (member 0, member 1) with their entries alternating."""
    a, b = t.chunk(2, dim=dim)
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def merge_factors(ecs: list[ECFactors | None], outs: list[int], in_features: int) -> ECFactors | None:
    """One compensator equal to the members' side by side: A stacked, alpha · B and the gate MLPs
    block-diagonal (zero blocks add exact zeros); None if no member has one. Gated members'
    bounds must agree (one scalar of the kernel)."""
    if all(e is None for e in ecs):
        return None
    ranks = [0 if e is None else e.rank for e in ecs]
    hidden = [0 if e is None else e.hidden for e in ecs]
    bounds = {e.bound for e in ecs if e is not None and e.gated}
    if len(bounds) > 1:
        raise SpearError(f"the merged members' gates have different bounds {sorted(bounds)}")
    r, h = sum(ranks), sum(hidden)
    a, b = torch.zeros(r, in_features), torch.zeros(sum(outs), r)
    gated = h > 0
    w1, b1, w2, b2 = torch.zeros(h, r), torch.zeros(h), torch.zeros(r, h), torch.zeros(r)
    ro = ho = no = 0
    for e, ri, hi, n in zip(ecs, ranks, hidden, outs):
        if e is not None:
            a[ro:ro + ri] = e.a
            b[no:no + n, ro:ro + ri] = e.alpha * e.b
            if hi:
                w1[ho:ho + hi, ro:ro + ri] = e.w1
                b1[ho:ho + hi] = e.b1
                w2[ro:ro + ri, ho:ho + hi] = e.w2
                b2[ro:ro + ri] = e.b2
        ro, ho, no = ro + ri, ho + hi, no + n
    if not gated:
        return ECFactors(a, b)
    return ECFactors(a, b, 1.0, w1, b1, w2, b2, bound=bounds.pop())


class Linear(nn.Module):
    """Members side by side along the output features; ``forward(x, ctx)`` -> (..., sum(outs)).

    ``interleave`` (two members of equal width, e.g. gate/up): where the W4 kernel runs, the output
    features alternate between them and ``silu_mul`` is the GEMM's epilogue."""

    def __init__(self, in_features: int, outs: list[int], names: list[str], bias: bool = False,
                 interleave: bool = False, split: str | None = None, tp: TPRank = TPRank(), gather: bool = False):
        super().__init__()
        if len(outs) != len(names) or not outs:
            raise ValueError("a linear layer needs one name per member")
        if interleave and (len(outs) != 2 or outs[0] != outs[1]):
            raise ValueError("interleaving needs two members of equal width")
        if split not in (None, "column", "row"):
            raise ValueError(f"split must be None, 'column' or 'row', got {split!r}")
        # the checkpoint's (whole) shapes, and this rank's share of them
        self.full_in, self.full_outs = in_features, list(outs)
        self.tp, self.split = tp, (split if tp.size > 1 else None)
        self.gather = gather and self.split == "column"  # concatenate the ranks' outputs (the head)
        if self.split == "column":
            outs = [_share_len(tp, o, f"{name}'s output features") for o, name in zip(outs, names)]
        elif self.split == "row":
            in_features = _share_len(tp, in_features, f"{names[0]}'s input features")
        self.comm = None                  # the rank's collectives (spear.parallel.comm), set by the model
        self.post = None                  # row-parallel: what follows the sum (RowPost), from finalize
        self.in_features, self.outs, self.names = in_features, list(outs), list(names)
        self.out_features = sum(outs)
        self.has_bias, self.interleave = bias, interleave
        self._members: list[MemberWeights | None] = [None] * len(outs)
        self.kind: str | None = None      # "w4" | "w8" | "dense", once finalized
        self.reason: str | None = None    # why a quantized layer runs dense
        self.interleaved = False          # the output features alternate between the two members

    # ------------------------------------------------------------------ loading
    def load(self, member: int, w: MemberWeights) -> None:
        """Take member ``member``'s tensors (checked against the layer's shape)."""
        if self._members[member] is not None:
            raise SpearError(f"{w.name}: loaded twice")
        out, k = self.full_outs[member], self.full_in
        shape = tuple(w.weight.shape) if w.weight is not None else tuple(w.quant.codes.shape)
        if shape != (out, k):
            raise SpearError(f"{w.name}: weight of shape {shape}, the model's config expects {(out, k)}")
        if w.bias is not None and tuple(w.bias.shape) != (out,):
            raise SpearError(f"{w.name}: bias of shape {tuple(w.bias.shape)}, expected {(out,)}")
        if w.ec is not None:
            w.ec.check(k, out, w.name)
        if self.split == "column":
            w = column_share(w, self.tp.share(out))
        elif self.split == "row":
            w = row_share(w, self.tp.share(k))
        self._members[member] = w

    def missing(self) -> list[str]:
        return [n for n, m in zip(self.names, self._members) if m is None]

    def finalize(self, device: torch.device, dtype: torch.dtype, max_rank: int, kernels: bool | None = None,
                 layout: str = "mma") -> None:
        """Build the runtime form (module docstring); the members' loaded tensors are released.
        ``kernels``: take the kernels' packed forms where the members allow (default: on CUDA in
        fp16/bf16). Off CUDA the registered ops then run their torch references on the packed
        tensors, which is how CPU tests check the packing. ``layout``: the packed W4 layout to take
        where the layer's shape allows it (``KernelPolicy.w4_layout``; layout.layout_for)."""
        self._build(device, dtype, max_rank, kernels, layout)
        if self.split == "row":
            self._row_post()

    def _row_post(self) -> None:
        """Move what must follow the ranks' sum out of the local product: the bias, and a gated
        compensator's gate and B (its u = A x stays local, summed with the output)."""
        from spear.parallel.comm import RowPost

        post = RowPost(self.out_features, bias=self.bias)
        self.bias = None
        if self.kind == "w4" and self.packed_ec is not None and self.packed_ec.gated:
            post.packed, self.packed_ec = self.packed_ec, None
        elif self.kind == "dense" and self.ec is not None and self.ec.gate is not None:
            post.dense, self.ec = self.ec, None
        self.post = post

    def _build(self, device: torch.device, dtype: torch.dtype, max_rank: int, kernels: bool | None,
               layout: str = "mma") -> None:
        members = self._members
        if any(m is None for m in members):
            raise SpearError(f"{self.missing()[0]}: not in the checkpoint")
        reasons = [w4_reason(m.quant, self.in_features) for m in members]
        cuda = (device.type == "cuda" if kernels is None else kernels) and dtype in (torch.float16, torch.bfloat16)
        ec = merge_factors([m.ec for m in members], self.outs, self.in_features)
        bias = self._bias(members, dtype, device)
        quantized = any(m.quant is not None for m in members)
        if cuda and all(r is None for r in reasons):
            layouts = {(m.quant.group_size, m.quant.symmetric) for m in members}
            if len(layouts) > 1:
                reasons = ["members with different group sizes or symmetry"]
            elif ec is not None and (ec.rank > max_rank or ec.hidden > max_rank):
                reasons = [f"merged compensator rank {ec.rank} / gate width {ec.hidden} beyond the kernels' "
                           f"{max_rank}"]
            else:
                self._finalize_w4(members, ec, bias, dtype, device, layout)
                return
        if cuda and len(members) == 1 and _w8_packable(members[0]) and members[0].ec is None:
            from spear.kernels.w8a16 import pack_w8

            q = members[0].quant
            self.qweight, self.scale = (t.to(device) for t in pack_w8(q.codes, q.scales, q.zeros))
            self.bias, self.kind = bias, "w8"
            self._members = []
            return
        self.kind = "dense"
        if quantized and cuda:
            self.reason = next(r for r in reasons if r is not None)
        self.weight = torch.cat([m.quant.dequantized(dtype) if m.quant is not None else m.weight.to(dtype)
                                 for m in members]).to(device)
        self.bias = bias
        self.ec = None if ec is None else _dense_ec(ec, dtype, device)
        self._members = []

    def _bias(self, members, dtype, device) -> torch.Tensor | None:
        if all(m.bias is None for m in members):
            return None
        return torch.cat([m.bias.to(dtype) if m.bias is not None else torch.zeros(n, dtype=dtype)
                          for m, n in zip(members, self.outs)]).to(device)

    def _finalize_w4(self, members, ec: ECFactors | None, bias, dtype, device, layout: str) -> None:
        from spear.kernels.layout import layout_for, pack, pack_ec

        q0 = members[0].quant
        codes = torch.cat([m.quant.codes for m in members])
        scales = torch.cat([m.quant.scales for m in members])
        zeros = torch.cat([m.quant.zeros for m in members])
        b = None if ec is None else ec.b
        if self.interleave:
            codes, scales, zeros = _interleave(codes, 0), _interleave(scales, 0), _interleave(zeros, 0)
            b = None if b is None else _interleave(b, 0)
            bias = None if bias is None else _interleave(bias, 0)
            self.interleaved = True
        self.packed = pack(codes.to(device), scales.to(device), zeros.to(device), q0.group_size, q0.symmetric,
                           layout=layout_for(codes.shape[0], self.in_features, layout))
        self.bias = bias
        self.packed_ec = None
        if ec is not None:
            gate = dict(w1=ec.w1, b1=ec.b1, w2=ec.w2, b2=ec.b2, bound=ec.bound) if ec.gated else {}
            self.packed_ec = pack_ec(ec.a.to(device), b.to(device), ec.alpha, dtype,
                                     **{k: v.to(device) if torch.is_tensor(v) else v for k, v in gate.items()})
        self.kind = "w4"
        self._members = []

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The members' outputs side by side (de-interleaved where the kernel interleaves them); a
        row-parallel layer's summed across the ranks, a gathering column-parallel one's concatenated."""
        if self.split == "row":
            y = self._local(x, ctx)
            e = self.post.packed if self.post.packed is not None else self.post.dense
            u = None if e is None else nn.functional.linear(x, e.a)
            return self.comm.reduce(y, u, self.post)
        y = self._local(x, ctx)
        return self.comm.gather(y) if self.gather else y

    def _local(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """This rank's product (the whole layer's with one rank)."""
        if self.kind == "w4":
            from spear.kernels.ops import w4a16_linear

            y = w4a16_linear(x, self.packed, self.bias, self.packed_ec, 0, ctx.policy, ctx.pdl)
            return torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1) if self.interleaved else y
        if self.kind == "w8":
            from spear.kernels.w8a16 import w8a16_linear

            return w8a16_linear(x, self.qweight, self.scale, self.bias, ctx.pdl)
        y = nn.functional.linear(x, self.weight, self.bias)
        if self.ec is not None:
            y = y + _ec_forward(x, self.ec)
        return y

    def silu_mul(self, x: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """silu(member 0) · member 1 in the W4 GEMM's epilogue, where the layer runs interleaved on
        the kernel; None elsewhere (the caller applies the activation)."""
        if not self.interleaved:
            return None
        from spear.kernels.ops import w4a16_linear

        return w4a16_linear(x, self.packed, self.bias, self.packed_ec, 1, ctx.policy, ctx.pdl)

    def extra_repr(self) -> str:
        ec = getattr(self, "packed_ec", None) or getattr(self, "ec", None)
        return (f"in={self.in_features}, outs={self.outs}, {self.kind}"
                + (f" ({self.reason})" if self.reason else "") + (", EC" if ec is not None else "")
                + (f", {self.split}-parallel {self.tp.rank}/{self.tp.size}" if self.split else ""))


def _share_len(tp: TPRank, total: int, what: str) -> int:
    part = tp.share(total, what)
    return part.stop - part.start


def _w8_packable(m: MemberWeights) -> bool:
    from spear.kernels.w8a16 import K_STEP

    q = m.quant
    return q is not None and q.bits == 8 and q.group_size == 0 and q.symmetric and q.codes.shape[1] % K_STEP == 0


@dataclass
class _DenseEC:
    a: torch.Tensor
    b: torch.Tensor                   # alpha folded in
    gate: tuple[torch.Tensor, ...] | None
    bound: float


def _dense_ec(ec: ECFactors, dtype, device) -> _DenseEC:
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    gate = tuple(map(cast, (ec.w1, ec.b1, ec.w2, ec.b2))) if ec.gated else None
    return _DenseEC(cast(ec.a), cast(ec.alpha * ec.b), gate, ec.bound)


def _ec_forward(x: torch.Tensor, e: _DenseEC) -> torch.Tensor:
    """alpha · B (gamma(u) ⊙ u), u = A x, in x's dtype (the compensator modules' own math)."""
    u = nn.functional.linear(x, e.a)
    if e.gate is not None:
        w1, b1, w2, b2 = e.gate
        h = nn.functional.silu(nn.functional.linear(u, w1, b1))
        u = u * (1 + e.bound * torch.tanh(nn.functional.linear(h, w2, b2)))
    return nn.functional.linear(u, e.b)
