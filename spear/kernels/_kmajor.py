"""CUDA-core main loop of the W4A16 GEMM over the K-major layout (``pack(..., kmajor=True)``).

It returns accT [BN, BM] (output features x tokens) with every scale applied, so the
split-K reduction and the epilogue of w4a16.py (bias, fused compensator) are shared with
the N-major layout. The tensor-core tiles of both layouts are the same loop in w4a16.py:
only the word load and the order of ``_unpack_w4``'s join tree differ.

Decode, M <= MV <= 4 tokens. The program's tile is [BK/8, BN] words: BK/8 rows of K, BN
contiguous output features, so a thread's 16-byte load holds 4 neighbouring columns that
share the 8 activations of their row. Per word:
  * fp16 on CUDA (PTX): ``_word_dot`` takes the 4 code pairs (k-offsets 2i, 2i+1) as fp16x2
    registers, turns them into (code - zero)/16 with one fused multiply-add each, and
    multiplies them against the activation pairs, which are simply the 32-bit words of x;
  * otherwise (bf16, the interpreter): the exact fp32 trick of ``_fma_mainloop`` (code
    OR-ed into the mantissa of 2^23, one subtraction, one FMA per weight and token).
Accumulators stay [BK/8, BN] in the load's layout and are reduced over K once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import _add_scaled, _neg_zero_pair, _step_sums, _tokens_to_accT, _word_dot


@triton.jit
def _token_f32(acc, x_ptr, t, stride_xm, k, koff: tl.constexpr, offs_j, w, xs, M):
    xi = tl.load(x_ptr + t * stride_xm + k + 8 * offs_j + koff, mask=(offs_j * 0 + t) < M, other=0.0)
    return acc + w * (xi.to(tl.float32) * xs)[:, None]


@triton.jit
def _x_words(x_ptr, t, stride_xm, k, offs_j, k_hi, M):
    """Token t's activation pairs (k-offsets 2i, 2i+1) of every row j at step k: the int32 words of x."""
    m = ((offs_j * 0 + t) < M) & ((offs_j * 0 + k) < k_hi)
    xb = x_ptr.to(tl.pointer_type(tl.int32)) + (t * stride_xm + k) // 2 + 4 * offs_j
    return (tl.load(xb, mask=m, other=0), tl.load(xb + 1, mask=m, other=0), tl.load(xb + 2, mask=m, other=0),
            tl.load(xb + 3, mask=m, other=0))


@triton.jit
def _x_tokens(x_ptr, stride_xm, k, offs_j, k_hi, M, MV: tl.constexpr):
    """``_x_words`` of step k for tokens 0 .. MV - 1, 4 per token (token 0's stand in for absent ones)."""
    x00, x01, x02, x03 = _x_words(x_ptr, 0, stride_xm, k, offs_j, k_hi, M)
    x10, x11, x12, x13 = x00, x01, x02, x03
    x20, x21, x22, x23 = x00, x01, x02, x03
    x30, x31, x32, x33 = x00, x01, x02, x03
    if MV > 1:
        x10, x11, x12, x13 = _x_words(x_ptr, 1, stride_xm, k, offs_j, k_hi, M)
    if MV > 2:
        x20, x21, x22, x23 = _x_words(x_ptr, 2, stride_xm, k, offs_j, k_hi, M)
        x30, x31, x32, x33 = _x_words(x_ptr, 3, stride_xm, k, offs_j, k_hi, M)
    return x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33


@triton.jit
def _token_ptx(acc, p, zneg, x0, x1, x2, x3):
    shape: tl.constexpr = p.shape
    return acc + _word_dot(p, zneg, tl.broadcast_to(x0[:, None], shape), tl.broadcast_to(x1[:, None], shape),
                           tl.broadcast_to(x2[:, None], shape), tl.broadcast_to(x3[:, None], shape))


@triton.jit
def _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, k, k_hi, N, s, z,
            GROUP: tl.constexpr, SYMMETRIC: tl.constexpr):
    """The loads of step k (nothing past k_hi): code words, and per group the scales (and zero points)."""
    live = (offs_n * 0 + k) < k_hi
    p = tl.load(w_ptrs + (k // 8) * N, mask=w_mask & live[None, :], other=0)
    if GROUP > 0:
        g = k // GROUP
        s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask & live, other=0.0).to(tl.float32)
        if not SYMMETRIC:
            z = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask & live, other=0).to(tl.float32)
    return p, s, z


