"""Quantization math as pure functions on tensors.

Layout used everywhere in spear (kernels re-pack from it once at load):
  codes  (out, in)          uint8, unsigned integer codes in [0, 2^bits - 1]
  scales (out, n_groups)    float; n_groups = 1 for per-channel, in / group_size otherwise
  zeros  (out, n_groups)    uint8 integer zero points (the code that means 0.0)
  w_hat = (codes - zeros) * scales, broadcast over each group's columns.
Symmetric quantization is the special case zeros = 2^(bits-1) everywhere.
"""

from __future__ import annotations

import torch

from spear.errors import SpearError


def n_groups(in_features: int, group_size: int) -> int:
    if group_size == 0:
        return 1
    if in_features % group_size:
        raise SpearError(
            f"group size {group_size} does not divide in_features={in_features}; "
            f"use a divisor of {in_features} or 0 for per-channel"
        )
    return in_features // group_size


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = w.shape
    g = n_groups(inp, group_size)
    return w.reshape(out, g, inp // g)


def compute_qparams(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                    clip: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points for ``w`` (out, in); ``clip`` shrinks the range (AWQ/GPTQ search)."""
    wg = _grouped(w.float(), group_size)
    qmax = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        amax = wg.abs().amax(dim=-1) * clip
        scales = amax / (half - 1)
        zeros = torch.full_like(scales, half)
    else:
        wmax = wg.amax(dim=-1).clamp(min=0) * clip
        wmin = wg.amin(dim=-1).clamp(max=0) * clip
        scales = (wmax - wmin) / qmax
        zeros = torch.round(-wmin / scales.clamp(min=torch.finfo(torch.float32).tiny))
    # An all-zero group would give scale 0; any positive scale represents it exactly.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, zeros.clamp(0, qmax).to(torch.uint8)


def quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round ``w`` to unsigned codes with the given parameters."""
    wg = _grouped(w.float(), group_size)
    q = torch.round(wg / scales.unsqueeze(-1)) + zeros.unsqueeze(-1).float()
    return q.clamp(0, 2**bits - 1).to(torch.uint8).reshape(w.shape)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(codes - zeros) * scales`` in ``dtype``."""
    cg = _grouped(codes, group_size)
    w = (cg.float() - zeros.unsqueeze(-1).float()) * scales.float().unsqueeze(-1)
    return w.reshape(codes.shape).to(dtype)


def rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool):
    """Round-to-nearest: ``(codes, scales, zeros)``."""
    scales, zeros = compute_qparams(w, bits, group_size, symmetric)
    return quantize(w, scales, zeros, bits, group_size), scales, zeros


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> torch.Tensor:
    codes, scales, zeros = rtn(w, bits, group_size, symmetric)
    return dequantize(codes, scales, zeros, group_size, w.dtype)


# Bit packing. No library packs arbitrary widths (3-bit included) row-wise into
# bytes, so it is done here: each row's codes become a little-endian bit stream.

def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack (out, in) codes of ``bits`` bits into (out, ceil(in*bits/8)) uint8."""
    out, inp = codes.shape
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    bitstream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(out, inp * bits)
    pad = (-bitstream.shape[1]) % 8
    if pad:
        bitstream = torch.nn.functional.pad(bitstream, (0, pad))
    weights = (1 << torch.arange(8, dtype=torch.int32, device=codes.device))
    return (bitstream.reshape(out, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    out = packed.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bitstream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(out, -1)[:, : in_features * bits]
    weights = (1 << torch.arange(bits, dtype=torch.int32, device=packed.device))
    return (bitstream.reshape(out, in_features, bits).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def packed_nbytes(out_features: int, in_features: int, bits: int) -> int:
    return out_features * ((in_features * bits + 7) // 8)
