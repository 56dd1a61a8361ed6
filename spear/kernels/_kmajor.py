"""CUDA-core main loop of the W4A16 GEMM over the K-major layout (``pack(..., layout="kmajor")``).

It returns accT [BN, BM] (output features x tokens) with every scale applied, so the
split-K reduction and the epilogue of w4a16.py (bias, fused compensator) are shared with
the N-major layout. The tensor-core tiles of both layouts are the same loop in w4a16.py:
only the word load and the order of ``_unpack_w4``'s join tree differ.

Decode, M <= MV <= 4 tokens. A K step is BK/8 rows of words by BN contiguous output
features, so a thread's 16-byte load holds 4 neighbouring columns that share the 8
activations of their row.
  * fp16 on CUDA (PTX, ``_ptx_loop``): the step is loaded as two half tiles [BK/16, BN]
    (rows j and j + BK/16), so each thread holds word pairs that ``_word2_dot`` takes
    together: codes to (code - zero)/16 with one LOP3 and one FMA per two codes, products
    against the activation pairs (the 32-bit words of x, one 16-byte load per row) in
    fp16x2, one conversion to fp32 per two words;
  * otherwise (bf16, the interpreter; ``_fma_loop``): the exact fp32 trick of
    ``_fma_mainloop`` (code OR-ed into the mantissa of 2^23, one subtraction, one FMA per
    weight and token) over the full [BK/8, BN] tile.
Accumulators stay in the load's layout and are reduced over K once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import (_add_scaled, _ld_v4, _neg_zero_pairs, _pdl_wait, _step_sums, _tokens_to_accT,
                                  _word2_dot)


@triton.jit
def _token_f32(acc, x_ptr, t, stride_xm, k, koff: tl.constexpr, offs_j, w, xs, M):
    xi = tl.load(x_ptr + t * stride_xm + k + 8 * offs_j + koff, mask=(offs_j * 0 + t) < M, other=0.0)
    return acc + w * (xi.to(tl.float32) * xs)[:, None]


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
              BM: tl.constexpr, MV: tl.constexpr, PREFETCH: tl.constexpr):
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
        # step k, so every program keeps two steps of code words in flight
        p, s, z = _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, k_lo, k_hi, N, s, z,
                          GROUP, SYMMETRIC)
    for k in tl.range(k_lo, k_hi, BK, num_stages=1):  # no software pipelining: the registers hold the prefetch
        if PREFETCH:
            pn, sn, zn = _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, k + BK, k_hi, N, s, z,
                                 GROUP, SYMMETRIC)
        else:
            p, s, z = _w_step(w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, k, k_hi, N, s, z,
                              GROUP, SYMMETRIC)
        s0, s1, s2, s3 = _step_sums(a0, a1, a2, a3, GROUP > 0)
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
            a0, a1, a2, a3 = _add_scaled(a0, a1, a2, a3, s0, s1, s2, s3, s[None, :])
        else:
            a0, a1, a2, a3 = s0, s1, s2, s3
        if PREFETCH:
            p, s, z = pn, sn, zn
    accT = _tokens_to_accT(a0, a1, a2, a3, BM, MV, 0)
    if GROUP == 0:
        accT = accT * tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return accT


@triton.jit
def _x_rows(x_ptr, t: tl.constexpr, stride_xm, k, rows, M, NC: tl.constexpr):
    """Token t's activations of each row at step k: 4 int32 words (fp16 pairs at k-offsets 2i,
    2i + 1), one 16-byte load per row. A token t >= M reads token 0's words and returns zeros."""
    if t > 0:
        tt = tl.where(t < M, t, 0)
    else:
        tt = 0
    w0, w1, w2, w3 = _ld_v4(x_ptr.to(tl.pointer_type(tl.int32)) + (tt * stride_xm + k) // 2 + 4 * rows, NC)
    if t > 0:
        live = (rows * 0 + t) < M
        w0 = tl.where(live, w0, 0)
        w1 = tl.where(live, w1, 0)
        w2 = tl.where(live, w2, 0)
        w3 = tl.where(live, w3, 0)
    return w0, w1, w2, w3


@triton.jit
def _token_rows(x_ptr, t: tl.constexpr, stride_xm, k, rows, H: tl.constexpr, M, NC: tl.constexpr = True):
    """``_x_rows`` of token t for both half tiles of step k (rows and rows + H)."""
    x0, x1, x2, x3 = _x_rows(x_ptr, t, stride_xm, k, rows, M, NC)
    y0, y1, y2, y3 = _x_rows(x_ptr, t, stride_xm, k, rows + H, M, NC)
    return x0, x1, x2, x3, y0, y1, y2, y3


@triton.jit
def _pair_dot(acc, p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3, s, GROUPED: tl.constexpr):
    """acc [BK/16, BN] += s * (word pairs (p, q) against their rows' activations x, y)."""
    shape: tl.constexpr = p.shape
    d = _word2_dot(p, q, zn, zn16,
                   tl.broadcast_to(x0[:, None], shape), tl.broadcast_to(x1[:, None], shape),
                   tl.broadcast_to(x2[:, None], shape), tl.broadcast_to(x3[:, None], shape),
                   tl.broadcast_to(y0[:, None], shape), tl.broadcast_to(y1[:, None], shape),
                   tl.broadcast_to(y2[:, None], shape), tl.broadcast_to(y3[:, None], shape))
    if GROUPED:
        return acc + s[None, :] * d
    else:
        return acc + d


@triton.jit
def _ptx_step(w_lo, w_hi, n_mask2, scales_ptr, zeros_ptr, offs_n, n_mask, k, N, sz,
              GROUP: tl.constexpr, SYMMETRIC: tl.constexpr):
    """Step k's half tiles of code words and, per group, its scales and zero points as one
    int32 per column (fp16 scale bits | zero << 16)."""
    p = tl.load(w_lo + (k // 8) * N, mask=n_mask2, other=0)
    q = tl.load(w_hi + (k // 8) * N, mask=n_mask2, other=0)
    if GROUP > 0:
        g = k // GROUP
        sz = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        sz = sz & 0xFFFF
        if SYMMETRIC:
            sz = sz | (8 << 16)
        else:
            sz = sz | (tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.int32) << 16)
    return p, q, sz


@triton.jit
def _scale_zero(sz, H: tl.constexpr, BN: tl.constexpr):
    """[BN] scale * 16 (fp32) and [H, BN] ``_neg_zero_pairs`` from ``_ptx_step``'s words."""
    s16 = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16.0
    zn, zn16 = _neg_zero_pairs((sz >> 16).to(tl.float32))
    return s16, tl.broadcast_to(zn[None, :], (H, BN)), tl.broadcast_to(zn16[None, :], (H, BN))


@triton.jit
def _ptx_loop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, k_lo, k_hi, M, N, stride_xm,
              GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              BM: tl.constexpr, MV: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    """The fp16 CUDA loop (module docstring). With PREFETCH, the loads of step k + BK (clamped
    to the last step, so no load is masked by K) are issued before the math of step k; with PDL
    the first step's weights are loaded before waiting for the kernel that wrote x."""
    H: tl.constexpr = BK // 16
    NC: tl.constexpr = True  # activations through the read-only cache: no kernel writes x meanwhile (_ld_v4)
    rows = tl.arange(0, H)
    w_lo = qw_ptr + rows[:, None] * N + offs_n[None, :]
    w_hi = w_lo + H * N
    n_mask2 = (rows[:, None] >= 0) & n_mask[None, :]
    # per-channel zero points (or 8): fixed for the whole loop
    if SYMMETRIC:
        sz = tl.full((BN,), 8 << 16, tl.int32)
    else:
        sz = tl.load(zeros_ptr + offs_n, mask=n_mask, other=0).to(tl.int32) << 16
    s16, zn, zn16 = _scale_zero(sz, H, BN)
    a0 = tl.zeros((H, BN), tl.float32)
    a1 = tl.zeros((H, BN), tl.float32)
    a2 = tl.zeros((H, BN), tl.float32)
    a3 = tl.zeros((H, BN), tl.float32)
    # the last step of the range, in bounds even when the range is empty (k_lo >= K for the
    # last splits of a K that the split does not divide; k_hi >= BK always)
    k_last = k_hi - BK
    if PREFETCH:
        k0 = tl.minimum(k_lo, k_last)
        p, q, sz = _ptx_step(w_lo, w_hi, n_mask2, scales_ptr, zeros_ptr, offs_n, n_mask, k0, N, sz,
                             GROUP, SYMMETRIC)
        _pdl_wait(PDL)
        x0, x1, x2, x3, y0, y1, y2, y3 = _token_rows(x_ptr, 0, stride_xm, k0, rows, H, M, NC)
        if MV > 1:
            u0, u1, u2, u3, v0, v1, v2, v3 = _token_rows(x_ptr, 1, stride_xm, k0, rows, H, M, NC)
    for k in tl.range(k_lo, k_hi, BK, num_stages=1):  # no software pipelining: the registers hold the prefetch
        if PREFETCH:
            kn = tl.minimum(k + BK, k_last)
            pn, qn, szn = _ptx_step(w_lo, w_hi, n_mask2, scales_ptr, zeros_ptr, offs_n, n_mask, kn, N, sz,
                                    GROUP, SYMMETRIC)
            nx0, nx1, nx2, nx3, ny0, ny1, ny2, ny3 = _token_rows(x_ptr, 0, stride_xm, kn, rows, H, M, NC)
            if MV > 1:
                nu0, nu1, nu2, nu3, nv0, nv1, nv2, nv3 = _token_rows(x_ptr, 1, stride_xm, kn, rows, H, M, NC)
        else:
            p, q, sz = _ptx_step(w_lo, w_hi, n_mask2, scales_ptr, zeros_ptr, offs_n, n_mask, k, N, sz,
                                 GROUP, SYMMETRIC)
            x0, x1, x2, x3, y0, y1, y2, y3 = _token_rows(x_ptr, 0, stride_xm, k, rows, H, M, NC)
            if MV > 1:
                u0, u1, u2, u3, v0, v1, v2, v3 = _token_rows(x_ptr, 1, stride_xm, k, rows, H, M, NC)
        if GROUP > 0:
            s16, zn, zn16 = _scale_zero(sz, H, BN)
        a0 = _pair_dot(a0, p, q, zn, zn16, x0, x1, x2, x3, y0, y1, y2, y3, s16, GROUP > 0)
        if MV > 1:
            a1 = _pair_dot(a1, p, q, zn, zn16, u0, u1, u2, u3, v0, v1, v2, v3, s16, GROUP > 0)
        if MV > 2:
            # tokens 2 and 3 (M = 3, 4 only): activations loaded at the step that uses them
            c0, c1, c2, c3, d0, d1, d2, d3 = _token_rows(x_ptr, 2, stride_xm, k, rows, H, M, NC)
            a2 = _pair_dot(a2, p, q, zn, zn16, c0, c1, c2, c3, d0, d1, d2, d3, s16, GROUP > 0)
            c0, c1, c2, c3, d0, d1, d2, d3 = _token_rows(x_ptr, 3, stride_xm, k, rows, H, M, NC)
            a3 = _pair_dot(a3, p, q, zn, zn16, c0, c1, c2, c3, d0, d1, d2, d3, s16, GROUP > 0)
        if PREFETCH:
            p, q, sz = pn, qn, szn
            x0, x1, x2, x3, y0, y1, y2, y3 = nx0, nx1, nx2, nx3, ny0, ny1, ny2, ny3
            if MV > 1:
                u0, u1, u2, u3, v0, v1, v2, v3 = nu0, nu1, nu2, nu3, nv0, nv1, nv2, nv3
    accT = _tokens_to_accT(a0, a1, a2, a3, BM, MV, 0)
    if GROUP == 0:  # the sums are in units of 1/16
        accT = accT * (tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) * 16.0)[:, None]
    return accT


@triton.jit
def _kmajor_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n0, k_lo, k_hi, M, N, stride_xm,
                     GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     BM: tl.constexpr, MV: tl.constexpr, PTX: tl.constexpr, PREFETCH: tl.constexpr,
                     PDL: tl.constexpr = False):
    """accT [BN, BM] for output features n0 .. n0 + BN over K range [k_lo, k_hi), scales applied."""
    # Output features are contiguous here: the hints (and no modulo on the offsets) give each
    # thread 16-byte loads; columns past N are masked (only a layer's last tile has any).
    offs_n = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BN), BN), BN)
    n_mask = offs_n < N
    if PTX:
        return _ptx_loop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, k_lo, k_hi, M, N, stride_xm,
                         GROUP, SYMMETRIC, BN, BK, BM, MV, PREFETCH, PDL)
    offs_j = tl.arange(0, BK // 8)
    w_ptrs = qw_ptr + offs_j[:, None] * N + offs_n[None, :]
    w_mask = (offs_j[:, None] >= 0) & n_mask[None, :]
    return _fma_loop(x_ptr, w_ptrs, w_mask, scales_ptr, zeros_ptr, offs_n, n_mask, offs_j, k_lo, k_hi, M, N,
                     stride_xm, GROUP, SYMMETRIC, BN, BK, BM, MV, PREFETCH)
