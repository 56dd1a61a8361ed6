"""The engine's linear layers: each holds one quant-method object (quant_method.py: W4, W8 or dense)
that owns its weight in the form it runs, and splits by its parallel style as nano-vllm's do.

A layer stands for one or more of the checkpoint's linears that read the same input, side by
side along the output features ("members"): q/k/v as one layer, gate/up as one layer. The
loader hands each member's tensors to ``load(member, weights)``; ``finalize`` then picks the method
the members allow and builds it once, on the layer's device:

  W4     CUDA, every member 4-bit with the kernel's shape rules met: the members' codes side by side
         (gate/up with their output features interleaved, so the GEMM's epilogue applies SiLU·mul),
         their compensators merged into one (``merge_factors``: exactly the members' ECs);
  W8     CUDA, one 8-bit per-channel symmetric member without compensator (an 8-bit output head);
  dense  everything else: the CPU, unquantized checkpoints, W2/W3 and group sizes the kernels do
         not take, a compensator beyond the kernels' limits. A quantized layer that runs dense on
         CUDA is listed in the load report with the reason (``reason``).

Tensor parallelism (spear/parallel), by parallel style: ``ColumnParallelLinear`` keeps this rank's
share of every member's output features (q/k/v heads, gate/up features, the head's vocabulary,
which it may gather), ``RowParallelLinear`` its share of the input features (o, down); ``load``
cuts each member's tensors as they arrive (spear/parallel/shard.py). A row-parallel layer's forward
computes its partial output (and, for a gated compensator, its partial u = A x) and hands them to
the rank's collectives (``comm.reduce``), which sum them and then add the bias and
alpha · B (gamma(u) ⊙ u); an ungated compensator is linear and runs inside the partials. With one
rank a layer is a plain ``Linear`` (``parallel_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from spear.compensate.spec import ECFactors
from spear.errors import SpearError
from spear.kernels.policy import KernelPolicy
from spear.parallel.shard import TPRank, column_share, row_share
from spear.serve.model.layers.quant_method import DenseMethod, W4Method, W8Method, merge_factors

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


class Linear(nn.Module):
    """Members side by side along the output features, whole on every rank; ``forward(x, ctx)`` ->
    (..., sum(outs)).

    ``interleave`` (two members of equal width, e.g. gate/up): where the W4 kernel runs, the output
    features alternate between them and ``silu_mul`` is the GEMM's epilogue."""

    def __init__(self, in_features: int, outs: list[int], names: list[str], bias: bool = False,
                 interleave: bool = False):
        super().__init__()
        if len(outs) != len(names) or not outs:
            raise ValueError("a linear layer needs one name per member")
        if interleave and (len(outs) != 2 or outs[0] != outs[1]):
            raise ValueError("interleaving needs two members of equal width")
        # the checkpoint's (whole) shapes; a parallel layer's share of them below
        self.full_in, self.full_outs = in_features, list(outs)
        self.in_features, self.outs, self.names = in_features, list(outs), list(names)
        self.out_features = sum(outs)
        self.has_bias, self.interleave = bias, interleave
        self._members: list[MemberWeights | None] = [None] * len(outs)
        self.method = None                # W4Method | W8Method | DenseMethod, once finalized
        self.bias: torch.Tensor | None = None
        self.reason: str | None = None    # why a quantized layer runs dense
        self.interleaved = False          # the output features alternate between the two members

    # ------------------------------------------------------------------ loading
    def load(self, member: int, w: MemberWeights) -> None:
        """Take member ``member``'s tensors (checked against the layer's shape; this rank's share)."""
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
        self._members[member] = self._share(w, member)

    def _share(self, w: MemberWeights, member: int) -> MemberWeights:
        return w

    def missing(self) -> list[str]:
        return [n for n, m in zip(self.names, self._members) if m is None]

    def set_comm(self, comm) -> None:
        """The rank's collectives (spear.parallel.comm); a layer whole on every rank needs none."""

    def finalize(self, device: torch.device, dtype: torch.dtype, max_rank: int, kernels: bool | None = None) -> None:
        """Build the method the members allow (module docstring); their loaded tensors are released.
        ``kernels``: take the kernels' packed forms where the members allow (default: on CUDA in
        fp16/bf16). Off CUDA the registered ops then run their torch references on the packed
        tensors, which is how CPU tests check the packing."""
        members = self._members
        if any(m is None for m in members):
            raise SpearError(f"{self.missing()[0]}: not in the checkpoint")
        cuda = (device.type == "cuda" if kernels is None else kernels) and dtype in (torch.float16, torch.bfloat16)
        ec = merge_factors([m.ec for m in members], self.outs, self.in_features)
        bias = None
        if any(m.bias is not None for m in members):
            bias = torch.cat([m.bias.to(dtype) if m.bias is not None else torch.zeros(n, dtype=dtype)
                              for m, n in zip(members, self.outs)])
        reason = self._w4_reason(members, ec) if cuda else None
        if cuda and reason is None:
            codes, scales, zeros = (torch.cat([getattr(m.quant, f) for m in members]) for f in ("codes", "scales",
                                                                                              "zeros"))
            if self.interleave:
                codes, scales, zeros = _interleave(codes, 0), _interleave(scales, 0), _interleave(zeros, 0)
                bias = None if bias is None else _interleave(bias, 0)
                ec = None if ec is None else replace(ec, b=_interleave(ec.b, 0))
                self.interleaved = True
            q = members[0].quant
            self.method = W4Method.create(codes, scales, zeros, q.group_size, q.symmetric, ec, dtype, device)
        elif cuda and len(members) == 1 and W8Method.takes(members[0].quant, members[0].ec):
            q = members[0].quant
            self.method = W8Method.create(q.codes, q.scales, q.zeros, device)
        else:
            if cuda and any(m.quant is not None for m in members):
                self.reason = reason
            weight = torch.cat([m.quant.dequantized(dtype) if m.quant is not None else m.weight.to(dtype)
                                for m in members])
            self.method = DenseMethod.create(weight, ec, dtype, device)
        self.bias = None if bias is None else bias.to(device)
        self._members = []

    def _w4_reason(self, members: list[MemberWeights], ec: ECFactors | None) -> str | None:
        """Why the W4 kernel cannot take these members as one layer (None when it can)."""
        from spear.kernels.layout import MAX_RANK

        reason = next((r for r in (w4_reason(m.quant, self.in_features) for m in members) if r is not None), None)
        if reason is not None:
            return reason
        if len({(m.quant.group_size, m.quant.symmetric) for m in members}) > 1:
            return "members with different group sizes or symmetry"
        if ec is not None and (ec.rank > MAX_RANK or ec.hidden > MAX_RANK):
            return f"merged compensator rank {ec.rank} / gate width {ec.hidden} beyond the kernels' {MAX_RANK}"
        return None

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The members' outputs side by side (de-interleaved where the kernel interleaves them)."""
        return self._local(x, ctx)

    def _local(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """This rank's product (the whole layer's with one rank)."""
        y = self.method.apply(x, self.bias, ctx)
        return torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1) if self.interleaved else y

    def silu_mul(self, x: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """silu(member 0) · member 1 in the W4 GEMM's epilogue, where the layer runs interleaved on
        the kernel; None elsewhere (the caller applies the activation)."""
        return self.method.apply(x, self.bias, ctx, act=1) if self.interleaved else None

    def extra_repr(self) -> str:
        ec = getattr(self.method, "ec", None)
        return (f"in={self.in_features}, outs={self.outs}, {self.method.name if self.method else 'not finalized'}"
                + (f" ({self.reason})" if self.reason else "") + (", EC" if ec is not None else ""))


class ColumnParallelLinear(Linear):
    """This rank's share of every member's output features; the input is whole. ``gather``: the
    ranks' outputs concatenated (the vocabulary-parallel head)."""

    def __init__(self, in_features: int, outs: list[int], names: list[str], tp: TPRank, bias: bool = False,
                 interleave: bool = False, gather: bool = False):
        super().__init__(in_features, outs, names, bias, interleave)
        self.tp, self.gather, self.comm = tp, gather, None
        self.outs = [_share_len(tp, o, f"{name}'s output features") for o, name in zip(outs, names)]
        self.out_features = sum(self.outs)

    def _share(self, w: MemberWeights, member: int) -> MemberWeights:
        return column_share(w, self.tp.share(self.full_outs[member]))

    def set_comm(self, comm) -> None:
        self.comm = comm

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        y = self._local(x, ctx)
        return self.comm.gather(y) if self.gather else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", column-parallel {self.tp.rank}/{self.tp.size}"


class RowParallelLinear(Linear):
    """This rank's share of the input features; its partial outputs are summed across the ranks, and
    what must follow the sum (the bias, a gated compensator's gate and B) runs after it."""

    def __init__(self, in_features: int, outs: list[int], names: list[str], tp: TPRank, bias: bool = False):
        super().__init__(in_features, outs, names, bias)
        self.tp, self.comm, self.post = tp, None, None
        self.in_features = _share_len(tp, in_features, f"{names[0]}'s input features")

    def _share(self, w: MemberWeights, member: int) -> MemberWeights:
        return row_share(w, self.tp.share(self.full_in))

    def set_comm(self, comm) -> None:
        self.comm = comm

    def finalize(self, device: torch.device, dtype: torch.dtype, max_rank: int, kernels: bool | None = None) -> None:
        super().finalize(device, dtype, max_rank, kernels)
        self.post, self.bias = self.method.row_post(self.out_features, self.bias), None

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        y = self._local(x, ctx)
        u = None if self.post.ec is None else nn.functional.linear(x, self.post.ec.a)
        return self.comm.reduce(y, u, self.post)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", row-parallel {self.tp.rank}/{self.tp.size}"


def parallel_linear(style: str, tp: TPRank, in_features: int, outs: list[int], names: list[str],
                    **kw) -> Linear:
    """The layer of parallel ``style`` ("column" or "row", spear.parallel.split_of) for rank ``tp``:
    a plain ``Linear`` with one rank."""
    if style not in ("column", "row"):
        raise ValueError(f"a parallel style is 'column' or 'row', got {style!r}")
    if tp.size == 1:
        kw.pop("gather", None)
        return Linear(in_features, outs, names, **kw)
    if style == "row":
        return RowParallelLinear(in_features, outs, names, tp, **kw)
    return ColumnParallelLinear(in_features, outs, names, tp, **kw)


def _share_len(tp: TPRank, total: int, what: str) -> int:
    part = tp.share(total, what)
    return part.stop - part.start
