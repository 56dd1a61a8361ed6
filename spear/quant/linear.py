"""``QuantLinear``: a weight-only quantized linear with an optional error compensator.

It owns the integer codes, scales and zero points (the layout of
:mod:`spear.quant.primitives`) and a plain-torch forward that runs anywhere. An
attached ``compensator`` (any module mapping x -> correction, e.g. the static
low-rank term ``B(Ax)`` or SPEAR's gated EC) is added to the output.
"""

from __future__ import annotations

import torch
from torch import nn

from spear.quant.primitives import dequantize, n_groups


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 symmetric: bool, bias: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        g = n_groups(in_features, group_size)
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.uint8, device=device))
        # Scales are stored (and used) in fp16, as a deployment stores them.
        self.register_buffer("scales", torch.ones(out_features, g, dtype=torch.float16, device=device))
        self.register_buffer("zeros", torch.full((out_features, g), 2 ** (bits - 1), dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.compute_dtype = dtype
        self.compensator: nn.Module | None = None
        self._weight_cache: torch.Tensor | None = None

    @classmethod
    def from_quantized(cls, linear: nn.Linear, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int, group_size: int, symmetric: bool) -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, bits, group_size, symmetric,
                bias=linear.bias is not None, dtype=linear.weight.dtype, device=linear.weight.device)
        q.set_quantized(codes, scales, zeros)
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.data)
        return q

    def set_quantized(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        self.codes.copy_(codes)
        self.scales.copy_(scales.to(torch.float16))
        self.zeros.copy_(zeros)
        self._weight_cache = None

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.group_size, dtype or self.compute_dtype)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Wq·x (+ bias), without the compensator."""
        # The dequantized weight is cached: the base weights never change after
        # quantization, and re-dequantizing on every call dominates CPU time.
        w = self._weight_cache
        if w is None or w.dtype != x.dtype or w.device != x.device:
            w = self._weight_cache = self.dequantized_weight(x.dtype).to(x.device)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        if self.compensator is not None:
            y = y + self.compensator(x)
        return y

    def drop_cache(self) -> None:
        self._weight_cache = None

    def _apply(self, fn, recurse=True):
        self._weight_cache = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        gran = "per-channel" if self.group_size == 0 else f"group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"{gran}, {'sym' if self.symmetric else 'asym'}")
