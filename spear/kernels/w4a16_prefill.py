"""W4A16 GEMM for prefill-sized batches: the 4-bit weight dequantized tile by tile on chip.

    out (M, N) = x (M, K) · W_hatᵀ (+ bias)          (ACT 1: silu(gate) · up of interleaved pairs)

Why a second W4 GEMM: the decode kernel (w4a16.py) keeps its tiles transposed (weights on the
left, the few tokens on the MMA's small side) and splits K, which is right for 1-64 tokens and
wrong for hundreds. At those sizes the alternative was dequantizing the whole weight to fp16 on
every call and calling cuBLAS: the dequantize pass writes 2 bytes per weight (about a third of
the GEMM's own time at 512 tokens on an H200). Here the weight never exists in fp16 outside the
chip.

Algorithm: the standard orientation of a tensor-core GEMM. A program computes a [BM, BN] output
tile; programs are numbered in groups of GROUP_M row tiles so that neighbouring programs share
weight columns in L2. Per K step of BK: the [BK/8, BN] packed words of the tile (the K-major
layout's (K/8, N) words, or the N-major (N, K/8) ones), unpacked with the exponent trick of
``_common._unpack_w4`` and dequantized in the activation dtype exactly as the reference rounds
W_hat once; x's [BM, BK] tile; acc [BM, BN] += x · W_hatᵀ in fp32. Per-channel scales are applied
once after the loop, group scales per step (BK divides the group). Triton's software pipeliner
keeps ``num_stages`` K steps of loads in flight.

Layouts: spear.kernels.layout (``PackedW4``). Numerics: products of fp16/bf16 values are exact in
the fp32 accumulator; the result is rounded once to x's dtype (bias added in fp32 first). Under
the interpreter the dot takes fp32 copies of the same rounded operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels._common import INTERPRET, _dequant, _dot, _sigmoid, _unpack_w4
from spear.kernels.launch import PrefillConfig
from spear.kernels.layout import PackedW4


@triton.jit(do_not_specialize=["M"])
def _w4a16_prefill_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om,
    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr, IS_BF16: tl.constexpr,
    KMAJOR: tl.constexpr, ACT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    n_ld = offs_n % N  # in-bounds columns: unmasked, vectorized loads
    offs_k = tl.arange(0, BK)
    offs_kw = tl.arange(0, BK // 8)
    if KMAJOR:
        w_ptrs = qw_ptr + offs_kw[None, :] * N + n_ld[:, None]          # [BN, BK/8] of the (K/8, N) words
    else:
        w_ptrs = qw_ptr + n_ld[:, None] * (K // 8) + offs_kw[None, :]   # [BN, BK/8] of the (N, K/8) words
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if IS_BF16:
        zbase = 128.0
    else:
        zbase = 1024.0
    s = tl.load(scales_ptr + n_ld).to(tl.float32)
    if SYMMETRIC:
        zc = tl.full((BN,), zbase + 8.0, tl.float32)
    else:
        zc = zbase + tl.load(zeros_ptr + n_ld).to(tl.float32)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        if GROUP > 0:
            g = k // GROUP
            s = tl.load(scales_ptr + g * N + n_ld).to(tl.float32)
            if not SYMMETRIC:
                zc = zbase + tl.load(zeros_ptr + g * N + n_ld).to(tl.float32)
        if KMAJOR:
            p = tl.load(w_ptrs + (k // 8) * N)
        else:
            p = tl.load(w_ptrs + k // 8)
        w = _dequant(_unpack_w4(p, BN, BK, IS_BF16, KMAJOR), zc, s, GROUP > 0, IS_BF16)  # [BN, BK]
        x = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
        acc = _dot(x, tl.trans(w), acc, DOT_F32)
    if GROUP == 0:
        acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    if ACT == 1:
        # columns 2i, 2i + 1 are gate and up of output feature pid_n * BN / 2 + i
        gate, up = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
        offs_h = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_h[None, :], (gate * _sigmoid(gate) * up).to(dt),
                 mask=m_mask[:, None] & (2 * offs_h < N)[None, :])
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(dt),
                 mask=m_mask[:, None] & n_mask[None, :])


def w4a16_prefill_matmul(x: torch.Tensor, w: PackedW4, bias: torch.Tensor | None = None,
                         config: PrefillConfig = PrefillConfig(), act: int = 0, launch=None) -> torch.Tensor:
    """``x W_hatᵀ (+ bias)`` for 2-D fp16/bf16 ``x`` with unit stride along features; with ``act`` 1 the
    output features are interleaved (gate, up) pairs and the result is silu(gate) · up, (M, N / 2)."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D fp16/bf16 with unit stride along features; got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the packed weight expects in_features={w.in_features}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be (out_features,) = ({n},); got {tuple(bias.shape)}")
    c = config
    if k % c.BK or (w.group_size and w.group_size % c.BK) or c.BK % 32:
        raise ValueError(f"BK={c.BK} must be a multiple of 32 dividing in_features={k} and the group size "
                         f"{w.group_size}")
    if act not in (0, 1) or (act and (n % 2 or c.BN % 2)):
        raise ValueError(f"act must be 0 or 1 (SiLU·mul over interleaved pairs, even out_features); got {act}")
    out = _common.alloc((m, n // 2 if act else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, c.BM) * triton.cdiv(n, c.BN),)
    kernel = _w4a16_prefill_kernel if launch is None else launch(_w4a16_prefill_kernel)
    kernel[grid](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else w.scales, out,
        m, n, k, x.stride(0), out.stride(0),
        GROUP=w.group_size, SYMMETRIC=w.symmetric, HAS_BIAS=bias is not None, IS_BF16=x.dtype == torch.bfloat16,
        KMAJOR=w.kmajor, ACT=act, BM=c.BM, BN=c.BN, BK=c.BK, GROUP_M=c.GROUP_M, DOT_F32=INTERPRET,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out
