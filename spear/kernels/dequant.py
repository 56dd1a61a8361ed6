"""Dequantize a packed W4 weight to fp16/bf16, for the dequantize + cuBLAS path of large token counts.

From ``KernelPolicy.*_cublas_min_m`` tokens on, a cuBLAS GEMM on the dequantized weight beats the
Triton GEMM; this pass costs 2 bytes written and 0.52 read per weight. One program per tile:
unpack, apply zero point and scale, round once to the activation dtype (as the reference rounds
W_hat), store. The fragment layout's kernel is _fragment.py's; the N-major one is here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spear.kernels import _common
from spear.kernels._common import _dequant, _unpack_w4
from spear.kernels._fragment import _dequant_fragment_kernel
from spear.kernels.layout import Layout, PackedW4


@triton.jit
def _dequant_kernel(qw_ptr, scales_ptr, zeros_ptr, w_ptr, N, K, stride_wn,
                    GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr):
    """W_hat (N, K) of the N-major layout, one [BN, BK] tile a program."""
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
    p = tl.load(qw_ptr + n_ld[:, None] * (K // 8) + (k // 8 + tl.arange(0, BK // 8))[None, :])
    w = _dequant(_unpack_w4(p, BN, BK, IS_BF16), zc, s, True, IS_BF16)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + (k + tl.arange(0, BK))[None, :], w, mask=n_mask[:, None])


def dequantize(w: PackedW4, dtype: torch.dtype) -> torch.Tensor:
    """W_hat (N, K) in ``dtype`` (float16 or bfloat16), rounded once as the reference rounds it."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dequantize dtype must be float16 or bfloat16; got {dtype}")
    n, k = w.out_features, w.in_features
    out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    if w.layout is Layout.FRAGMENT:
        bn = 64 if n % 64 == 0 else 16
        _dequant_fragment_kernel[(triton.cdiv(n, bn) * (k // 64),)](
            w.qweight, w.scales, w.zeros, out, n, k, out.stride(0),
            GROUP=w.group_size, SYMMETRIC=w.symmetric, IS_BF16=dtype == torch.bfloat16, BN=bn,
            ASM=not _common.INTERPRET, num_warps=4, num_stages=1,
        )
        return out
    bk = min(128, w.group_size or 128)
    if k % bk:
        raise ValueError(f"in_features={k} must be a multiple of {bk}")
    bn = 64
    _dequant_kernel[(triton.cdiv(n, bn) * (k // bk),)](
        w.qweight, w.scales, w.zeros, out, n, k, out.stride(0),
        GROUP=w.group_size, SYMMETRIC=w.symmetric, IS_BF16=dtype == torch.bfloat16, BN=bn, BK=bk,
        num_warps=4, num_stages=1,
    )
    return out
