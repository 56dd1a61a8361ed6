"""CUDA-core main loop of the W4A16 GEMM over the N-major layout (``pack(..., layout="nmajor")``):
output features along rows, each row's K as consecutive int32 words (``_fma_mainloop``).

The K-major counterpart is _kmajor.py; both return accT [BN, BM] for the split-K reduction and
epilogue of w4a16.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import _add_scaled, _neg_zero_pairs, _step_sums, _tokens_to_accT, _word2_dot


@triton.jit
def _x_pair(base, lo: tl.constexpr, hi: tl.constexpr, m):
    """fp16 activations at base + lo and base + hi as one int32 (lo in the low half)."""
    a = tl.load(base + lo, mask=m, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = tl.load(base + hi, mask=m, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
    return a | (b << 16)


@triton.jit
def _x_pairs(base, m, shape: tl.constexpr):
    """The activation pairs of one word per column, broadcast over the tile's rows: nibble pairs
    (0,4), (1,5), (2,6), (3,7) hold k-offsets (0,4), (2,6), (1,5), (3,7) (NIBBLE_K)."""
    return (tl.broadcast_to(_x_pair(base, 0, 4, m)[None, :], shape),
            tl.broadcast_to(_x_pair(base, 2, 6, m)[None, :], shape),
            tl.broadcast_to(_x_pair(base, 1, 5, m)[None, :], shape),
            tl.broadcast_to(_x_pair(base, 3, 7, m)[None, :], shape))


@triton.jit
def _ptx_token(acc, x_ptr, i, stride_xm, k, offs_w, p, q, zn, zn16, M, HALF: tl.constexpr):
    """acc [BN, BK/16] += (W - zero)/16 · x for token i: word columns w (p) and w + HALF (q) per
    ``_word2_dot``."""
    m = (offs_w * 0 + i) < M
    base = x_ptr + i * stride_xm + k + 8 * offs_w
    x0, x1, x2, x3 = _x_pairs(base, m, p.shape)
    y0, y1, y2, y3 = _x_pairs(base + 8 * HALF, m, p.shape)
    return acc + _word2_dot(p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3)


@triton.jit
def _fma_token(acc, x_ptr, i, stride_xm, k, koff, offs_w, wj, xs, M):
    """acc [BN, BK/8] += wj * x[i, k + 8 w + koff] (scaled by xs); tokens i >= M read as 0."""
    xj = tl.load(x_ptr + i * stride_xm + k + 8 * offs_w + koff, mask=(offs_w * 0 + i) < M, other=0.0)
    return acc + wj * (xj.to(tl.float32) * xs)[None, :]


@triton.jit
def _fma_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n_ld, k_lo, k_hi, M, N, K, stride_xm,
                  GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BM: tl.constexpr, MV: tl.constexpr, PTX: tl.constexpr):
    """CUDA-core main loop for M <= MV <= 4 tokens; returns accT [BN, BM] (columns >= MV zero).

    At decode the tensor cores buy nothing, and the MMA operand layout forces the dequantized
    tile through shared memory; here every word stays in the registers it was loaded into
    (one 2-D accumulator per token keeps every tensor in the load's layout).
    A code is turned into an exact fp32 by OR-ing it, unshifted, into the mantissa of 2^23
    (nibble i at bits 4i: value 2^23 + code·16^i, exact while the nibble stays below bit 23,
    so nibbles 5..7 are shifted down once per word). Subtracting 2^23 + zero·16^i leaves
    (code - zero)·16^i exactly, and the matching x is pre-scaled by 16^-i (exact). Per weight:
    one LOP3, one FADD, one FFMA per token; the group scale is applied once per K step.
    PTX (fp16 activations on CUDA): word columns w and w + BK/16 against their activations in
    fp16x2 instead (``_word2_dot``: about 2 instructions per weight instead of ~4.7), in fp32
    per word pair, in units of 1/16 that the scale takes back.
    """
    if PTX:
        UNIT: tl.constexpr = 16.0
        W: tl.constexpr = BK // 16  # the step's word columns in two halves
    else:
        UNIT: tl.constexpr = 1.0
        W: tl.constexpr = BK // 8
    offs_w = tl.arange(0, W)
    w_base = qw_ptr + n_ld[:, None] * (K // 8) + offs_w[None, :]
    if SYMMETRIC:
        z = tl.full((BN,), 8.0, tl.float32)
    else:
        z = tl.load(zeros_ptr + n_ld).to(tl.float32)
    a0 = tl.zeros((BN, W), tl.float32)
    a1 = tl.zeros((BN, W), tl.float32)
    a2 = tl.zeros((BN, W), tl.float32)
    a3 = tl.zeros((BN, W), tl.float32)
    for k in range(k_lo, k_hi, BK):
        p = tl.load(w_base + k // 8)
        if PTX:
            q = tl.load(w_base + k // 8 + W)
        else:
            hi = p >> 20
        if GROUP > 0:
            g = k // GROUP
            if not SYMMETRIC:
                z = tl.load(zeros_ptr + g * N + n_ld).to(tl.float32)
        s0, s1, s2, s3 = _step_sums(a0, a1, a2, a3, GROUP > 0)
        if PTX:
            # fp16 activations on CUDA: (code - zero)/16 · x per word pair in fp16x2 (_word2_dot)
            zn, zn16 = _neg_zero_pairs(z)
            zn = tl.broadcast_to(zn[:, None], (BN, W))
            zn16 = tl.broadcast_to(zn16[:, None], (BN, W))
            s0 = _ptx_token(s0, x_ptr, 0, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
            if MV > 1:
                s1 = _ptx_token(s1, x_ptr, 1, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
            if MV > 2:
                s2 = _ptx_token(s2, x_ptr, 2, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
                s3 = _ptx_token(s3, x_ptr, 3, stride_xm, k, offs_w, p, q, zn, zn16, M, W)
        else:
            for j in tl.static_range(8):
                # nibble j holds k-offset NIBBLE_K[j] = (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1)
                if j < 5:
                    bits = (p & (0xF << (4 * j))) | 0x4B000000
                    wj = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * j)))[:, None]
                    xs = 1.0 / (1 << (4 * j))
                else:
                    bits = (hi & (0xF << (4 * (j - 5)))) | 0x4B000000
                    wj = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * (j - 5))))[:, None]
                    xs = 1.0 / (1 << (4 * (j - 5)))
                koff = (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1)
                s0 = _fma_token(s0, x_ptr, 0, stride_xm, k, koff, offs_w, wj, xs, M)
                if MV > 1:
                    s1 = _fma_token(s1, x_ptr, 1, stride_xm, k, koff, offs_w, wj, xs, M)
                if MV > 2:
                    s2 = _fma_token(s2, x_ptr, 2, stride_xm, k, koff, offs_w, wj, xs, M)
                    s3 = _fma_token(s3, x_ptr, 3, stride_xm, k, koff, offs_w, wj, xs, M)
        if GROUP > 0:
            s = tl.load(scales_ptr + g * N + n_ld).to(tl.float32)[:, None] * UNIT
            a0, a1, a2, a3 = _add_scaled(a0, a1, a2, a3, s0, s1, s2, s3, s)
        else:
            a0, a1, a2, a3 = s0, s1, s2, s3
    if GROUP == 0:  # the caller applies the per-channel scale; the PTX sums are in units of 1/16
        a0 = a0 * UNIT
        a1 = a1 * UNIT
        a2 = a2 * UNIT
        a3 = a3 * UNIT
    return _tokens_to_accT(a0, a1, a2, a3, BM, MV, 1)
