"""Serving QuantLinears through the W4A16 (+EC) and W8A16 Triton kernels on CUDA.

``QuantLinear``'s own forward dequantizes its weight (a torch reference that runs
anywhere). For serving on a GPU, :func:`use_quant_kernels` packs each eligible 4-bit
QuantLinear once into the kernel layout (``spear.kernels.layout.pack``), together
with its compensator when that is a low-rank or SPEAR EC (``pack_ec``), and swaps in
a :class:`W4KernelLinear` whose forward is one ``w4a16_linear`` call: the EC runs
fused into the GEMM at decode and semi-fused at prefill (see spear/kernels/ops.py).
A compensator the kernels do not know is kept as a module and added to the output.
An 8-bit per-channel symmetric QuantLinear (the output head of ``spear quantize
--lm-head-bits 8``) becomes a :class:`W8KernelLinear` over the W8A16 kernel (w8a16.py).
"""

from __future__ import annotations

import torch
from torch import nn

from spear.kernels.layout import KMAJOR_K_MULTIPLE, MAX_RANK, PackedEC, PackedW4, pack, pack_ec
from spear.kernels.ops import w4a16_linear
from spear.kernels.w8a16 import K_STEP as W8_K_STEP
from spear.kernels.w8a16 import pack_w8, w8a16_linear
from spear.models.modules import set_module
from spear.quant.linear import QuantLinear

_KERNEL_GROUPS = (0, 32, 64, 128, 256)


def packable(q: QuantLinear) -> bool:
    """The kernel's constraints: 4-bit codes, K a multiple of 32, a supported group size."""
    g = q.group_size
    return (q.bits == 4 and q.in_features % 32 == 0 and g in _KERNEL_GROUPS
            and (g == 0 or q.in_features % g == 0))


def packable_w8(q: QuantLinear) -> bool:
    """The W8A16 kernel's constraints: 8-bit per-channel symmetric codes, K a multiple of W8_K_STEP."""
    return q.bits == 8 and q.group_size == 0 and q.symmetric and q.in_features % W8_K_STEP == 0


def _pack_compensator(comp: nn.Module, dtype: torch.dtype):
    from spear.compensate.ec import GatedCompensator
    from spear.compensate.lowrank import LowRankCompensator

    if isinstance(comp, LowRankCompensator) and comp.rank <= MAX_RANK:
        return pack_ec(comp.A.detach(), comp.B.detach(), 1.0, dtype)
    if isinstance(comp, GatedCompensator) and comp.rank <= MAX_RANK and comp.hidden <= MAX_RANK:
        g = comp.export_gate()
        gate = {k: g[k] for k in ("w1", "b1", "w2", "b2")} if comp.gated else {}
        return pack_ec(g["A"], g["B"], g["alpha"], dtype, bound=g["bound"], **gate)
    return None


class W4KernelLinear(nn.Module):
    """A QuantLinear packed once for the kernels; ``forward`` is one ``w4a16_linear`` call."""

    def __init__(self, q: QuantLinear, dtype: torch.dtype, kmajor: bool = False):
        super().__init__()
        if not packable(q):
            raise ValueError(f"QuantLinear({q.extra_repr()}) does not fit the W4 kernels: need bits=4, "
                             f"in_features % 32 == 0, group_size in {_KERNEL_GROUPS}")
        self.in_features, self.out_features = q.in_features, q.out_features
        # the K-major layout needs K % 128 == 0; other layers keep the N-major one
        kmajor = kmajor and q.in_features % KMAJOR_K_MULTIPLE == 0
        self.weight = pack(q.codes, q.scales, q.zeros, q.group_size, q.symmetric, kmajor=kmajor)
        self.bias = None if q.bias is None else q.bias.detach().to(dtype)
        self.ec = None if q.compensator is None else _pack_compensator(q.compensator, dtype)
        # A compensator the kernels cannot run stays a module beside them.
        self.compensator = q.compensator if q.compensator is not None and self.ec is None else None

    @classmethod
    def from_packed(cls, weight: PackedW4, bias: torch.Tensor | None, ec: PackedEC | None) -> "W4KernelLinear":
        """A layer over already packed tensors (e.g. several layers' packs merged, spear/serve/fusion.py)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.weight, self.bias, self.ec, self.compensator = weight, bias, ec, None
        return self

    def forward(self, x: torch.Tensor, act: int = 0) -> torch.Tensor:
        """``act`` 1: silu(gate) * up of interleaved (gate, up) output features (spear/serve/fusion.py)."""
        if act and self.compensator is not None:
            raise ValueError("act needs the compensator inside the kernel")
        y = w4a16_linear(x, self.weight, self.bias, self.ec, act)
        if self.compensator is not None:
            y = y + self.compensator(x)
        return y

    def extra_repr(self) -> str:
        ec = "none" if self.ec is None else f"rank {self.ec.rank}{' gated' if self.ec.gated else ''}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fused EC: {ec}"


class W8KernelLinear(nn.Module):
    """An 8-bit per-channel symmetric QuantLinear packed once (int8 codes, fp32 row scales);
    ``forward`` is one ``w8a16_linear`` call. A compensator stays a module beside the kernel."""

    def __init__(self, q: QuantLinear, dtype: torch.dtype):
        super().__init__()
        if not packable_w8(q):
            raise ValueError(f"QuantLinear({q.extra_repr()}) does not fit the W8 kernel: need bits=8, "
                             f"per-channel, symmetric, in_features % {W8_K_STEP} == 0")
        self.in_features, self.out_features = q.in_features, q.out_features
        self.qweight, self.scale = pack_w8(q.codes, q.scales, q.zeros)
        self.bias = None if q.bias is None else q.bias.detach().to(dtype)
        self.compensator = q.compensator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = w8a16_linear(x, self.qweight, self.scale, self.bias)
        if self.compensator is not None:
            y = y + self.compensator(x)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def use_quant_kernels(model: nn.Module, kmajor: bool = False) -> int:
    """Swap every packable QuantLinear of a CUDA fp16/bf16 model for a W4KernelLinear (4-bit) or a
    W8KernelLinear (8-bit per-channel); returns how many. ``kmajor``: pack the 4-bit ones K-major
    (``spear.kernels.layout``) where in_features allows it."""
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return 0  # the kernels take fp16/bf16 activations; fp32 keeps the torch path
    swaps = {name: W4KernelLinear(q, dtype, kmajor) if packable(q) else W8KernelLinear(q, dtype)
             for name, q in model.named_modules()
             if isinstance(q, QuantLinear) and (packable(q) or packable_w8(q))}
    for name, packed in swaps.items():
        set_module(model, name, packed)
    return len(swaps)
