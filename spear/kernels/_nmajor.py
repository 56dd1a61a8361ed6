"""Main loops of the W4A16 GEMM over the N-major fallback layout (``Layout.NMAJOR``: the shapes
the fragment layout refuses, layout.py): output features along rows, each row's K as consecutive
int32 words. Both return accT [BN, BM] with every scale applied, for the split-K reduction and
epilogue of w4a16.py:

  * tensor-core tiles (MV = 0): the [BN, BK] tile unpacked on chip (``_unpack_w4``), the zero point
    and group scale applied in the activation dtype, accT += W · xT in fp32;
  * one token on CUDA cores (MV = 1, ``_gemv_mainloop``): at decode the tensor cores buy nothing
    and the MMA operand layout forces the dequantized tile through shared memory; here every word
    stays in the registers it was loaded into.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import _column0, _dequant, _dot, _neg_zero_pairs, _unpack_w4, _word2_dot


@triton.jit
def _x_pair(base, lo: tl.constexpr, hi: tl.constexpr):
    """fp16 activations at base + lo and base + hi as one int32 (lo in the low half)."""
    a = tl.load(base + lo).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = tl.load(base + hi).to(tl.int16, bitcast=True).to(tl.int32)
    return a | (b << 16)


@triton.jit
def _x_pairs(base, shape: tl.constexpr):
    """The activation pairs of one word per column, broadcast over the tile's rows: nibble pairs
    (0,4), (1,5), (2,6), (3,7) hold k-offsets (0,4), (2,6), (1,5), (3,7) (NIBBLE_K)."""
    return (tl.broadcast_to(_x_pair(base, 0, 4)[None, :], shape),
            tl.broadcast_to(_x_pair(base, 2, 6)[None, :], shape),
            tl.broadcast_to(_x_pair(base, 1, 5)[None, :], shape),
            tl.broadcast_to(_x_pair(base, 3, 7)[None, :], shape))


@triton.jit
def _gemv_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n_ld, k_lo, k_hi, N, K,
                   GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   BM: tl.constexpr, PTX: tl.constexpr):
    """CUDA-core main loop for one token; returns accT [BN, BM] (columns >= 1 zero), scaled per
    group (the caller applies a per-channel scale).

    A code is turned into an exact fp32 by OR-ing it, unshifted, into the mantissa of 2^23
    (nibble i at bits 4i: value 2^23 + code·16^i, exact while the nibble stays below bit 23,
    so nibbles 5..7 are shifted down once per word). Subtracting 2^23 + zero·16^i leaves
    (code - zero)·16^i exactly, and the matching x is pre-scaled by 16^-i (exact). Per weight:
    one LOP3, one FADD, one FFMA; the group scale is applied once per K step.
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
    acc = tl.zeros((BN, W), tl.float32)
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
            s0 = tl.zeros((BN, W), tl.float32)  # the step's own sums, scaled after it
        else:
            s0 = acc
        if PTX:
            # fp16 activations on CUDA: (code - zero)/16 · x per word pair in fp16x2 (_word2_dot)
            zn, zn16 = _neg_zero_pairs(z)
            zn = tl.broadcast_to(zn[:, None], (BN, W))
            zn16 = tl.broadcast_to(zn16[:, None], (BN, W))
            base = x_ptr + k + 8 * offs_w
            x0, x1, x2, x3 = _x_pairs(base, p.shape)
            y0, y1, y2, y3 = _x_pairs(base + 8 * W, p.shape)
            s0 += _word2_dot(p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3)
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
                xj = tl.load(x_ptr + k + 8 * offs_w + koff)
                s0 += wj * (xj.to(tl.float32) * xs)[None, :]
        if GROUP > 0:
            acc += tl.load(scales_ptr + g * N + n_ld).to(tl.float32)[:, None] * UNIT * s0
        else:
            acc = s0
    if GROUP == 0:  # the PTX sums are in units of 1/16
        acc = acc * UNIT
    return _column0(acc, BM)


@triton.jit
def _nmajor_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, k_lo, k_hi, offs_m, m_mask, offs_n, n_ld, N, K,
                     stride_xm, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MV: tl.constexpr, DOT_F32: tl.constexpr,
                     PTX: tl.constexpr):
    """accT [BN, BM] of output features ``offs_n`` (``n_ld`` in bounds) over one K range, scales
    applied: the one-token loop (MV 1) or the tensor-core tiles (module docstring)."""
    if IS_BF16:
        zbase = 128.0
    else:
        zbase = 1024.0
    s = tl.load(scales_ptr + n_ld).to(tl.float32)
    if SYMMETRIC:
        zc = tl.full((BN,), zbase + 8.0, tl.float32)
    else:
        zc = zbase + tl.load(zeros_ptr + n_ld).to(tl.float32)
    if MV > 0:
        accT = _gemv_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n_ld, k_lo, k_hi, N, K, GROUP, SYMMETRIC, BN,
                              BK, BM, PTX)
    else:
        x_base = x_ptr + offs_m[None, :] * stride_xm + tl.arange(0, BK)[:, None]
        w_base = qw_ptr + n_ld[:, None] * (K // 8) + tl.arange(0, BK // 8)[None, :]
        accT = tl.zeros((BN, BM), tl.float32)
        for k in range(k_lo, k_hi, BK):
            p = tl.load(w_base + k // 8)
            if GROUP > 0:
                g = k // GROUP
                s = tl.load(scales_ptr + g * N + n_ld).to(tl.float32)
                if not SYMMETRIC:
                    zc = zbase + tl.load(zeros_ptr + g * N + n_ld).to(tl.float32)
            w = _dequant(_unpack_w4(p, BN, BK, IS_BF16), zc, s, GROUP > 0, IS_BF16)
            xt = tl.load(x_base + k, mask=m_mask[None, :], other=0.0)
            accT = _dot(w, xt, accT, DOT_F32)
    if GROUP == 0:
        accT = accT * s[:, None]
    return accT
