"""Dequantize the packed W4 layout to fp16/bf16, for the dequantize-then-cuBLAS prefill path.

At M >= KernelPolicy.dequant_mm_min_m a cuBLAS GEMM on the dequantized weight beats the Triton
dequant-in-loop GEMM; this pass costs 2 bytes written and 0.52 read per weight.
Algorithm: one program per [BN, BK] tile: unpack (``_unpack_w4``), apply zero point and
scale, round once to the activation dtype (as the reference rounds W_hat), store. The
K-major layout is written as W_hatᵀ (K, N), contiguous along N as its words are, and
returned as the (N, K) transposed view (cuBLAS takes either orientation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels._common import _dequant, _dequant_values, _halves, _magic, _unpack_w4
from spear.kernels._mma import _dequant_mma_kernel
from spear.kernels.layout import PackedW4


@triton.jit
def _dequant_kernel(qw_ptr, scales_ptr, zeros_ptr, w_ptr, N, K, stride_wn,
                    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, KMAJOR: tl.constexpr = False):
    pid = tl.program_id(0)
    k_tiles = K // BK
    offs_n = (pid // k_tiles) * BN + tl.arange(0, BN)
    k = (pid % k_tiles) * BK
    n_mask = offs_n < N
    n_ld = offs_n % N
    if IS_BF16:
        zbase = 128.0
    else:
        zbase = 1024.0
    if GROUP > 0:
        g = k // GROUP
    else:
        g = 0
    s = tl.load(scales_ptr + g * N + n_ld).to(tl.float32)
    if SYMMETRIC:
        zc = tl.full((BN,), zbase + 8.0, tl.float32)
    else:
        zc = zbase + tl.load(zeros_ptr + g * N + n_ld).to(tl.float32)
    if KMAJOR:
        # (K/8, N) words: the [BN, BK/8] tile with N contiguous (16-byte loads along N)
        offs_nc = tl.max_contiguous(tl.multiple_of(offs_n, BN), BN)
        p = tl.load(qw_ptr + (k // 8 + tl.arange(0, BK // 8))[None, :] * N + offs_nc[:, None],
                    mask=n_mask[:, None], other=0)
    else:
        p = tl.load(qw_ptr + n_ld[:, None] * (K // 8) + (k // 8 + tl.arange(0, BK // 8))[None, :])
    w = _dequant(_unpack_w4(p, BN, BK, IS_BF16, KMAJOR), zc, s, True, IS_BF16)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + (k + tl.arange(0, BK))[None, :], w, mask=n_mask[:, None])


@triton.jit
def _dequant_kmajor_kernel(qw_ptr, scales_ptr, zeros_ptr, wt_ptr, N,
                           GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    k0 = (pid // n_tiles) * BK
    offs_n = tl.max_contiguous(tl.multiple_of((pid % n_tiles) * BN + tl.arange(0, BN), BN), BN)
    offs_j = tl.arange(0, BK // 8)
    mask = (offs_j[:, None] >= 0) & (offs_n < N)[None, :]
    magic, zbase = _magic(IS_BF16)
    if GROUP > 0:
        grp = ((k0 + 8 * offs_j) // GROUP)[:, None] * N + offs_n[None, :]
    else:
        grp = offs_j[:, None] * 0 + offs_n[None, :]
    s = tl.load(scales_ptr + grp, mask=mask, other=0.0).to(tl.float32)
    if SYMMETRIC:
        zc = tl.full((BK // 8, BN), zbase + 8.0, tl.float32)
    else:
        zc = zbase + tl.load(zeros_ptr + grp, mask=mask, other=0).to(tl.float32)
    p = tl.load(qw_ptr + (k0 // 8 + offs_j)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    rows = wt_ptr + (k0 + 8 * offs_j)[:, None] * N + offs_n[None, :]
    for i in tl.static_range(4):
        lo, hi = tl.split(_halves(((p >> (4 * i)) & 0x000F000F) | magic, IS_BF16))  # k-offsets 2i, 2i+1
        tl.store(rows + (2 * i) * N, _dequant_values(lo, zc, s, True, IS_BF16), mask=mask)
        tl.store(rows + (2 * i + 1) * N, _dequant_values(hi, zc, s, True, IS_BF16), mask=mask)


def dequantize(w: PackedW4, dtype: torch.dtype, *, kn: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat (N, K) in ``dtype`` (float16 or bfloat16), rounded once as the reference rounds it.
    ``kn`` (K-major weights only): write W_hatᵀ (K, N) and return its transposed view.
    ``out``: an (N, K) tensor of ``dtype`` with unit stride along K to write W_hat into (not with
    ``kn``), e.g. the first N rows or the first K columns of a larger matrix."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dequantize dtype must be float16 or bfloat16; got {dtype}")
    n, k = w.out_features, w.in_features
    if out is not None and (kn or out.shape != (n, k) or out.dtype != dtype or out.stride(1) != 1
                            or out.stride(0) < k):
        raise ValueError(f"out must be a ({n}, {k}) {dtype} tensor with rows of unit stride, without kn; got "
                         f"{tuple(out.shape)} {out.dtype}, strides {out.stride()}, kn={kn}")
    if w.layout == "mma":
        if kn:
            raise ValueError("kn is for K-major weights only")
        if out is None:
            out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
        bn = 64 if n % 64 == 0 else 16
        _dequant_mma_kernel[(triton.cdiv(n, bn) * (k // 64),)](
            w.qweight, w.scales, w.zeros, out, n, k, out.stride(0),
            GROUP=w.group_size, SYMMETRIC=w.symmetric, IS_BF16=dtype == torch.bfloat16, BN=bn,
            ASM=not _common.INTERPRET, num_warps=4, num_stages=1,
        )
        return out
    if w.kmajor and kn:
        wt = torch.empty((k, n), dtype=dtype, device=w.qweight.device)
        bn, bk = 64, 128
        _dequant_kmajor_kernel[(triton.cdiv(n, bn) * (k // bk),)](
            w.qweight, w.scales, w.zeros, wt, n,
            GROUP=w.group_size, SYMMETRIC=w.symmetric, IS_BF16=dtype == torch.bfloat16, BN=bn, BK=bk,
            num_warps=4, num_stages=1,
        )
        return wt.t()
    bk = min(128, w.group_size or 128)
    if k % bk:
        raise ValueError(f"in_features={k} must be a multiple of {bk}")
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    bn = 64
    _dequant_kernel[(triton.cdiv(n, bn) * (k // bk),)](
        w.qweight, w.scales, w.zeros, out, n, k, out.stride(0),
        GROUP=w.group_size, SYMMETRIC=w.symmetric, IS_BF16=dtype == torch.bfloat16, BN=bn, BK=bk,
        KMAJOR=w.kmajor, num_warps=4, num_stages=1,
    )
    return out
