"""Plain-torch references for the kernels: the contract every kernel is tested against.

All math is done in fp32 from the stored (fp16/bf16) parameters; callers cast the result.

  W_hat = (codes - zeros) * scales            per group of ``group_size`` input columns
  y     = x W_hatᵀ (+ bias)
  u     = x Aᵀ                                 A: (r, K)
  gamma = 1 + bound * tanh(silu(u W1ᵀ + b1) W2ᵀ + b2)   (gamma = 1 without a gate)
  y    += alpha * (gamma ⊙ u) Bᵀ              B: (N, r)
"""

from __future__ import annotations

import torch

from spear.kernels.layout import PackedEC, PackedW4, unpack


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 W_hat (N, K) from codes (N, K), scales and zeros (N, G)."""
    n, k = codes.shape
    g = scales.shape[1]
    w = codes.float().reshape(n, g, k // g) - zeros.float().unsqueeze(-1)
    return (w * scales.float().unsqueeze(-1)).reshape(n, k)


def ec_gate(u: torch.Tensor, w1: torch.Tensor | None, b1: torch.Tensor | None, w2: torch.Tensor | None,
            b2: torch.Tensor | None, bound: float) -> torch.Tensor:
    """gamma(u) ⊙ u in fp32; u is (M, r). No gate (w1 None) means gamma = 1."""
    if w1 is None:
        return u
    h = torch.nn.functional.silu(u @ w1.float().t() + b1.float())
    gamma = 1.0 + bound * torch.tanh(h @ w2.float().t() + b2.float())
    return gamma * u


def w4a16_ec(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, a: torch.Tensor | None = None, b: torch.Tensor | None = None,
             w1: torch.Tensor | None = None, b1: torch.Tensor | None = None, w2: torch.Tensor | None = None,
             b2: torch.Tensor | None = None, alpha: float = 1.0, bound: float = 1.0) -> torch.Tensor:
    """fp32 reference of the whole layer for x (M, K); the EC is skipped when ``a`` is None."""
    xf = x.float()
    y = xf @ dequantize(codes, scales, zeros, group_size).t()
    if bias is not None:
        y = y + bias.float()
    if a is not None:
        v = ec_gate(xf @ a.float().t(), w1, b1, w2, b2, bound)
        y = y + alpha * (v @ b.float().t())
    return y


def silu_mul_pairs(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 for outputs whose features are interleaved (gate, up) pairs."""
    y = y.float()
    return torch.nn.functional.silu(y[..., 0::2]) * y[..., 1::2]


def w4a16_ec_packed(x: torch.Tensor, packed: PackedW4, bias: torch.Tensor | None = None,
                    ec: PackedEC | None = None) -> torch.Tensor:
    """The same reference from the packed layouts (zero padding of the EC contributes exactly 0)."""
    codes, scales, zeros = unpack(packed)
    if ec is None:
        return w4a16_ec(x, codes, scales, zeros, packed.group_size, bias)
    return w4a16_ec(x, codes, scales, zeros, packed.group_size, bias, ec.a, ec.b, ec.w1, ec.b1, ec.w2, ec.b2,
                    ec.alpha, ec.bound)
