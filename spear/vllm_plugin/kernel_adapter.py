"""The one place the vLLM plugin calls spear's kernels: :func:`prepare` once after loading,
:func:`spear_linear` in every forward. Re-point these two when spear's kernel policy moves.

  CUDA, fp16/bf16   the packed W4 layout (``spear.kernels.layout.pack``, K-major where K allows,
                    as spear's engine packs) and ``spear.kernels.ops.w4a16_linear``: the registered
                    ``spear::w4a16_ec`` op, which torch.compile and CUDA graphs capture, with the
                    EC fused into the GEMM.
  anywhere else     the op's torch reference math (``spear.kernels.reference``), all in fp32 from the
                    stored parameters and cast at the end. The weight is dequantized once here rather
                    than per call (the op's CPU branch unpacks the codes on every call), as spear's
                    own CPU engine caches it.

A gated EC on a split input (row-parallel tensor parallelism) needs u = A·x all-reduced before
γ, which no fused kernel can do mid-GEMM: ``reduce_u`` is then given, the W4 GEMM runs without
the EC, and the EC runs beside it in fp32 torch (tokens × rank values, small).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spear.errors import SpearError


@dataclass
class SpearLinearWeights:
    """One rank's share of a layer, ready to run: the kernel layouts, or fp32 reference tensors."""

    kernel: bool
    packed: object = None       # spear.kernels.layout.PackedW4 (kernel path)
    packed_ec: object = None    # spear.kernels.layout.PackedEC or None (kernel path)
    w_hat: torch.Tensor | None = None   # (N, K) fp32 dequantized weight (reference path)
    a: torch.Tensor | None = None       # (R, K) fp32
    b: torch.Tensor | None = None       # (N, R) fp32, alpha folded in
    w1: torch.Tensor | None = None      # gate (reference path), u_scale folded into w1
    b1: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    bound: float = 1.0

    @property
    def has_ec(self) -> bool:
        return self.packed_ec is not None if self.kernel else self.a is not None


def uses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """spear's Triton kernels take fp16/bf16 activations on a CUDA device."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def prepare(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, symmetric: bool,
            ec: dict | None, dtype: torch.dtype) -> SpearLinearWeights:
    """Pack one rank's share once. ``codes`` (N, K) uint8, ``scales`` (N, G) fp16, ``zeros`` (N, G)
    uint8; ``ec`` holds fp32 ``a`` (R, K), ``b`` (N, R) with alpha folded, ``bound`` and, gated,
    ``w1`` (H, R) with the input scale folded, ``b1``, ``w2`` (R, H), ``b2``."""
    if uses_kernels(codes.device, dtype):
        from spear.kernels.layout import layout_for, pack, pack_ec

        n, k = codes.shape
        try:
            packed = pack(codes, scales, zeros, group_size, symmetric, layout=layout_for(n, k))
            packed_ec = None
            if ec is not None:
                gate = {n: ec[n] for n in ("w1", "b1", "w2", "b2")} if "w1" in ec else {}
                packed_ec = pack_ec(ec["a"], ec["b"], 1.0, dtype, bound=ec["bound"], **gate)
        except ValueError as e:  # a constraint of the kernel layouts, named by spear.kernels.layout
            raise SpearError(f"this layer's share does not fit spear's W4 kernels: {e}") from None
        return SpearLinearWeights(kernel=True, packed=packed, packed_ec=packed_ec)

    from spear.kernels.reference import dequantize

    out = SpearLinearWeights(kernel=False, w_hat=dequantize(codes, scales, zeros, group_size))
    if ec is not None:
        out.a, out.b, out.bound = ec["a"], ec["b"], float(ec["bound"])
        if "w1" in ec:
            out.w1, out.b1, out.w2, out.b2 = ec["w1"], ec["b1"], ec["w2"], ec["b2"]
    return out


def spear_linear(w: SpearLinearWeights, x: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce_u: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 add_ec: bool = True) -> torch.Tensor:
    """``x Ŵᵀ (+ bias) (+ α·B·(γ(A·x) ⊙ A·x))`` for x (..., K).

    ``reduce_u``: all-reduce of u = A·x across ranks before γ (a gated EC on a split input);
    ``add_ec`` False: this rank leaves the EC term to another (rank 0 adds it once u is reduced).
    """
    from spear.kernels import reference

    if w.kernel:
        from spear.kernels.ops import w4a16_linear

        if reduce_u is None:
            return w4a16_linear(x, w.packed, bias, w.packed_ec if add_ec else None)
        y = w4a16_linear(x, w.packed, bias, None)
        e = w.packed_ec
        u = reduce_u(F.linear(x.float(), e.a.float()))
        if not add_ec:
            return y
        v = reference.ec_gate(u, e.w1, e.b1, e.w2, e.b2, e.bound)
        return (y.float() + e.alpha * F.linear(v, e.b.float())).to(x.dtype)

    xf = x.float()
    y = F.linear(xf, w.w_hat, None if bias is None else bias.float())
    if w.a is not None:
        u = F.linear(xf, w.a)
        if reduce_u is not None:
            u = reduce_u(u)
        if add_ec:
            y = y + F.linear(reference.ec_gate(u, w.w1, w.b1, w.w2, w.b2, w.bound), w.b)
    return y.to(x.dtype)
