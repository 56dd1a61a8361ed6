"""CUDA-core main loop of the W4A16 GEMM over the fragment layout (``pack(..., layout="mma")``),
for decode's 1-4 tokens (M <= MV). It returns accT [BN, BM] with every scale applied, so the
split-K reduction, the fused compensator and the epilogue of w4a16.py are those of the other
loops; the tensor-core loop of the same layout (_mma.py) takes larger token counts.

What a thread holds. A step is BK inputs (KB = BK / 64 blocks) of BN output features (T = BN / 16
tiles of 16 rows). The step's words are loaded as [T, KB, 8 (g), 4 (q), 4 (c)]: the four words of
one lane l = 4g + q are contiguous, so each thread's load is one 16-byte vector holding rows
g and g + 8 of its tile times 16 inputs of its 64-input block: for each k16 chunk c the
input pairs 16c + 2q + (0, 1) (word nibbles (0, 4): row g; (1, 5): row g + 8) and
16c + 8 + 2q + (0, 1) (nibbles (2, 6): row g; (3, 7): row g + 8). The activations those
pairs meet are 8 int32 words of x (fp16/bf16 pairs), x32[32 kb + 8c + q] and x32[32 kb + 8c + 4 + q],
the same for every row g and tile t: a warp's 8 g-lanes read the same words (one transaction) and
a thread reuses them over the tiles it holds.

Products. Every word feeds two rows, so each thread keeps two fp32 accumulators per token (rows g
and g + 8) per chunk it holds, and reduces them over q (the lanes of one row) and the K blocks
once, after the loop.
  * fp16 on CUDA (PTX): ``_frag_dq`` turns a word into its four code pairs as fp16x2
    (code - zero)/16 with one LOP3 and one FMA a pair (the exponent trick of _common._word2_dot:
    the mask 0x000F000F takes nibbles (j, j + 4) as 1024 + code, the mask 0x00F000F0 takes the
    odd pairs as 1024 + 16 code without a shift); the pairs are made once a step and shared by
    the tokens. ``_frag_dot`` multiplies a chunk's 16 pairs with the token's 8 activation words
    in fp16x2, 8 products a lane into one accumulator per row (as the K-major loop), then one
    conversion to fp32 per row. Groups of 32 split the sums at c = 2 (two groups in a chunk).
    Sums are in units of 1/16, which the scale (times 16) takes back. Both are in _frag_fma_ptx.py.
  * otherwise (bf16, the interpreter): exact fp32. A code OR-ed into the mantissa of 2^23
    (nibble i at bits 4i, i < 5; nibbles 5..7 shifted down once a word) and one FMA with
    constants gives the code itself; one FMA a token accumulates code · x, and the zero point
    comes off once a chunk as zero · (sum of the chunk's activations), which every row shares.
Per group, the step's sums are scaled in fp32 and added to the running accumulators; the
per-channel scale is applied once after the loop.

With PREFETCH, the loads of step k + BK (words, scales, zero points, the first two tokens'
activations) are issued before the math of step k (the K-major loop's register prefetch);
with PDL, the first step's words are loaded before waiting for the kernel that wrote x.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spear.kernels._common import _neg_zero_pairs, _pdl_wait
from spear.kernels._frag_fma_ptx import _frag_dot, _frag_dq


@triton.jit
def _split4(p, T: tl.constexpr, KB: tl.constexpr):
    """[T, KB, 8, 4, 4] words (a lane's 16-byte load last) -> the four words c = 0..3, [T, KB, 8, 4]
    each."""
    r = tl.reshape(p, (T, KB, 8, 4, 2, 2))
    ev, od = tl.split(r)  # c even, c odd: [..., c // 2]
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    return w0, w1, w2, w3


@triton.jit
def _ld_table(ptrs, ASM: tl.constexpr):
    """Scales (fp16) or zero points (uint8) at ``ptrs``. On CUDA through inline PTX: Triton gives a
    tl.load of at least as many elements as the program has threads a layout of its own, and the
    step's words were then converted to it through shared memory every step (sm_90 PTX of a
    [4, 2, 8, 1] scale load at 2 warps); an inline-asm load takes the layout of its users."""
    if ASM:
        if ptrs.dtype.element_ty == tl.float16:
            return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptrs], dtype=tl.float16,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                             is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _group_rows(ptr, k, kb4, rows_lo, N, HALF: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr,
                ASM: tl.constexpr):
    """fp32 values of rows g and g + 8 in a (groups, N) table for the group of each chunk of step
    k (HALF 1: its second half, groups of 32): [T, 1, 8, 1] when the step lies in one group, else
    [T, KB, 8, 1]."""
    if GROUP >= BK:
        g_off = (k // GROUP) * N
    else:
        g_off = ((k + 64 * kb4 + 32 * HALF) // GROUP) * N
    lo = _ld_table(ptr + g_off + rows_lo, ASM).to(tl.float32)
    hi = _ld_table(ptr + g_off + rows_lo + 8, ASM).to(tl.float32)
    return lo, hi


@triton.jit
def _load_step(w_ptrs, scales_ptr, zeros_ptr, k, kb4, rows_lo, N, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1,
               z_lo1, z_hi1, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
    """Step k's words and, per group, its scales and zero points (rows g, g + 8; half 1 the
    second group of a chunk, groups of 32); per channel the values passed in."""
    p = tl.load(w_ptrs + 2 * k)
    if GROUP > 0:
        s_lo0, s_hi0 = _group_rows(scales_ptr, k, kb4, rows_lo, N, 0, GROUP, BK, ASM)
        if not SYMMETRIC:
            z_lo0, z_hi0 = _group_rows(zeros_ptr, k, kb4, rows_lo, N, 0, GROUP, BK, ASM)
        if GROUP == 32:
            s_lo1, s_hi1 = _group_rows(scales_ptr, k, kb4, rows_lo, N, 1, GROUP, BK, ASM)
            if not SYMMETRIC:
                z_lo1, z_hi1 = _group_rows(zeros_ptr, k, kb4, rows_lo, N, 1, GROUP, BK, ASM)
        else:
            s_lo1, s_hi1, z_lo1, z_hi1 = s_lo0, s_hi0, z_lo0, z_hi0
    return p, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1


@triton.jit
def _x_words(x32, t: tl.constexpr, stride_xm, k, xo, M):
    """Token t's activation words of step k: for each chunk c, x32[32 kb + 8c + q] (A) and
    x32[32 kb + 8c + 4 + q] (B), as [1, KB, 1, 4] (``xo`` = 32 kb + q). Tokens t >= M read zeros."""
    base = x32 + (t * stride_xm + k) // 2 + xo
    if t > 0:
        live = (xo * 0 + t) < M
        return (tl.load(base, mask=live, other=0), tl.load(base + 4, mask=live, other=0),
                tl.load(base + 8, mask=live, other=0), tl.load(base + 12, mask=live, other=0),
                tl.load(base + 16, mask=live, other=0), tl.load(base + 20, mask=live, other=0),
                tl.load(base + 24, mask=live, other=0), tl.load(base + 28, mask=live, other=0))
    else:
        return (tl.load(base), tl.load(base + 4), tl.load(base + 8), tl.load(base + 12), tl.load(base + 16),
                tl.load(base + 20), tl.load(base + 24), tl.load(base + 28))


@triton.jit
def _pair_f32(w, IS_BF16: tl.constexpr):
    """The two 16-bit floats of int32 words as fp32 (low half, high half), exactly."""
    if IS_BF16:
        return (w << 16).to(tl.float32, bitcast=True), ((w >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi


@triton.jit
def _code(p, hi, i: tl.constexpr):
    """Nibble i of words p (``hi`` = p >> 20) as an exact fp32: 2^23 + code · 16^i' (i' = i, or
    i - 5 from ``hi``) scaled by 16^-i' less 2^23 · 16^-i'; both steps exact."""
    if i < 5:
        bits = (p & (0xF << (4 * i))) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) * (1.0 / (1 << (4 * i))) - 8388608.0 / (1 << (4 * i))
    else:
        bits = (hi & (0xF << (4 * (i - 5)))) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) * (1.0 / (1 << (4 * (i - 5)))) - 8388608.0 / (1 << (4 * (i - 5)))


@triton.jit
def _codes_dot(lo, hi, v0, v1, v2, v3, v4, v5, v6, v7, xa, xb, IS_BF16: tl.constexpr, FIRST: tl.constexpr):
    """(lo, hi) + one word's codes v (nibble order) times its activations: pairs 0, 2 (row g) and
    1, 3 (row g + 8) against words A (pairs 0, 1) and B (pairs 2, 3) of x, the low half for
    nibbles 0..3. FIRST: the sums start here (lo, hi unused)."""
    a_lo, a_hi = _pair_f32(xa, IS_BF16)
    b_lo, b_hi = _pair_f32(xb, IS_BF16)
    if FIRST:
        lo = v0 * a_lo + v2 * b_lo + v4 * a_hi + v6 * b_hi
        hi = v1 * a_lo + v3 * b_lo + v5 * a_hi + v7 * b_hi
    else:
        lo = lo + v0 * a_lo + v2 * b_lo + v4 * a_hi + v6 * b_hi
        hi = hi + v1 * a_lo + v3 * b_lo + v5 * a_hi + v7 * b_hi
    return lo, hi


@triton.jit
def _word_tokens(l0, h0, l1, h1, l2, h2, l3, h3, p, xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3,
                 MV: tl.constexpr, IS_BF16: tl.constexpr, FIRST: tl.constexpr):
    """The exact fp32 path's sums (rows g, g + 8 of each token) plus one word's codes against its
    activation words (xa_t, xb_t of token t). Word by word, every token at once, so that only one
    word's codes need to be live."""
    hi = p >> 20
    v0 = _code(p, hi, 0)
    v1 = _code(p, hi, 1)
    v2 = _code(p, hi, 2)
    v3 = _code(p, hi, 3)
    v4 = _code(p, hi, 4)
    v5 = _code(p, hi, 5)
    v6 = _code(p, hi, 6)
    v7 = _code(p, hi, 7)
    l0, h0 = _codes_dot(l0, h0, v0, v1, v2, v3, v4, v5, v6, v7, xa0, xb0, IS_BF16, FIRST)
    if MV > 1:
        l1, h1 = _codes_dot(l1, h1, v0, v1, v2, v3, v4, v5, v6, v7, xa1, xb1, IS_BF16, FIRST)
    if MV > 2:
        l2, h2 = _codes_dot(l2, h2, v0, v1, v2, v3, v4, v5, v6, v7, xa2, xb2, IS_BF16, FIRST)
        l3, h3 = _codes_dot(l3, h3, v0, v1, v2, v3, v4, v5, v6, v7, xa3, xb3, IS_BF16, FIRST)
    return l0, h0, l1, h1, l2, h2, l3, h3


