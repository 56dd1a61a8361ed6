"""Fused projections for the CUDA decode layer: q/k/v and gate/up as one GEMM each.

At decode a W4 GEMV costs a fixed ~5 µs (launch, ramp, split-K tail) on top of its bytes, and
the fused EC adds its own epilogue chain per launch; q/k/v and gate/up read the same input, so
stacking their weights along the output features turns five launches per layer into two.
The FP16 baseline gets the same treatment (one cuBLAS call per group), so comparisons stay fair.

* ``nn.Linear`` members: one weight ``cat(W_i)`` (and bias).
* ``W4KernelLinear`` members of one layout: the packed words, scales and zeros are
  concatenated along the output features (a column slice of each member's codes); the
  compensators become one EC of rank sum(r_i): ``A = cat(A_i)``, ``B`` block-diagonal with
  each member's alpha folded in, gate MLPs block-diagonal. A block-diagonal gate is exactly
  the members' gates side by side: member i's ranks only see its own hidden units, and a
  member without a gate gets none (gamma = 1 + bound * tanh(0) = 1 on its ranks). Members
  without an EC contribute zero rows of B.

gate/up of ``W4KernelLinear`` members are fused *interleaved*: output features 2i and 2i + 1 are
gate_i and up_i (codes, scales, zeros, B rows and bias permuted alike), so the GEMM's epilogue
can apply SiLU·mul itself (:meth:`FusedLinear.silu_mul`, ``act`` of ``spear::w4a16_ec``) and
the gate/up intermediate never reaches memory. ``FusedLinear.forward`` returns the members'
outputs side by side either way.

The members are replaced by :class:`FusedPart` views (no second copy of any weight), so the
model's own forward still gives the same outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from spear.kernels.layout import LOCK_SLOTS, MAX_RANK, PackedEC, PackedW4, pack_ec
from spear.models.modules import set_module
from spear.serve.w4_kernels import W4KernelLinear

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
          ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"))


class FusedPart(nn.Module):
    """Member ``index`` of a fused projection: its slice of the fused output."""

    def __init__(self, fused: nn.Module, index: int):
        super().__init__()
        self.fused = [fused]  # a list: not registered twice as a submodule
        self.index = index
        self.in_features = fused.in_features
        self.out_features = fused.splits[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0](x).split(self.fused[0].splits, dim=-1)[self.index]


class FusedLinear(nn.Module):
    """One projection standing for several that share their input; ``splits`` are their widths.
    ``interleaved``: two members of equal width whose features alternate in ``inner``'s output."""

    def __init__(self, inner: nn.Module, splits: list[int], interleaved: bool = False):
        super().__init__()
        self.inner = inner
        self.splits = splits
        self.interleaved = interleaved
        self.in_features = inner.in_features
        self.out_features = sum(splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.interleaved:
            y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
        return y

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(member 0) * member 1, in the GEMM's epilogue (interleaved W4 gate/up only)."""
        if not self.interleaved:
            raise ValueError("silu_mul needs an interleaved gate/up fusion")
        return self.inner(x, act=1)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Two equal halves of ``t`` along ``dim`` >= 0 (member 0, member 1) with their entries alternating."""
    a, b = t.chunk(2, dim=dim)
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def _cat_bias(mods: list[nn.Module], dtype: torch.dtype, device: torch.device,
              interleave: bool = False) -> torch.Tensor | None:
    """The members' biases side by side (zeros for a member without one); None if none has one."""
    if all(m.bias is None for m in mods):
        return None
    b = torch.cat([m.bias.detach().to(dtype) if m.bias is not None
                   else torch.zeros(m.out_features, dtype=dtype, device=device) for m in mods])
    return _interleave(b, 0) if interleave else b


def _cat_linears(mods: list[nn.Linear]) -> nn.Linear:
    w = mods[0].weight
    out = nn.Linear(w.shape[1], sum(m.out_features for m in mods), bias=any(m.bias is not None for m in mods),
                    device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in mods]))
        if out.bias is not None:
            out.bias.copy_(_cat_bias(mods, w.dtype, w.device))
    out.weight.requires_grad_(False)
    return out


def merge_packed_w4(parts: list[PackedW4], interleave: bool = False) -> PackedW4:
    """The members' packed weights side by side along the output features (same K, group, layout);
    ``interleave``: two members of equal width, their output features alternating."""
    p0 = parts[0]
    for p in parts[1:]:
        if (p.in_features, p.group_size, p.symmetric, p.kmajor) != (p0.in_features, p0.group_size, p0.symmetric,
                                                                    p0.kmajor):
            raise ValueError("fused members must share in_features, group size, symmetry and layout")
    if interleave and (len(parts) != 2 or parts[0].out_features != parts[1].out_features):
        raise ValueError("interleaving needs two members of equal out_features")
    n_dim = 1 if p0.kmajor else 0  # the output features' axis of the packed words
    qweight = torch.cat([p.qweight for p in parts], dim=n_dim)
    scales, zeros = torch.cat([p.scales for p in parts], dim=1), torch.cat([p.zeros for p in parts], dim=1)
    if interleave:
        qweight, scales, zeros = _interleave(qweight, n_dim), _interleave(scales, 1), _interleave(zeros, 1)
    return PackedW4(qweight, scales, zeros, torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=qweight.device),
                    p0.group_size, p0.symmetric, p0.kmajor)