@triton.jit
def _fma_loop(x_ptr, w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, offs_j, k_lo, k_hi, M, N, stride_xm,
              GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              BM: tl.constexpr, MV: tl.constexpr, PTX: tl.constexpr, PREFETCH: tl.constexpr):
    if PTX:
        UNIT: tl.constexpr = 16.0  # the PTX sums are in units of 1/16
    else:
        UNIT: tl.constexpr = 1.0
    if SYMMETRIC:
        z = tl.full((BN,), 8.0, tl.float32)
    else:
        z = tl.load(zeros_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
    s = tl.full((BN,), 1.0, tl.float32)  # per-channel scales: applied after the loop
    a0 = tl.zeros((BK // 8, BN), tl.float32)
    a1 = tl.zeros((BK // 8, BN), tl.float32)
    a2 = tl.zeros((BK // 8, BN), tl.float32)
    a3 = tl.zeros((BK // 8, BN), tl.float32)
    if PREFETCH:
        # software pipelining in registers: the loads of step k + BK are issued before the math of
        # step k, so every program keeps two steps of code words (and activations) in flight
        p, s, z = _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, k_lo, k_hi, N, s, z,
                          GROUP, SYMMETRIC)
        if PTX:
            (x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33) = \
                _x_tokens(x_ptr, stride_xm, k_lo, offs_j, k_hi, M, MV)
    for k in range(k_lo, k_hi, BK):
        if PREFETCH:
            kn = k + BK
            pn, sn, zn = _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, kn, k_hi, N, s, z,
                                 GROUP, SYMMETRIC)
        else:
            p, s, z = _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, k, k_hi, N, s, z,
                              GROUP, SYMMETRIC)
        s0, s1, s2, s3 = _step_sums(a0, a1, a2, a3, GROUP > 0)
        if PTX:
            if PREFETCH:
                (y00, y01, y02, y03, y10, y11, y12, y13, y20, y21, y22, y23, y30, y31, y32, y33) = \
                    _x_tokens(x_ptr, stride_xm, kn, offs_j, k_hi, M, MV)
            else:
                (x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33) = \
                    _x_tokens(x_ptr, stride_xm, k, offs_j, k_hi, M, MV)
            zneg = tl.broadcast_to(_neg_zero_pair(z)[None, :], (BK // 8, BN))
            s0 = _token_ptx(s0, p, zneg, x00, x01, x02, x03)
            if MV > 1:
                s1 = _token_ptx(s1, p, zneg, x10, x11, x12, x13)
            if MV > 2:
                s2 = _token_ptx(s2, p, zneg, x20, x21, x22, x23)
                s3 = _token_ptx(s3, p, zneg, x30, x31, x32, x33)
            if PREFETCH:
                x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33 = \
                    y00, y01, y02, y03, y10, y11, y12, y13, y20, y21, y22, y23, y30, y31, y32, y33
        else:
            hi = p >> 20
            for i in tl.static_range(8):
                # nibble i at bits 4i: 2^23 + code * 16^i is exact up to nibble 4; 5..7 from p >> 20
                if i < 5:
                    bits = (p & (0xF << (4 * i))) | 0x4B000000
                    w = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * i)))[None, :]
                    xs = 1.0 / (1 << (4 * i))
                else:
                    bits = (hi & (0xF << (4 * (i - 5)))) | 0x4B000000
                    w = bits.to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << (4 * (i - 5))))[None, :]
                    xs = 1.0 / (1 << (4 * (i - 5)))
                # k-offset of nibble i: KMAJOR_NIBBLE_K[i] = 2 (i % 4) + i // 4
                s0 = _token_f32(s0, x_ptr, 0, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
                if MV > 1:
                    s1 = _token_f32(s1, x_ptr, 1, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
                if MV > 2:
                    s2 = _token_f32(s2, x_ptr, 2, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
                    s3 = _token_f32(s3, x_ptr, 3, stride_xm, k, 2 * (i % 4) + i // 4, offs_j, w, xs, M)
        if GROUP > 0:
            a0, a1, a2, a3 = _add_scaled(a0, a1, a2, a3, s0, s1, s2, s3, s[None, :] * UNIT)
        else:
            a0, a1, a2, a3 = s0, s1, s2, s3
        if PREFETCH:
            p, s, z = pn, sn, zn
    accT = _tokens_to_accT(a0, a1, a2, a3, BM, MV, 0)
    if GROUP == 0:
        accT = accT * (tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) * UNIT)[:, None]
    return accT


@triton.jit
def _kmajor_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n0, k_lo, k_hi, M, N, stride_xm,
                     GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     BM: tl.constexpr, MV: tl.constexpr, PTX: tl.constexpr, PREFETCH: tl.constexpr):
    """accT [BN, BM] for output features n0 .. n0 + BN over K range [k_lo, k_hi), scales applied."""
    # Output features are contiguous here: the hints (and no modulo on the offsets) give each
    # thread 16-byte loads; columns past N are masked (only a layer's last tile has any).
    offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BN), BN), BN)
    n_mask = offs_n < N
    offs_j = tl.arange(0, BK // 8)
    w_ptrs = qw_ptr + offs_j[:, None] * N + offs_n[None, :]
    w_mask = (offs_j[:, None] >= 0) & n_mask[None, :]
    return _fma_loop(x_ptr, w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, offs_j, k_lo, k_hi, M, N,
                     stride_xm, GROUP, SYMMETRIC, BN, BK, BM, MV, PTX, PREFETCH)