@triton.jit
def _x_sum(xa, xb, IS_BF16: tl.constexpr):
    a_lo, a_hi = _pair_f32(xa, IS_BF16)
    b_lo, b_hi = _pair_f32(xb, IS_BF16)
    return (a_lo + a_hi) + (b_lo + b_hi)


@triton.jit
def _scaled_add(acc_lo, acc_hi, lo, hi, lo1, hi1, s_lo0, s_hi0, s_lo1, s_hi1, GROUPED: tl.constexpr,
                SPLIT: tl.constexpr):
    """The accumulators plus one step's sums, times their group scales (per channel: scaled once
    after the loop)."""
    if GROUPED:
        acc_lo += s_lo0 * lo
        acc_hi += s_hi0 * hi
        if SPLIT:
            acc_lo += s_lo1 * lo1
            acc_hi += s_hi1 * hi1
    else:
        acc_lo += lo
        acc_hi += hi
    return acc_lo, acc_hi


@triton.jit
def _finish_fma(acc_lo, acc_hi, lo, hi, lo1, hi1, a0, b0, a1, b1, a2, b2, a3, b3, s_lo0, s_hi0, z_lo0, z_hi0,
                s_lo1, s_hi1, z_lo1, z_hi1, GROUPED: tl.constexpr, SPLIT: tl.constexpr, IS_BF16: tl.constexpr):
    """One token's step on the exact fp32 path from its sums of code · x (lo, hi; SPLIT: words 0, 1
    and 2, 3 apart): the zero point times the sum of the activations off, the group scale on."""
    sx0 = _x_sum(a0, b0, IS_BF16) + _x_sum(a1, b1, IS_BF16)
    if SPLIT:  # groups of 32: words 2, 3 are the next group
        sx1 = _x_sum(a2, b2, IS_BF16) + _x_sum(a3, b3, IS_BF16)
        lo1 = lo1 - z_lo1 * sx1
        hi1 = hi1 - z_hi1 * sx1
    else:
        sx0 += _x_sum(a2, b2, IS_BF16) + _x_sum(a3, b3, IS_BF16)
    lo = lo - z_lo0 * sx0
    hi = hi - z_hi0 * sx0
    return _scaled_add(acc_lo, acc_hi, lo, hi, lo1, hi1, s_lo0, s_hi0, s_lo1, s_hi1, GROUPED, SPLIT)