def merge_packed_ec(ecs: list[PackedEC | None], outs: list[int], k: int, dtype: torch.dtype,
                    device: torch.device, interleave: bool = False) -> PackedEC | None:
    """One EC equal to the members' ECs side by side (module docstring); None if no member has one.
    Raises ValueError when the merged rank or gate width exceeds the kernel's MAX_RANK or gated
    members disagree on the gate bound (a scalar of the kernel)."""
    if all(e is None for e in ecs):
        return None
    ranks = [e.rank if e is not None else 0 for e in ecs]
    gated = [e for e in ecs if e is not None and e.gated]
    hidden = [e.w1.shape[0] if e is not None and e.gated else 0 for e in ecs]
    r, h = sum(ranks), sum(hidden)
    if r > MAX_RANK or h > MAX_RANK:
        raise ValueError(f"merged EC rank {r} / gate width {h} exceed {MAX_RANK}")
    bounds = {e.bound for e in gated}
    if len(bounds) > 1:
        raise ValueError(f"gated members have different bounds {sorted(bounds)}")
    f32 = dict(dtype=torch.float32, device=device)
    a, b = torch.zeros(r, k, **f32), torch.zeros(sum(outs), r, **f32)
    w1, b1, w2, b2 = torch.zeros(h, r, **f32), torch.zeros(h, **f32), torch.zeros(r, h, **f32), torch.zeros(r, **f32)
    ro = ho = no = 0
    for e, ri, hi, n in zip(ecs, ranks, hidden, outs):
        if e is not None:
            a[ro:ro + ri] = e.a[:ri].float()
            b[no:no + n, ro:ro + ri] = e.alpha * e.b[:, :ri].float()
            if hi:
                w1[ho:ho + hi, ro:ro + ri] = e.w1[:, :ri].float()
                b1[ho:ho + hi] = e.b1.float()
                w2[ro:ro + ri, ho:ho + hi] = e.w2[:ri].float()
                b2[ro:ro + ri] = e.b2[:ri].float()
        ro, ho, no = ro + ri, ho + hi, no + n
    gate = dict(w1=w1, b1=b1, w2=w2, b2=b2, bound=gated[0].bound) if gated else {}
    return pack_ec(a, _interleave(b, 0) if interleave else b, 1.0, dtype, **gate)


def _fuse_w4(mods: list[W4KernelLinear], interleave: bool = False) -> W4KernelLinear | None:
    if any(m.compensator is not None for m in mods):  # a compensator module beside the kernel
        return None
    dtype = next((m.bias.dtype for m in mods if m.bias is not None), None) or next(
        (m.ec.a.dtype for m in mods if m.ec is not None), None) or torch.float16
    try:
        weight = merge_packed_w4([m.weight for m in mods], interleave)
        ec = merge_packed_ec([m.ec for m in mods], [m.out_features for m in mods], mods[0].in_features, dtype,
                             weight.qweight.device, interleave)
    except ValueError:
        return None
    return W4KernelLinear.from_packed(weight, _cat_bias(mods, dtype, weight.qweight.device, interleave), ec)


def fuse_group(mods: list[nn.Module], interleave: bool = False) -> FusedLinear | None:
    """One FusedLinear for modules that read the same input, or None if they cannot be fused.
    ``interleave`` (W4 members only; two of equal width): their output features alternate, for the
    SiLU·mul epilogue."""
    if all(type(m) is nn.Linear for m in mods):
        dts = {(m.weight.dtype, m.weight.device, m.in_features) for m in mods}
        return FusedLinear(_cat_linears(mods), [m.out_features for m in mods]) if len(dts) == 1 else None
    if all(isinstance(m, W4KernelLinear) for m in mods):
        interleave = interleave and len(mods) == 2 and mods[0].out_features == mods[1].out_features
        inner = _fuse_w4(mods, interleave)
        return None if inner is None else FusedLinear(inner, [m.out_features for m in mods], interleave)
    return None


def fuse_projections(layers: list[nn.Module]) -> int:
    """Fuse q/k/v and gate/up of every decoder layer where possible (attribute ``qkv_proj`` /
    ``gate_up_proj`` on the attention / MLP module); returns how many groups were fused."""
    n = 0
    for layer in layers:
        for parent_name, names, fused_name in GROUPS:
            parent = getattr(layer, parent_name)
            mods = [getattr(parent, name) for name in names]
            fused = fuse_group(mods, interleave=fused_name == "gate_up_proj")
            if fused is None:
                continue
            setattr(parent, fused_name, fused)
            for i, name in enumerate(names):
                set_module(parent, name, FusedPart(fused, i))
            n += 1
    return n