@triton.jit
def _token_ptx(acc_lo, acc_hi, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3,
               a0, b0, a1, b1, a2, b2, a3, b3, s_lo0, s_hi0, s_lo1, s_hi1, GROUPED: tl.constexpr, SPLIT: tl.constexpr):
    """One token's step on the fp16x2 path: d, e, f, h the pairs of words 0..3 (``_frag_dq``); the
    scales times 16 (the sums' unit)."""
    lo, hi, lo1, hi1 = _frag_dot(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3,
                                 a0, b0, a1, b1, a2, b2, a3, b3, SPLIT)
    return _scaled_add(acc_lo, acc_hi, lo, hi, lo1, hi1, s_lo0, s_hi0, s_lo1, s_hi1, GROUPED, SPLIT)


@triton.jit
def _rows(acc_lo, acc_hi, BN: tl.constexpr):
    """[BN] sums of each output row from [T, KB, 8, 4] accumulators of rows g and g + 8: over the
    four lanes of a row and the K blocks, then row 16 t + 8 j + g."""
    lo = tl.sum(tl.sum(acc_lo, axis=3), axis=1)
    hi = tl.sum(tl.sum(acc_hi, axis=3), axis=1)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN,))


@triton.jit
def _frag_fma_mainloop(x_ptr, qw_ptr, scales_ptr, zeros_ptr, n0, k_lo, k_hi, M, N, K, stride_xm,
                       GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, IS_BF16: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, BM: tl.constexpr, MV: tl.constexpr, PTX: tl.constexpr,
                       PREFETCH: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """accT [BN, BM] for output features n0 .. n0 + BN over K range [k_lo, k_hi) and tokens
    0 .. M - 1 <= MV - 1, scales applied (module docstring). n0 and BN are multiples of 16, k_lo and
    k_hi of BK (a multiple of 64); x's rows start at even elements (its 32-bit words are read). PTX:
    the fp16x2 products (fp16, CUDA); ASM: CUDA (inline PTX loads), not the interpreter.
    An empty range (the last splits of a K that split-K does not divide) gives zeros."""
    T: tl.constexpr = BN // 16
    KB: tl.constexpr = BK // 64
    GROUPED: tl.constexpr = GROUP > 0
    SPLIT: tl.constexpr = GROUP == 32  # words 0, 1 and 2, 3 of a lane lie in two groups
    # tiles past the layer's last read its last tile instead (their rows are never stored): the
    # loads need no mask
    t4 = tl.reshape((n0 // 16 + tl.arange(0, T)) % (N // 16), (T, 1, 1, 1))
    kb4 = tl.reshape(tl.arange(0, KB), (1, KB, 1, 1))
    g4 = tl.reshape(tl.arange(0, 8), (1, 1, 8, 1))
    q4 = tl.reshape(tl.arange(0, 4), (1, 1, 1, 4))
    lane = t4 * (2 * K) + kb4 * 128 + g4 * 16 + q4 * 4
    w_ptrs = qw_ptr + lane[:, :, :, :, None] + tl.reshape(tl.arange(0, 4), (1, 1, 1, 1, 4))
    rows_lo = t4 * 16 + g4
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    xo = kb4 * 32 + q4
    # scales and zero points of rows g, g + 8, in the shape the steps load them (per group: one
    # group a step, or one a 64-input block); per channel the zero points (or 8) are fixed for
    # the loop and the scales applied after it
    if GROUP >= BK:
        cell = tl.zeros((T, 1, 8, 1), tl.float32)
    elif GROUPED:
        cell = tl.zeros((T, KB, 8, 1), tl.float32)
    else:
        cell = tl.zeros((1, 1, 1, 1), tl.float32)
    if SYMMETRIC:
        z_lo0 = tl.full((1, 1, 1, 1), 8.0, tl.float32)
        z_hi0 = z_lo0
    elif GROUPED:
        z_lo0, z_hi0 = cell, cell
    else:
        z_lo0 = _ld_table(zeros_ptr + rows_lo, ASM).to(tl.float32)
        z_hi0 = _ld_table(zeros_ptr + rows_lo + 8, ASM).to(tl.float32)
    s_lo0, s_hi0, s_lo1, s_hi1, z_lo1, z_hi1 = cell + 1.0, cell + 1.0, cell + 1.0, cell + 1.0, z_lo0, z_hi0
    acc = tl.zeros((T, KB, 8, 4), tl.float32)
    l0, h0, l1, h1, l2, h2, l3, h3 = acc, acc, acc, acc, acc, acc, acc, acc
    # the last step of the range, in bounds even when the range is empty (k_hi >= BK always)
    k_last = k_hi - BK
    if PREFETCH:
        k0 = tl.minimum(k_lo, k_last)
        p, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1 = _load_step(
            w_ptrs, scales_ptr, zeros_ptr, k0, kb4, rows_lo, N, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1, z_lo1,
            z_hi1, GROUP, SYMMETRIC, BK, ASM)
        _pdl_wait(PDL)
        xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3 = _x_words(x32, 0, stride_xm, k0, xo, M)
        if MV > 1:
            ya0, yb0, ya1, yb1, ya2, yb2, ya3, yb3 = _x_words(x32, 1, stride_xm, k0, xo, M)
    for k in tl.range(k_lo, k_hi, BK, num_stages=1):  # no software pipelining: the registers hold the prefetch
        if PREFETCH:
            kn = tl.minimum(k + BK, k_last)
            pn, ns_lo0, ns_hi0, nz_lo0, nz_hi0, ns_lo1, ns_hi1, nz_lo1, nz_hi1 = _load_step(
                w_ptrs, scales_ptr, zeros_ptr, kn, kb4, rows_lo, N, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1,
                z_lo1, z_hi1, GROUP, SYMMETRIC, BK, ASM)
            nxa0, nxb0, nxa1, nxb1, nxa2, nxb2, nxa3, nxb3 = _x_words(x32, 0, stride_xm, kn, xo, M)
            if MV > 1:
                nya0, nyb0, nya1, nyb1, nya2, nyb2, nya3, nyb3 = _x_words(x32, 1, stride_xm, kn, xo, M)
        else:
            p, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1 = _load_step(
                w_ptrs, scales_ptr, zeros_ptr, k, kb4, rows_lo, N, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1,
                z_lo1, z_hi1, GROUP, SYMMETRIC, BK, ASM)
            xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3 = _x_words(x32, 0, stride_xm, k, xo, M)
            if MV > 1:
                ya0, yb0, ya1, yb1, ya2, yb2, ya3, yb3 = _x_words(x32, 1, stride_xm, k, xo, M)
        if MV > 2:
            # tokens 2 and 3 (M = 3, 4 only): activations loaded at the step that uses them
            ua0, ub0, ua1, ub1, ua2, ub2, ua3, ub3 = _x_words(x32, 2, stride_xm, k, xo, M)
            va0, vb0, va1, vb1, va2, vb2, va3, vb3 = _x_words(x32, 3, stride_xm, k, xo, M)
        if MV == 1:  # absent tokens' names, never computed with
            ya0, yb0, ya1, yb1, ya2, yb2, ya3, yb3 = xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3
        if MV < 4:
            ua0, ub0, ua1, ub1, ua2, ub2, ua3, ub3 = xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3
            va0, vb0, va1, vb1, va2, vb2, va3, vb3 = xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3
        w0, w1, w2, w3 = _split4(p, T, KB)
        if PTX:
            # the zero points as fp16x2 offsets, the scales times 16 (the sums' unit)
            zn_lo0, _ = _neg_zero_pairs(z_lo0)
            _, zn_hi0 = _neg_zero_pairs(z_hi0)
            zn_lo1, _ = _neg_zero_pairs(z_lo1)
            _, zn_hi1 = _neg_zero_pairs(z_hi1)
            d0, d1, d2, d3 = _frag_dq(w0, zn_lo0, zn_hi0)
            e0, e1, e2, e3 = _frag_dq(w1, zn_lo0, zn_hi0)
            f0, f1, f2, f3 = _frag_dq(w2, zn_lo1, zn_hi1)
            g0, g1, g2, g3 = _frag_dq(w3, zn_lo1, zn_hi1)
            t_lo0, t_hi0, t_lo1, t_hi1 = s_lo0 * 16.0, s_hi0 * 16.0, s_lo1 * 16.0, s_hi1 * 16.0
            l0, h0 = _token_ptx(l0, h0, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3,
                                xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3, t_lo0, t_hi0, t_lo1, t_hi1, GROUPED, SPLIT)
            if MV > 1:
                l1, h1 = _token_ptx(l1, h1, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3,
                                    ya0, yb0, ya1, yb1, ya2, yb2, ya3, yb3, t_lo0, t_hi0, t_lo1, t_hi1, GROUPED, SPLIT)
            if MV > 2:
                l2, h2 = _token_ptx(l2, h2, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3,
                                    ua0, ub0, ua1, ub1, ua2, ub2, ua3, ub3, t_lo0, t_hi0, t_lo1, t_hi1, GROUPED, SPLIT)
                l3, h3 = _token_ptx(l3, h3, d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3,
                                    va0, vb0, va1, vb1, va2, vb2, va3, vb3, t_lo0, t_hi0, t_lo1, t_hi1, GROUPED, SPLIT)
        else:
            # sums of code · x over the step, per token (words 0, 1 then 2, 3: one group at groups of 32)
            c0, d0, c1, d1, c2, d2, c3, d3 = _word_tokens(acc, acc, acc, acc, acc, acc, acc, acc, w0, xa0, xb0, ya0, yb0,
                                                          ua0, ub0, va0, vb0, MV, IS_BF16, True)
            c0, d0, c1, d1, c2, d2, c3, d3 = _word_tokens(c0, d0, c1, d1, c2, d2, c3, d3, w1, xa1, xb1, ya1, yb1,
                                                          ua1, ub1, va1, vb1, MV, IS_BF16, False)
            if SPLIT:
                e0, f0, e1, f1, e2, f2, e3, f3 = _word_tokens(acc, acc, acc, acc, acc, acc, acc, acc, w2, xa2, xb2,
                                                              ya2, yb2, ua2, ub2, va2, vb2, MV, IS_BF16, True)
                e0, f0, e1, f1, e2, f2, e3, f3 = _word_tokens(e0, f0, e1, f1, e2, f2, e3, f3, w3, xa3, xb3,
                                                              ya3, yb3, ua3, ub3, va3, vb3, MV, IS_BF16, False)
            else:
                c0, d0, c1, d1, c2, d2, c3, d3 = _word_tokens(c0, d0, c1, d1, c2, d2, c3, d3, w2, xa2, xb2, ya2, yb2,
                                                              ua2, ub2, va2, vb2, MV, IS_BF16, False)
                c0, d0, c1, d1, c2, d2, c3, d3 = _word_tokens(c0, d0, c1, d1, c2, d2, c3, d3, w3, xa3, xb3, ya3, yb3,
                                                              ua3, ub3, va3, vb3, MV, IS_BF16, False)
                e0, f0, e1, f1, e2, f2, e3, f3 = c0, d0, c1, d1, c2, d2, c3, d3  # no second group
            l0, h0 = _finish_fma(l0, h0, c0, d0, e0, f0, xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3, s_lo0, s_hi0, z_lo0,
                                 z_hi0, s_lo1, s_hi1, z_lo1, z_hi1, GROUPED, SPLIT, IS_BF16)
            if MV > 1:
                l1, h1 = _finish_fma(l1, h1, c1, d1, e1, f1, ya0, yb0, ya1, yb1, ya2, yb2, ya3, yb3, s_lo0, s_hi0,
                                     z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1, GROUPED, SPLIT, IS_BF16)
            if MV > 2:
                l2, h2 = _finish_fma(l2, h2, c2, d2, e2, f2, ua0, ub0, ua1, ub1, ua2, ub2, ua3, ub3, s_lo0, s_hi0,
                                     z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1, GROUPED, SPLIT, IS_BF16)
                l3, h3 = _finish_fma(l3, h3, c3, d3, e3, f3, va0, vb0, va1, vb1, va2, vb2, va3, vb3, s_lo0, s_hi0,
                                     z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1, GROUPED, SPLIT, IS_BF16)
        if PREFETCH:
            p, s_lo0, s_hi0, z_lo0, z_hi0, s_lo1, s_hi1, z_lo1, z_hi1 = (pn, ns_lo0, ns_hi0, nz_lo0, nz_hi0, ns_lo1,
                                                                        ns_hi1, nz_lo1, nz_hi1)
            xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3 = nxa0, nxb0, nxa1, nxb1, nxa2, nxb2, nxa3, nxb3
            if MV > 1:
                ya0, yb0, ya1, yb1, ya2, yb2, ya3, yb3 = nya0, nyb0, nya1, nyb1, nya2, nyb2, nya3, nyb3
    cols = tl.arange(0, BM)[None, :]
    accT = tl.where(cols == 0, _rows(l0, h0, BN)[:, None], 0.0)
    if MV > 1:
        accT += tl.where(cols == 1, _rows(l1, h1, BN)[:, None], 0.0)
    if MV > 2:
        accT += tl.where(cols == 2, _rows(l2, h2, BN)[:, None], 0.0)
        accT += tl.where(cols == 3, _rows(l3, h3, BN)[:, None], 0.0)
    if not GROUPED:
        offs_n = n0 + tl.arange(0, BN)
        s = tl.load(scales_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if PTX:
            s = s * 16.0  # the fp16x2 sums are in units of 1/16
        accT = accT * s[:, None]
    return accT
